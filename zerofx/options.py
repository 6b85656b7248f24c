"""Compiler options: one dataclass, one place where every knob is documented and validated."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from zerofx.errors import ZeroFXError

EXECUTORS = ("aten",)


@dataclass(frozen=True)
class Options:
    """Options accepted by ``zerofx.compile(model, mesh, **options)`` and by the backend.

    Attributes:
        dump_dir: write every graph before and after every pass, a per-pass summary and a diff
            under this folder. Defaults to the ``ZEROFX_DUMP`` environment variable.
        disable_passes: names of pipeline passes to skip (see ``zerofx.passes.PASS_NAMES``).
            Every pass is an optimization over a correct baseline: the marker ops the passes
            lower have eager implementations, so disabling any pass keeps results correct.
        verify: lint the graph and check zerofx's invariants after every pass.
        executor: what runs the final graphs; ``"aten"`` runs them op by op.
        bucket_bytes: cap of a collective bucket in bytes (gathered size for all-gathers, input
            size for reduce-scatters); ``"auto"`` takes the cost model's bandwidth-saturating
            size; 0 disables bucketing.
        prefetch_bytes: how much the schedule pass may raise a graph's estimated peak memory to
            overlap communication; ``"auto"`` allows twice the largest gathered bucket.
        keep_gathered_bytes: selective unsharding budget: bytes of gathered parameters that may
            stay alive from forward to backward to skip their re-gather (0: pure ZeRO-3).
        calibrate: measure the collective cost constants on the mesh at ``zerofx.compile``
            (a short collective on every rank, cached on disk per backend and world size).
        cost_model: the ``zerofx.passes.cost_model.CostModel`` decisions read; filled by
            calibration, defaults otherwise.
    """

    dump_dir: str | None = field(default_factory=lambda: os.environ.get("ZEROFX_DUMP") or None)
    disable_passes: tuple[str, ...] = ()
    verify: bool = True
    executor: str = "aten"
    bucket_bytes: int | str = "auto"
    prefetch_bytes: int | str = "auto"
    keep_gathered_bytes: int = 0
    calibrate: bool = False
    cost_model: object = None

    def __post_init__(self) -> None:
        from zerofx.passes.pipeline import PASS_NAMES

        if isinstance(self.disable_passes, str):
            object.__setattr__(self, "disable_passes", (self.disable_passes,))
        object.__setattr__(self, "disable_passes", tuple(self.disable_passes))
        unknown = sorted(set(self.disable_passes) - set(PASS_NAMES))
        if unknown:
            raise ZeroFXError(
                f"option disable_passes: unknown pass name(s) {unknown}; "
                f"the pipeline's passes are {list(PASS_NAMES)}"
            )
        if self.executor not in EXECUTORS:
            raise ZeroFXError(f"option executor={self.executor!r}: choose one of {list(EXECUTORS)}")
        for name in ("bucket_bytes", "prefetch_bytes"):
            value = getattr(self, name)
            if not (value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)):
                raise ZeroFXError(f"option {name}={value!r}: give a byte count >= 0 or 'auto'")
        if not isinstance(self.keep_gathered_bytes, int) or self.keep_gathered_bytes < 0:
            raise ZeroFXError(f"option keep_gathered_bytes={self.keep_gathered_bytes!r}: give a byte count >= 0")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise ZeroFXError(f"option dump_dir must be a path, got {type(self.dump_dir).__name__}")

    @classmethod
    def from_kwargs(cls, options: Options | dict[str, Any] | None = None, **kwargs: Any) -> Options:
        """Build options from an Options, a dict and/or keyword arguments; unknown names raise."""
        merged: dict[str, Any] = {}
        if isinstance(options, Options):
            merged.update({f.name: getattr(options, f.name) for f in dataclasses.fields(options)})
        elif options:
            merged.update(options)
        merged.update(kwargs)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(merged) - names)
        if unknown:
            raise ZeroFXError(f"unknown zerofx option(s) {unknown}; valid options are {sorted(names)}")
        return cls(**merged)
