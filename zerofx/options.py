"""Compiler options: one dataclass, one place where every knob is documented and validated."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from zerofx.errors import ZeroFXError

EXECUTORS = ("aten",)
CHECKPOINT_POLICIES = ("auto", "full")
ACTIVATION_TIERS = ("none", "host", "disk")
OPTIMIZER_TIERS = ("none", "host", "disk", "auto")


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

        activation_budget: most bytes of activations the forward may keep resident for the
            backward, per compiled graph: a float in (0, 1] is a fraction of the unconstrained
            amount (what the forward saves when nothing that costs FLOPs is recomputed), an int
            is bytes. The checkpoint pass then recomputes (or offloads) the cheapest values
            until the plan fits; a budget below what any plan can meet is an error that names
            the minimum. None: torch's min-cut partitioner decides, as without zerofx.
        checkpoint: ``"auto"`` (decide by budget and the options below) or ``"full"``: recompute
            everything inside each block (transformer layer) and save only block boundaries.
        checkpoint_modules: fnmatch patterns of module names (``"blocks.1"``, ``"blocks.*.attn"``)
            to checkpoint: everything computed inside is recomputed, their boundaries saved.
        checkpoint_save_ops: ops whose outputs are always saved (``"aten.mm"`` or ``"mm"``). Alone
            (no budget, no checkpointed modules) everything else is recomputed: selective AC.
        offload_activations: ``"none"``, ``"host"`` (pinned host memory; on a CPU-only machine
            host memory is device memory, so this only exercises the mechanism) or ``"disk"``
            (files under ``offload_dir``): saved activations whose copies hide behind compute,
            or that the budget needs gone, are parked there between forward and backward.
        offload_optimizer: where fp32 parameter shards (the master weights) and optimizer state
            live between steps: ``"none"`` (device memory), ``"host"`` (host memory, streamed to
            the device for the step), ``"disk"`` (memory-mapped files under ``offload_dir``,
            streamed in a window at a time; ZeRO-Infinity's NVMe tier) or ``"auto"`` (disk when
            parameters plus Adam's state would exceed ``host_memory_cap``, else host). Call
            ``zerofx.offload_optimizer(optimizer)`` on the optimizer built over the model.
        offload_dir: folder for disk offload files; checked (created, written) when the options
            are built, so a bad path fails at ``zerofx.compile``, not mid-step. Defaults to a
            ``zerofx-offload`` folder in the system temp folder.
        host_memory_cap: bytes of host memory model state may use; sizes the optimizer's
            streaming window (a quarter of the cap) and decides ``offload_optimizer="auto"``.
    """

    dump_dir: str | None = field(default_factory=lambda: os.environ.get("ZEROFX_DUMP") or None)
    disable_passes: tuple[str, ...] = ()
    verify: bool = True
    executor: str = "aten"
    activation_budget: float | int | None = None
    checkpoint: str = "auto"
    checkpoint_modules: tuple[str, ...] = ()
    checkpoint_save_ops: tuple[str, ...] = ()
    offload_activations: str = "none"
    offload_optimizer: str = "none"
    offload_dir: str | None = None
    host_memory_cap: int | None = None

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
        self._check_memory_options()

    def _check_memory_options(self) -> None:
        budget = self.activation_budget
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, float)):
                raise ZeroFXError(f"option activation_budget must be a fraction (float in (0, 1]) or bytes (int), "
                                  f"got {budget!r}")
            if isinstance(budget, float) and not 0.0 < budget <= 1.0:
                raise ZeroFXError(f"option activation_budget={budget}: a float budget is a fraction of the "
                                  "unconstrained activation memory and must be in (0, 1]; give bytes as an int")
            if isinstance(budget, int) and budget < 0:
                raise ZeroFXError(f"option activation_budget={budget}: bytes cannot be negative")
        if self.checkpoint not in CHECKPOINT_POLICIES:
            raise ZeroFXError(f"option checkpoint={self.checkpoint!r}: choose one of {list(CHECKPOINT_POLICIES)}")
        for name in ("checkpoint_modules", "checkpoint_save_ops"):
            value = getattr(self, name)
            value = (value,) if isinstance(value, str) else tuple(value)
            if not all(isinstance(v, str) and v for v in value):
                raise ZeroFXError(f"option {name} must be a tuple of non-empty strings, got {value!r}")
            object.__setattr__(self, name, value)
        for op in self.checkpoint_save_ops:
            parts = op.split(".")
            namespace, name = (parts[0], parts[1]) if len(parts) >= 2 else ("aten", parts[0])
            try:
                getattr(getattr(torch.ops, namespace), name)
            except (AttributeError, RuntimeError):
                raise ZeroFXError(f"option checkpoint_save_ops: no op named {op!r} "
                                  "(write 'aten.mm', 'mm' or 'aten.mm.default')") from None
        if self.offload_activations not in ACTIVATION_TIERS:
            raise ZeroFXError(f"option offload_activations={self.offload_activations!r}: "
                              f"choose one of {list(ACTIVATION_TIERS)}")
        if self.offload_optimizer not in OPTIMIZER_TIERS:
            raise ZeroFXError(f"option offload_optimizer={self.offload_optimizer!r}: "
                              f"choose one of {list(OPTIMIZER_TIERS)}")
        cap = self.host_memory_cap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise ZeroFXError(f"option host_memory_cap must be a positive number of bytes, got {cap!r}")
        if self.offload_optimizer == "auto" and cap is None:
            raise ZeroFXError("option offload_optimizer='auto' decides between host and disk by "
                              "host_memory_cap: set host_memory_cap (bytes)")
        if self.offload_dir is not None and not isinstance(self.offload_dir, (str, os.PathLike)):
            raise ZeroFXError(f"option offload_dir must be a path, got {type(self.offload_dir).__name__}")
        if "disk" in (self.offload_activations, self.offload_optimizer) or self.offload_optimizer == "auto":
            from zerofx.offload import check_offload_dir, default_offload_dir

            if self.offload_dir is None:
                object.__setattr__(self, "offload_dir", default_offload_dir())
            check_offload_dir(self.offload_dir)

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
