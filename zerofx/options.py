"""Compiler options: the flat keywords users pass, and the five typed policies zerofx reads.

Users write ``zerofx.compile(model, mesh, stage=2, bucket_bytes=...)``: one flat namespace,
documented in one place (``Options``). Code inside zerofx reads the policy of its concern
(``options.comm.bucket_bytes``), each a small frozen dataclass that validates its own fields:

    LayoutPolicy   how parameters are sharded, cast and stepped   (fixed when the model is sharded)
    CommPolicy     bucketing, prefetch, selective unsharding, calibration
    MemoryPolicy   activation budget, checkpointing, offload tiers, host memory cap
    DebugPolicy    dumps, disabled passes, invariant checks
    CodegenPolicy  how graphs are captured (dynamic shapes), which executor runs them, autotuning

Validation is pure (no I/O, no imports of other zerofx layers): the offload folder is checked
where it is first used (``zerofx.runtime.offload_store.resolve_offload_dir`` at compile), and
pass names in ``disable_passes`` by the pipeline (``zerofx.passes.pipeline.resolve_disabled``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from zerofx.errors import ZeroFXError

__all__ = [
    "Options",
    "LayoutPolicy",
    "CommPolicy",
    "MemoryPolicy",
    "DebugPolicy",
    "CodegenPolicy",
    "LAYOUT_OPTIONS",
    "EXECUTORS",
    "ZERO_STAGES",
    "closest",
]

EXECUTORS = ("aten", "triton", "inductor")
ZERO_STAGES = (1, 2, 3)
CHECKPOINT_POLICIES = ("auto", "full")
ACTIVATION_TIERS = ("none", "host", "disk")
OPTIMIZER_TIERS = ("none", "host", "disk", "auto")
QUANTIZE_WEIGHTS = (None, "int8", "fp8")
QUANTIZE_GRADS = (None, "int8", "int4")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


# torch.compile's own keywords, which zerofx.compile does not take (``dynamic`` is a zerofx option)
_TORCH_COMPILE_KEYWORDS = frozenset({"fullgraph", "disable"})  # (mode= and backend= are refused apart)


def closest(name: str, valid: Any) -> str:
    """`` (did you mean 'x'?)`` for the valid name closest to a misspelt ``name``, or ''."""
    match = difflib.get_close_matches(name, [str(v) for v in valid], n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _dtype(name: str, value: Any) -> torch.dtype | None:
    if value is None:
        return None
    if isinstance(value, str) and value in _DTYPES:
        value = _DTYPES[value]
    if value not in (torch.float32, torch.bfloat16, torch.float16):
        raise ZeroFXError(
            f"option {name}={value!r}: choose None, torch.float32, torch.bfloat16 or torch.float16 "
            f"(or one of {sorted(_DTYPES)})"
        )
    return value


def _byte_count(name: str, value: Any, auto: bool = False) -> None:
    if auto and value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ZeroFXError(f"option {name}={value!r}: give a byte count >= 0" + (" or 'auto'" if auto else ""))


@dataclass(frozen=True)
class LayoutPolicy:
    """How parameters are laid out and stepped (see ``Options`` for each field)."""

    stage: int = 3
    persistence_threshold: int = 0
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    loss_scale: str | None = None
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    loss_scale_hysteresis: int = 1
    loss_scale_consecutive_hysteresis: bool = False
    min_loss_scale: float | None = None
    local_optimizer_step: bool = True
    plain_graph_inputs: bool = True
    secondary_shard: bool = False
    tp_dim: str | None = None
    shard_placement_fn: Callable | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in ZERO_STAGES:
            raise ZeroFXError(f"option stage={self.stage!r}: choose 1, 2 or 3")
        if self.tp_dim is not None and (not isinstance(self.tp_dim, str) or not self.tp_dim):
            raise ZeroFXError(f"option tp_dim={self.tp_dim!r}: give the name of the mesh's tensor-parallel dimension")
        if not isinstance(self.secondary_shard, bool):
            raise ZeroFXError(f"option secondary_shard={self.secondary_shard!r}: give True or False")
        if self.secondary_shard and self.stage != 3:
            raise ZeroFXError(
                f"option secondary_shard=True keeps a secondary partition of stage 3's gathered parameters; "
                f"stage {self.stage} gathers none (use stage=3, or drop secondary_shard)"
            )
        threshold = self.persistence_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ZeroFXError(f"option persistence_threshold={threshold!r}: give a number of elements >= 0")
        if threshold and self.stage != 3:
            raise ZeroFXError(
                f"option persistence_threshold={threshold} only applies to stage 3: stage {self.stage} keeps "
                "every parameter whole already (drop persistence_threshold, or use stage=3)"
            )
        if self.shard_placement_fn is not None and not callable(self.shard_placement_fn):
            raise ZeroFXError(
                f"option shard_placement_fn={self.shard_placement_fn!r}: give a function of a parameter "
                "returning torch.distributed.tensor.Shard(dim), or None for zerofx's choice"
            )
        for name in ("local_optimizer_step", "plain_graph_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise ZeroFXError(f"option {name}={getattr(self, name)!r}: give True or False")
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
        if (
            isinstance(self.loss_scale_window, bool)
            or not isinstance(self.loss_scale_window, int)
            or self.loss_scale_window < 1
        ):
            raise ZeroFXError(f"option loss_scale_window={self.loss_scale_window!r}: give a number of steps >= 1")
        hysteresis = self.loss_scale_hysteresis
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or hysteresis < 1:
            raise ZeroFXError(
                f"option loss_scale_hysteresis={hysteresis!r}: give a number of overflows >= 1 (1: every overflow "
                "halves the scale)"
            )
        if not isinstance(self.loss_scale_consecutive_hysteresis, bool):
            raise ZeroFXError(
                f"option loss_scale_consecutive_hysteresis={self.loss_scale_consecutive_hysteresis!r}: give True or False"
            )
        floor = self.min_loss_scale
        if floor is not None and (isinstance(floor, bool) or not isinstance(floor, (int, float)) or not floor > 0):
            raise ZeroFXError(f"option min_loss_scale={floor!r}: give a number > 0, or None for no floor")
        if floor is not None and isinstance(self.initial_loss_scale, (int, float)) and self.initial_loss_scale < floor:
            raise ZeroFXError(
                f"option initial_loss_scale={self.initial_loss_scale!r} is below min_loss_scale={floor!r}: start "
                "at or above the floor"
            )


# Options that decide how parameters are laid out: they take effect where the model is sharded
# (zerofx.compile or zerofx.shard), not in the dynamo backend, which only sees graphs.
LAYOUT_OPTIONS = tuple(f.name for f in dataclasses.fields(LayoutPolicy))


@dataclass(frozen=True)
class CommPolicy:
    """Bucketing, prefetch and selective unsharding budgets, calibration (see ``Options``)."""

    bucket_bytes: int | str = "auto"
    prefetch_bytes: int | str = "auto"
    keep_gathered_bytes: int = 0
    calibrate: bool = False
    quantize_weights: str | None = None
    quantize_grads: str | None = None
    quantize_block: int = 256

    def __post_init__(self) -> None:
        _byte_count("bucket_bytes", self.bucket_bytes, auto=True)
        _byte_count("prefetch_bytes", self.prefetch_bytes, auto=True)
        _byte_count("keep_gathered_bytes", self.keep_gathered_bytes)
        if not isinstance(self.calibrate, bool):
            raise ZeroFXError(f"option calibrate={self.calibrate!r}: give True or False")
        block = self.quantize_block
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ZeroFXError(f"option quantize_block={block!r}: give a number of elements >= 1 (e.g. 256)")
        if self.quantize_weights not in QUANTIZE_WEIGHTS:
            raise ZeroFXError(
                f"option quantize_weights={self.quantize_weights!r}: choose None, 'int8' or 'fp8'"
                + closest(str(self.quantize_weights), QUANTIZE_WEIGHTS[1:])
            )
        if self.quantize_grads not in QUANTIZE_GRADS:
            raise ZeroFXError(
                f"option quantize_grads={self.quantize_grads!r}: choose None, 'int8' or 'int4'"
                + closest(str(self.quantize_grads), QUANTIZE_GRADS[1:])
            )
        if self.quantize_grads == "int4" and block % 2:
            raise ZeroFXError(
                f"option quantize_block={block} with quantize_grads='int4': int4 packs two values per byte, "
                "so a block must hold an even number of values (e.g. quantize_block=256)"
            )


@dataclass(frozen=True)
class MemoryPolicy:
    """Activation budget, checkpointing and offload tiers (see ``Options``)."""

    activation_budget: float | int | None = None
    checkpoint: str = "auto"
    checkpoint_modules: tuple[str, ...] = ()
    checkpoint_save_ops: tuple[str, ...] = ()
    offload_activations: str = "none"
    offload_optimizer: str = "none"
    offload_dir: str | None = None
    host_memory_cap: int | None = None

    def __post_init__(self) -> None:
        budget = self.activation_budget
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, float)):
                raise ZeroFXError(
                    f"option activation_budget must be a fraction (float in (0, 1]) or bytes (int), got {budget!r}"
                )
            if isinstance(budget, float) and not 0.0 < budget <= 1.0:
                raise ZeroFXError(
                    f"option activation_budget={budget}: a float budget is a fraction of the "
                    "unconstrained activation memory and must be in (0, 1]; give bytes as an int"
                )
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
                raise ZeroFXError(
                    f"option checkpoint_save_ops: no op named {op!r} (write 'aten.mm', 'mm' or 'aten.mm.default')"
                ) from None
        if self.offload_activations not in ACTIVATION_TIERS:
            raise ZeroFXError(
                f"option offload_activations={self.offload_activations!r}: choose one of {list(ACTIVATION_TIERS)}"
            )
        if self.offload_optimizer not in OPTIMIZER_TIERS:
            raise ZeroFXError(
                f"option offload_optimizer={self.offload_optimizer!r}: choose one of {list(OPTIMIZER_TIERS)}"
            )
        cap = self.host_memory_cap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise ZeroFXError(f"option host_memory_cap must be a positive number of bytes, got {cap!r}")
        if self.offload_optimizer == "auto" and cap is None:
            raise ZeroFXError(
                "option offload_optimizer='auto' decides between host and disk by "
                "host_memory_cap: set host_memory_cap (bytes)"
            )
        if self.offload_dir is not None and not isinstance(self.offload_dir, (str, os.PathLike)):
            raise ZeroFXError(f"option offload_dir must be a path, got {type(self.offload_dir).__name__}")

    @property
    def uses_disk(self) -> bool:
        """Whether anything may be written under ``offload_dir``."""
        return "disk" in (self.offload_activations, self.offload_optimizer) or self.offload_optimizer == "auto"


@dataclass(frozen=True)
class DebugPolicy:
    """Dumps, passes to skip, invariant checks (see ``Options``)."""

    dump_dir: str | None = field(default_factory=lambda: os.environ.get("ZEROFX_DUMP") or None)
    disable_passes: tuple[str, ...] = ()
    verify: bool = True
    check_lockstep: bool = True

    def __post_init__(self) -> None:
        names = (self.disable_passes,) if isinstance(self.disable_passes, str) else tuple(self.disable_passes)
        if not all(isinstance(n, str) for n in names):
            raise ZeroFXError(f"option disable_passes must be pass names (strings), got {self.disable_passes!r}")
        object.__setattr__(self, "disable_passes", names)
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise ZeroFXError(f"option dump_dir must be a path, got {type(self.dump_dir).__name__}")
        if not isinstance(self.verify, bool):
            raise ZeroFXError(f"option verify={self.verify!r}: give True or False")
        if not isinstance(self.check_lockstep, bool):
            raise ZeroFXError(f"option check_lockstep={self.check_lockstep!r}: give True or False")


@dataclass(frozen=True)
class CodegenPolicy:
    """How graphs are captured and what runs them (see ``Options``)."""

    executor: str = "aten"
    autotune: bool = False
    dynamic: str | bool = "auto"

    def __post_init__(self) -> None:
        if not (isinstance(self.dynamic, bool) or self.dynamic == "auto"):  # 1 and 0 are not choices
            raise ZeroFXError(f"option dynamic={self.dynamic!r}: choose 'auto', True or False")
        if self.executor not in EXECUTORS:
            raise ZeroFXError(
                f"option executor={self.executor!r}: choose one of {list(EXECUTORS)}"
                + closest(str(self.executor), EXECUTORS)
            )
        if not isinstance(self.autotune, bool):
            raise ZeroFXError(f"option autotune={self.autotune!r}: give True or False")


_POLICIES = {
    "layout": LayoutPolicy,
    "comm": CommPolicy,
    "memory": MemoryPolicy,
    "debug": DebugPolicy,
    "codegen": CodegenPolicy,
}


def _flat_keywords(cls: type) -> type:
    """Give ``cls`` (before @dataclass) one field per policy field, with the policy's default."""
    annotations = {}
    for policy in _POLICIES.values():
        for f in dataclasses.fields(policy):
            annotations[f.name] = f.type
            default = (
                field(default_factory=f.default_factory) if f.default_factory is not dataclasses.MISSING else f.default
            )
            setattr(cls, f.name, default)
    cls.__annotations__ = {**annotations, **cls.__dict__.get("__annotations__", {})}
    return cls


