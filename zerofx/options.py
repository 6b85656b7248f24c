"""Compiler options: one dataclass, one place where every knob is documented and validated."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from zerofx.errors import ZeroFXError

EXECUTORS = ("aten", "triton", "inductor")
STAGES = (1, 2, 3)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

# Options that decide how parameters are laid out: they take effect where the model is sharded
# (zerofx.compile or zerofx.shard), not in the dynamo backend, which only sees graphs.
LAYOUT_OPTIONS = ("stage", "persistence_threshold", "param_dtype", "reduce_dtype", "loss_scale",
                  "initial_loss_scale", "loss_scale_window", "local_optimizer_step")


def _dtype(name: str, value: Any) -> torch.dtype | None:
    if value is None:
        return None
    if isinstance(value, str) and value in _DTYPES:
        value = _DTYPES[value]
    if value not in (torch.float32, torch.bfloat16, torch.float16):
        raise ZeroFXError(f"option {name}={value!r}: choose None, torch.float32, torch.bfloat16 or torch.float16 "
                          f"(or one of {sorted(_DTYPES)})")
    return value
CHECKPOINT_POLICIES = ("auto", "full")
ACTIVATION_TIERS = ("none", "host", "disk")
OPTIMIZER_TIERS = ("none", "host", "disk", "auto")


@dataclass(frozen=True)
class Options:
    """Options accepted by ``zerofx.compile(model, mesh, **options)`` and by the backend.

    Attributes:
        stage: the ZeRO stage (docs/zero_stages.md). 3 (default): parameters, gradients and
            optimizer state are 1/N per rank; parameters are all-gathered in forward and
            backward. 2: every rank keeps whole parameters (refreshed by one all-gather after
            each optimizer step); gradients and optimizer state are 1/N. 1: whole parameters and
            a whole gradient buffer, reduced once per accumulation boundary; optimizer state 1/N.
        persistence_threshold: stage 3 only: parameters with fewer elements than this stay
            whole on every rank (gradients all-reduced), trading a little memory for fewer,
            larger collectives (DeepSpeed's ``stage3_param_persistence_threshold``). 0: none.
        param_dtype: compute dtype (``torch.bfloat16`` / ``torch.float16``, or "bf16"/"fp16").
            Parameters are cast from their fp32 shards *before* the all-gather (half the
            bytes move), forward inputs are cast too; the optimizer keeps fp32 master shards.
            Buffers are never cast (BatchNorm's running stats stay fp32), and the weight and
            bias of batch and instance norm layers keep their fp32 master dtype, so batch_norm
            runs its bf16 input against fp32 weights and statistics (computing in fp32), as
            under torch.autocast; a norm layer whose tensors are neither all fp32 nor all
            ``param_dtype`` is an error naming this option (docs/zero_stages.md, norm layers).
            None: compute in the parameters' own dtype.
        reduce_dtype: dtype gradients are reduced (and accumulated) in; None: the master
            (parameter) dtype, fp32 for an fp32 model, whatever ``param_dtype`` is.
        loss_scale: "dynamic" for dynamic loss scaling (skip the step and back off on inf/nan,
            grow after ``loss_scale_window`` good steps), through torch's ``ShardedGradScaler``;
            get it with ``zerofx.loss_scaler(model)``. Required with fp16 (param or reduce dtype).
        initial_loss_scale: the first loss scale (2**16, as DeepSpeed and torch.amp).
        loss_scale_window: good steps before the scale doubles.
        local_optimizer_step: let elementwise ``torch.optim`` optimizers (SGD, Adam, AdamW, ...)
            built over the model step each rank's local shards directly instead of going through
            DTensor's dispatch op by op, from their second step on (zerofx/optim.py). Same
            arithmetic, same state dict; False keeps every step on the DTensor path.
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
        bucket_bytes: cap of a collective bucket in bytes (gathered size for all-gathers, input
            size for reduce-scatters); ``"auto"`` takes the cost model's bandwidth-saturating
            size as a target: buckets are whole transformer blocks (FSDP2's unit), a few small
            ones or one large one, up to ``host_memory_cap / 16`` when a host cap is set (see
            passes/bucket.py); an int is a hard cap; 0 disables bucketing.
        prefetch_bytes: how much the schedule pass may raise a graph's estimated peak memory to
            overlap communication; ``"auto"`` allows the largest gathered bucket (one block
            prefetched, as FSDP2 does).
        keep_gathered_bytes: selective unsharding budget: bytes of gathered parameters that may
            stay alive from forward to backward to skip their re-gather (0: pure ZeRO-3).
        calibrate: measure the collective cost constants on the mesh at ``zerofx.compile``
            (a short collective on every rank, cached on disk per backend and world size).
        cost_model: the ``zerofx.passes.cost_model.CostModel`` decisions read; filled by
            calibration, defaults otherwise.

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

    The options in ``LAYOUT_OPTIONS`` shape the parameters, so they take effect where the model
    is sharded (``zerofx.compile`` or ``zerofx.shard``); the backend rejects them.
    """

    stage: int = 3
    persistence_threshold: int = 0
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    loss_scale: str | None = None
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    local_optimizer_step: bool = True
    dump_dir: str | None = field(default_factory=lambda: os.environ.get("ZEROFX_DUMP") or None)
    disable_passes: tuple[str, ...] = ()
    verify: bool = True
    executor: str = "aten"
    bucket_bytes: int | str = "auto"
    prefetch_bytes: int | str = "auto"
    keep_gathered_bytes: int = 0
    calibrate: bool = False
    cost_model: object = None
    autotune: bool = False
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
        for name in ("bucket_bytes", "prefetch_bytes"):
            value = getattr(self, name)
            if not (value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)):
                raise ZeroFXError(f"option {name}={value!r}: give a byte count >= 0 or 'auto'")
        if not isinstance(self.keep_gathered_bytes, int) or self.keep_gathered_bytes < 0:
            raise ZeroFXError(f"option keep_gathered_bytes={self.keep_gathered_bytes!r}: give a byte count >= 0")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise ZeroFXError(f"option dump_dir must be a path, got {type(self.dump_dir).__name__}")
        self._check_layout()
        self._check_memory_options()

    def _check_layout(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in STAGES:
            raise ZeroFXError(f"option stage={self.stage!r}: choose 1, 2 or 3")
        threshold = self.persistence_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ZeroFXError(f"option persistence_threshold={threshold!r}: give a number of elements >= 0")
        if threshold and self.stage != 3:
            raise ZeroFXError(
                f"option persistence_threshold={threshold} only applies to stage 3: stage {self.stage} keeps "
                "every parameter whole already (drop persistence_threshold, or use stage=3)"
            )
        if not isinstance(self.local_optimizer_step, bool):
            raise ZeroFXError(f"option local_optimizer_step={self.local_optimizer_step!r}: give True or False")
        param_dtype = _dtype("param_dtype", self.param_dtype)
        reduce_dtype = _dtype("reduce_dtype", self.reduce_dtype)
        object.__setattr__(self, "param_dtype", None if param_dtype is torch.float32 else param_dtype)
        object.__setattr__(self, "reduce_dtype", reduce_dtype)
        if self.loss_scale not in (None, "dynamic"):
            raise ZeroFXError(f"option loss_scale={self.loss_scale!r}: choose None or 'dynamic'")
        half = [name for name in ("param_dtype", "reduce_dtype") if getattr(self, name) is torch.float16]
        if half and self.loss_scale is None:
            raise ZeroFXError(
                f"option loss_scale is required with {half[0]}=torch.float16: fp16 gradients underflow "
                "without loss scaling; pass loss_scale='dynamic' (or use bfloat16)"
            )
        if not (isinstance(self.initial_loss_scale, (int, float)) and self.initial_loss_scale > 0):
            raise ZeroFXError(f"option initial_loss_scale={self.initial_loss_scale!r}: give a number > 0")
        if isinstance(self.loss_scale_window, bool) or not isinstance(self.loss_scale_window, int) \
                or self.loss_scale_window < 1:
            raise ZeroFXError(f"option loss_scale_window={self.loss_scale_window!r}: give a number of steps >= 1")

    def non_default_layout(self) -> list[str]:
        """The layout options (``LAYOUT_OPTIONS``) set to something other than their default."""
        default = Options(dump_dir=None)
        return [n for n in LAYOUT_OPTIONS if getattr(self, n) != getattr(default, n)]

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
            merged.update({f.name: getattr(options, f.name) for f in dataclasses.fields(cls)})
        elif options:
            merged.update(options)
        merged.update(kwargs)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(merged) - names)
        if unknown:
            raise ZeroFXError(f"unknown zerofx option(s) {unknown}; valid options are {sorted(names)}")
        return cls(**merged)
