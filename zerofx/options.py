"""Compiler options: one dataclass, one place where every knob is documented and validated."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from zerofx.errors import ZeroFXError

EXECUTORS = ("aten", "triton", "inductor")


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
        executor: what runs the final graphs. ``"aten"`` (default) runs them op by op.
            ``"triton"`` replaces fusible regions (pointwise chains, last-dim reductions such
            as softmax / LayerNorm / RMSNorm, with their neighbours) by generated Triton
            kernels and runs the rest as ATen; it needs a CUDA GPU, or ``TRITON_INTERPRET=1``
            on CPU (slow: for tests), and otherwise falls back to ATen with a warning.
            ``"inductor"`` hands the final graph to Inductor, for comparison.
            See docs/codegen.md.
        autotune: with ``executor="triton"`` on a GPU, let Triton time a few block sizes per
            kernel instead of using the heuristic's choice. Ignored by the interpreter.
    """

    dump_dir: str | None = field(default_factory=lambda: os.environ.get("ZEROFX_DUMP") or None)
    disable_passes: tuple[str, ...] = ()
    verify: bool = True
    executor: str = "aten"
    autotune: bool = False

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
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise ZeroFXError(f"option dump_dir must be a path, got {type(self.dump_dir).__name__}")

    @classmethod
    def from_kwargs(cls, options: Options | dict[str, Any] | None = None, **kwargs: Any) -> Options:
        """Build options from an Options, a dict and/or keyword arguments; unknown names raise."""
        merged: dict[str, Any] = {}
        if isinstance(options, Options):
            merged.update(dataclasses.asdict(options))
        elif options:
            merged.update(options)
        merged.update(kwargs)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(merged) - names)
        if unknown:
            raise ZeroFXError(f"unknown zerofx option(s) {unknown}; valid options are {sorted(names)}")
        return cls(**merged)