@dataclass(frozen=True)
@_flat_keywords
class Options:
    """Options accepted by ``zerofx.compile(model, mesh, **options)`` and by the backend.

    Attributes:
        stage: the ZeRO stage (docs/zero_stages.md). 3 (default): parameters, gradients and
            optimizer state are 1/N per rank; parameters are all-gathered in forward and
            backward. 2: every rank keeps whole parameters (refreshed by one all-gather after
            each optimizer step); gradients and optimizer state are 1/N. 1: whole parameters and
            a whole gradient buffer, reduced once per accumulation boundary; optimizer state 1/N.
        persistence_threshold: stage 3 only: parameters with at most this many elements stay
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
            grow after ``loss_scale_window`` good steps), through torch's ``ShardedGradScaler`` (a subclass);
            get it with ``zerofx.loss_scaler(model)``. Required with fp16 (param or reduce dtype).
        initial_loss_scale: the first loss scale (2**16, as DeepSpeed and torch.amp).
        loss_scale_window: good steps before the scale doubles.
        loss_scale_hysteresis: overflows it takes to halve the scale (DeepSpeed's fp16
            ``hysteresis``): an overflow with more than one left skips the step and uses one up,
            keeping the scale; they are all back when the scale next grows. 1 (default): every
            overflow halves it, as torch's GradScaler. Above 1, or with ``min_loss_scale``, the
            scale follows DeepSpeed's DynamicLossScaler step for step, its first growth included
            (after ``loss_scale_window`` + 1 good steps, then every ``loss_scale_window``;
            zerofx/runtime/loss_scaling.py, NOTE: DeepSpeed's scale schedule).
        loss_scale_consecutive_hysteresis: refill the hysteresis after every good step, not only
            when the scale grows, so that only that many overflows in a row halve the scale
            (DeepSpeed's fp16 ``consecutive_hysteresis``). Default False.
        min_loss_scale: the scale's floor (DeepSpeed's fp16 ``min_loss_scale``): halving stops
            there, and an overflow with the scale at the floor raises (as DeepSpeed ends the run).
            None (default): no floor.
        local_optimizer_step: let elementwise ``torch.optim`` optimizers (SGD, Adam, AdamW, ...)
            built over the model step each rank's local shards directly instead of going through
            DTensor's dispatch op by op, from their second step on (zerofx/runtime/local_step.py). Same
            arithmetic, same state dict; False keeps every step on the DTensor path.
        plain_graph_inputs: hand the compiled graphs each parameter's local shard as a plain
            tensor (gradients moved into the DTensor parameters' ``.grad`` by a hook) instead of
            the DTensor parameters, which cost per-parameter guards, unwrapping and gradient
            re-wrapping on every call (zerofx/runtime/params.py, NOTE: plain graph inputs). Same
            numbers; the parameters themselves are then not in the autograd graph, so
            ``torch.autograd.grad`` with respect to them needs False. Tensor-parallel parameters
            always go in as DTensors. With it, ``zerofx.compile`` also drops dynamo's guards on
            what sharding fixed (zerofx/api.py ``_guard_filter``); False keeps every guard.
        secondary_shard: ZeRO++'s hpZ, on a 2-D mesh ``(replicate, shard)`` read as (nodes,
            ranks per node): parameters are sharded over every rank (ZeRO-3 over the flattened
            mesh), each rank keeps its inner-dimension rows of every gathered parameter from
            forward to backward (1/size(shard) of it, in the compute dtype), and the backward
            re-gathers them inside the inner dimension: no backward all-gather crosses the outer
            one (zerofx/sharding.py NOTE: hpZ, passes/secondary.py). A 1-D mesh is an error at
            ``zerofx.compile`` / ``zerofx.shard``; stage 1 or 2, an error here. With tensor
            parallelism, the two data-parallel dimensions of a ``(replicate, shard, tp)`` mesh.
        tp_dim: the name of the tensor-parallel dimension of ``mesh`` when the model was
            parallelized on it (``parallelize_module(model, mesh[tp_dim], plan)``): zerofx then
            shards over the mesh's other dimension, or with a 3-D mesh the other two (hybrid
            sharding: ``(replicate, shard, tp)``). Not needed when ``mesh`` is the data-parallel
            submesh itself (``zerofx.compile(model, mesh["dp"])`` or ``mesh["replicate",
            "shard"]``): the TP mesh is read from the parameters (zerofx/sharding.py NOTE: ZeRO
            with tensor parallelism).
        shard_placement_fn: the dim each parameter is split along over the data-parallel
            ranks, as FSDP2's: a function of the (unsharded) parameter returning
            ``Shard(dim)``, or None for zerofx's choice. zerofx's choice: dim 0, unless the
            parameter has fewer rows than ranks (a mixture of experts' stacked [experts, ffn,
            d] weights over more ranks than experts), then the dim whose split pads least, so
            that no rank holds a whole row while others hold nothing (zerofx/ir/layout.py,
            NOTE: the sharded dim). ``lambda p: Shard(0)`` shards every parameter by rows. With
            tensor parallelism, dim 0 only.
        dump_dir: write every graph before and after every pass, a per-pass summary and a diff
            under this folder. Defaults to the ``ZEROFX_DUMP`` environment variable.
        disable_passes: names of pipeline passes to skip (see ``zerofx.passes.PASS_NAMES``).
            Every pass is an optimization over a correct baseline: the marker ops the passes
            lower have eager implementations, so disabling any pass keeps results correct. One
            exception, on gloo only: without ``transport`` the graphs keep torch's out-of-place
            all-gather, which corrupts the heap with two in flight (a torch bug; zerofx warns).
        verify: lint the graph and check zerofx's invariants after every pass.
        check_lockstep: before each compiled graph that communicates (or whose backward may),
            the ranks compare a 56-bit digest of its collectives' kinds and mesh dimensions and
            of the parameters it was given (one small blocking all-reduce per graph run, four on
            a 2-D mesh; on an uncompiled model, one per parameter read that communicates); ranks
            about to run different graphs (data-dependent control flow, such as experts skipped
            on some ranks) raise a ``ZeroFXError`` naming what each would run, instead of
            aborting in gloo, waiting in NCCL, or pairing one parameter's rows with another's
            (zerofx/runtime/lockstep.py). False (at ``zerofx.shard`` or the backend): skip it.
        executor: what runs the final graphs. ``"aten"`` (default) runs them op by op.
            ``"triton"`` replaces fusible regions (pointwise chains, last-dim reductions such
            as softmax / LayerNorm / RMSNorm, with their neighbours) by generated Triton
            kernels and runs the rest as ATen; it needs a CUDA GPU, or ``TRITON_INTERPRET=1``
            on CPU (slow: for tests), and otherwise falls back to ATen with a warning.
            ``"inductor"`` hands the final graph to Inductor, for comparison.
            See docs/codegen.md.
        autotune: with ``executor="triton"`` on a GPU, let Triton time a few block sizes per
            kernel instead of using the heuristic's choice. Ignored by the interpreter.
        dynamic: input shapes that change between steps (a sequence length, a last short batch).
            ``"auto"`` (default): the first step compiles for its exact shapes; when a later
            step's shapes differ, the model is compiled once more with the sizes that changed as
            symbols (torch's automatic dynamic shapes), and every later size reuses that graph:
            two compiles in all. ``True``: every input size is a symbol from the first compile
            (one compile; ranks that see different shapes still compile at the same step,
            which ``activation_budget``'s plan agreement needs). ``False``: one compile per
            distinct shape (the fastest graphs, each specialized; torch's recompile limit of 8
            applies). Parameter shapes are always static. ``torch._dynamo.mark_dynamic(x, dim)``
            on an input marks one size symbolic from the first compile under ``"auto"``.
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
        quantize_weights: ``"int8"``: ZeRO++'s qwZ: stage 3's parameter all-gathers (forward and
            backward) move int8 values with one fp32 scale per ``quantize_block`` values instead
            of the compute dtype (a quarter of fp32's bytes, half of bf16's, plus the scales),
            dequantized to the compute dtype after the wait (passes/quantize.py). Gradients go
            to the full-precision shards as without it (the gathered values are what change).
            Stage 3 only. ``"fp8"``: the same bytes as int8, as float8 e4m3 values (relative
            error at most 2^-4 instead of int8's absolute absmax/254; ATen only, the CPU
            included). None: off.
        quantize_grads: ``"int8"`` or ``"int4"`` (two values per byte): ZeRO++'s qgZ: gradient
            reductions become quantize -> all-to-all -> dequantize -> a local sum in fp32 (so
            nothing is reduced in low precision); an all-reduce (the outer hop of a 2-D mesh, whole
            parameters) then requantizes the sum for an all-gather. No error feedback. None: off.
        quantize_block: values per quantization block (one fp32 scale each), 256 by default;
            even with ``quantize_grads="int4"``.

        activation_budget: most bytes of activations the forward may keep resident for the
            backward, per compiled graph: a float in (0, 1] is a fraction of the unconstrained
            amount (what the forward saves when nothing that costs FLOPs is recomputed), an int
            is bytes. The checkpoint pass then recomputes (or offloads) the cheapest values
            until the plan fits; a budget below what any plan can meet is an error that names
            the minimum. None (and no checkpoint option below): the forward keeps what costs
            FLOPs to rebuild and the backward recomputes what is cheap: activations, norms and
            other elementwise values (NOTE: cheap recompute, passes/checkpoint.py; bit for bit
            the same gradients). ``disable_passes=("checkpoint",)`` leaves the cut to torch's
            min-cut partitioner instead, as without zerofx.
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
        offload_dir: folder for disk offload files; checked (created, written) by
            ``zerofx.compile`` (or the backend) before anything is traced, so a bad path fails
            there, not mid-step. Defaults to a ``zerofx-offload`` folder in the system temp folder.
        host_memory_cap: bytes of host memory model state may use; sizes the optimizer's
            streaming window (an eighth of the cap) and decides ``offload_optimizer="auto"``.

    The options in ``LAYOUT_OPTIONS`` shape the parameters, so they take effect where the model
    is sharded (``zerofx.compile`` or ``zerofx.shard``); the backend rejects them.

    Inside zerofx the options are read by concern, as five small frozen policies built (and
    validated) from these fields: ``options.layout`` (LayoutPolicy), ``options.comm``
    (CommPolicy), ``options.memory`` (MemoryPolicy), ``options.debug`` (DebugPolicy) and
    ``options.codegen`` (CodegenPolicy). Validation is pure: it reads no file and imports no
    other part of zerofx.
    """

    # The flat keywords are the policies' fields, in policy order (added by _flat_keywords, so
    # each field and its default is written once, on its policy). The policies themselves are
    # built from them and are not init fields: equality, repr and dataclasses.replace see the
    # flat keywords only.
    layout: LayoutPolicy = field(init=False, repr=False, compare=False)
    comm: CommPolicy = field(init=False, repr=False, compare=False)
    memory: MemoryPolicy = field(init=False, repr=False, compare=False)
    debug: DebugPolicy = field(init=False, repr=False, compare=False)
    codegen: CodegenPolicy = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for attr, cls in _POLICIES.items():
            policy = cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})
            object.__setattr__(self, attr, policy)
            for f in dataclasses.fields(cls):  # the policy's normalized values (dtypes, tuples)
                object.__setattr__(self, f.name, getattr(policy, f.name))
        if self.comm.quantize_weights is not None and self.layout.stage != 3:
            raise ZeroFXError(
                f"option quantize_weights={self.comm.quantize_weights!r} quantizes the parameter all-gathers of "
                f"stage 3; stage {self.layout.stage} keeps whole parameters and gathers none in its graphs "
                "(use stage=3, or drop quantize_weights)"
            )
        if self.comm.keep_gathered_bytes and self.layout.stage != 3:
            raise ZeroFXError(
                f"option keep_gathered_bytes={self.comm.keep_gathered_bytes} keeps stage 3's gathered parameters "
                f"from forward to backward; stage {self.layout.stage} gathers none in its graphs (its forward "
                "reads whole copies): use stage=3, or drop keep_gathered_bytes"
            )
        if self.comm.quantize_grads is not None and self.layout.stage == 1:
            raise ZeroFXError(
                f"option quantize_grads={self.comm.quantize_grads!r} quantizes the gradient reduce-scatters inside "
                "the backward graphs of stages 2 and 3; stage 1 reduces once, after the backward, unquantized "
                "(use stage=2 or 3, or drop quantize_grads)"
            )

    def non_default_layout(self) -> list[str]:
        """The layout options (``LAYOUT_OPTIONS``) set to something other than their default."""
        default = LayoutPolicy()
        return [n for n in LAYOUT_OPTIONS if getattr(self.layout, n) != getattr(default, n)]

    @classmethod
    def keywords(cls) -> tuple[str, ...]:
        """The option names ``zerofx.compile`` accepts."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @classmethod
    def from_kwargs(cls, options: Options | dict[str, Any] | None = None, **kwargs: Any) -> Options:
        """Build options from an Options, a dict and/or keyword arguments; an unknown name raises
        one error naming it and the closest valid name."""
        names = cls.keywords()
        merged: dict[str, Any] = {}
        if isinstance(options, Options):
            merged.update({n: getattr(options, n) for n in names})
        elif options:
            merged.update(options)
        merged.update(kwargs)
        unknown = sorted(set(merged) - set(names))
        if "backend" in unknown:
            raise ZeroFXError(
                f"backend={merged['backend']!r}: zerofx.compile compiles with the zerofx backend, which places "
                "the collectives; it takes no other"
            )
        if "mode" in unknown:
            raise ZeroFXError(
                f"mode={merged['mode']!r}: torch.compile's mode picks one of Inductor's presets (autotuning, CUDA "
                "graphs), which zerofx does not run; leave it out (on a GPU, executor='triton' with autotune=True "
                "times Triton's block sizes)"
            )
        compile_keywords = [n for n in unknown if n in _TORCH_COMPILE_KEYWORDS]
        if compile_keywords:
            given = ", ".join(f"{n}={merged[n]!r}" for n in compile_keywords)
            one = len(compile_keywords) == 1
            raise ZeroFXError(
                f"{given}: {'a torch.compile keyword, not a zerofx option' if one else 'torch.compile keywords, not zerofx options'}"
                f"; shard first and compile yourself: zerofx.shard(model, mesh, ...), then "
                f"torch.compile(model, backend='zerofx', {given})"
            )
        if unknown:
            hint = closest(unknown[0], names)
            raise ZeroFXError(
                f"unknown zerofx option {unknown[0]!r}{hint}"
                + (f" (and {unknown[1:]})" if len(unknown) > 1 else "")
                + f"; valid options are {sorted(names)}"
            )
        return cls(**merged)
