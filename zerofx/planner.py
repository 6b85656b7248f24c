"""``zerofx.plan``: memory, communication and step time of a training step at any scale, before launch.

    plan = zerofx.plan("llama3-70b", (128, 8), batch=1, seq=8192, param_dtype="bf16",
                       device="h100", device_memory="80GiB")
    print(plan.report()); plan.to_json()

How it works: nothing is approximated by a second model of zerofx. The planner builds the model
under a ``FakeTensorMode`` (no memory for weights or activations), joins a fake process group of
``world_size`` ranks as one of them (torch's ``fake`` backend: collectives complete without
moving data, so 1024 ranks plan in one process), shards and compiles it with ``zerofx.compile``
and the given options, and runs one training step (forward, backward, optimizer step) on fake
tensors. Every pass runs as in a real job, and the numbers come from what the real runs are
measured with: ``model_state_bytes`` of the fake model and optimizer, the ``CollectiveCounter``
of the fake step (graph and eager collectives, per process group, so per mesh dimension), and the
cost model over the final graphs (``estimate_memory`` / ``predict_step_peak`` for the peak,
``estimate_time`` for compute and the communication the schedule leaves exposed).

With ``device_memory``, batch and sequence are traced symbolically (``torch._dynamo.mark_dynamic``)
so every live-bytes figure of the step is a polynomial in them (sympy; an MoE's capacity adds Max
and floor), and the largest batch and sequence that fit are the roots of those polynomials, solved
(NOTE: solving for the largest batch), the batch with the graphs compiled at it (NOTE: the largest
batch is solved at its own batch).

The step priced is the usual loop, ``out = model(batch); loss_of(out).backward(); opt.step()``:
the model's outputs (an HF model's logits) stay alive through the backward, and the backward
that runs first also holds the gradients the autograd engine hands it (the loss's, and zeros for
every output the loss does not use). A loop that drops the outputs before the backward peaks
lower by their bytes.

Rank 0 is planned: ``torch.chunk`` shards give the first ranks the largest shards, so rank 0's
numbers bound every rank's; the optimizer step's transient is the exception (a whole-tensor
step's owners hold different tensors), planned as every rank that may hold the most (NOTE: the
optimizer step's transient memory). Graphs are traced on the CPU (fake CPU tensors) and priced with the
target ``device``'s rates; kernels that exist only on GPUs (flash attention) save what the CPU
kernels save, so activation bytes agree up to the kernels' own workspace.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import json
import math
import numbers
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import sympy
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.utils._python_dispatch import TorchDispatchMode

from zerofx.errors import ZeroFXError, first_line
from zerofx.passes.cost_model import hint

__all__ = ["plan", "Plan", "PerRank", "BUILTIN_MODELS", "load_factory", "write_timeline_plot", "dump_json"]


# ------------------------------------------------------------------------------ the models --


def _llama(**shape: Any) -> Callable[..., nn.Module]:
    def build(**overrides: Any) -> nn.Module:
        from zerofx.models import Llama, LlamaConfig

        return Llama(LlamaConfig(**{**shape, **overrides}))

    build.depth = shape["n_layer"]  # type: ignore[attr-defined]
    return build


def _gpt(**shape: Any) -> Callable[..., nn.Module]:
    def build(**overrides: Any) -> nn.Module:
        from zerofx.models import GPT, GPTConfig

        return GPT(GPTConfig(**{**shape, **overrides}))

    build.depth = shape["n_layer"]  # type: ignore[attr-defined]
    return build


# Published shapes, built from zerofx.models (no transformers needed). GPT-2 XL's attention has no
# qkv bias here (0.23M of its 1.56B parameters); the Mixtral-like MoE routes by expert choice.
BUILTIN_MODELS: dict[str, Callable[..., nn.Module]] = {  # keyword arguments override the shape
    "llama3-8b": _llama(vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8, d_model=4096, ffn_hidden=14336),
    "llama3-70b": _llama(vocab_size=128256, n_layer=80, n_head=64, n_kv_head=8, d_model=8192, ffn_hidden=28672),
    "llama3-405b": _llama(vocab_size=128256, n_layer=126, n_head=128, n_kv_head=8, d_model=16384, ffn_hidden=53248),
    "gpt2-xl": _gpt(vocab_size=50257, seq_len=1024, n_layer=48, n_head=25, d_model=1600),
    "mixtral-8x7b": _llama(
        vocab_size=32000,
        n_layer=32,
        n_head=32,
        n_kv_head=8,
        d_model=4096,
        ffn_hidden=14336,
        rope_theta=1e6,
        n_experts=8,
        experts_per_token=2,
    ),
}


def load_factory(spec: str | Callable[..., nn.Module], kwargs: dict | None = None) -> Callable[[], nn.Module]:
    """A model factory from a built-in name, a ``module:function`` path or a callable."""
    kwargs = dict(kwargs or {})
    if callable(spec):
        return lambda: spec(**kwargs)
    if spec in BUILTIN_MODELS:
        build = BUILTIN_MODELS[spec]
        return lambda: build(**kwargs)
    if ":" not in spec:
        raise ZeroFXError(
            f"unknown model {spec!r}: give a built-in name ({', '.join(BUILTIN_MODELS)}) or a factory "
            "as module:function (e.g. mypkg.models:build_llama)"
        )
    fn = import_callable(spec, "model factory")
    return lambda: fn(**kwargs)


def import_callable(spec: str, what: str) -> Callable[..., Any]:
    """The function a ``module:function`` path names (``what`` names it in the errors)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ZeroFXError(f"{what} {spec!r}: give it as module:function (e.g. mypkg.models:build_llama)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ZeroFXError(
            f"{what} {spec!r}: cannot import module {module_name!r} ({e}); check the path and that "
            "its package is installed or on PYTHONPATH"
        ) from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ZeroFXError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ZeroFXError(f"{what} {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def _count(n: int) -> str:
    """A parameter count as people write it: 120K, 7.2M, 1.5B."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if float(f"{n / scale:.3g}") >= 1:  # as rounded: 999,600 is 1M, not 1e+03K
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _parse_memory(value: int | str | None) -> int | None:
    from zerofx.cli import parse_size

    if value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ZeroFXError(f"device_memory={value!r}: give bytes as an int or a size such as '80GiB'")
    if isinstance(value, int):
        if value < 1:
            raise ZeroFXError(f"device_memory={value}: give a positive number of bytes")
        return value
    try:
        return parse_size(value)
    except ValueError as e:
        raise ZeroFXError(f"device_memory: {e}") from None


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.2f} MiB"


# ------------------------------------------------------------------------------- the result --


@dataclass
class PerRank:
    """Bytes one rank holds (rank 0: the largest shards)."""

    params_bytes: int  # parameter shards in their master dtype (and replicated small parameters)
    whole_copy_bytes: int  # stages 1-2: whole parameters in the compute dtype
    grad_bytes: int  # gradients at the end of the backward (shards; whole ones pending reduction)
    optimizer_bytes: int  # per-element optimizer state (Adam: two moments, master dtype)
    buffer_bytes: int
    activation_bytes: int  # saved for the backward, resident (not offloaded)
    step_peak_bytes: int  # forward + backward above the step's start (the allocator's count)
    peak_bytes: int  # device bytes: model state at rest (not offloaded) + buffers + the larger of the
    # forward/backward's peak and the optimizer step's (gradients and its transient)
    peak_node: str  # where the forward/backward's peak is
    offloaded_bytes: int = 0  # what offload_optimizer moves off the device (NOTE: what offload moves)
    optimizer_step_bytes: int = 0  # the optimizer step's transient (NOTE: the optimizer step's transient memory)
    optimizer_step_grad_bytes: int = 0  # the gradients it steps with (stage 1: shards, after the boundary reduce)
    # whole gradients held from the first micro-batch to the last (grad_accumulation > 1), in the
    # step's peak (NOTE: planning gradient accumulation)
    accumulated_grad_bytes: int = 0

    @property
    def at_rest_bytes(self) -> int:
        """What the device holds between steps: model state less gradients and offloaded, buffers."""
        return (
            self.params_bytes + self.whole_copy_bytes + self.optimizer_bytes + self.buffer_bytes - self.offloaded_bytes
        )

    @property
    def optimizer_step_peak_bytes(self) -> int:
        """The device's bytes at the optimizer step's highest point: at rest, gradients, transient."""
        return self.at_rest_bytes + self.optimizer_step_grad_bytes + self.optimizer_step_bytes

    def device_peak(self) -> int:
        """``peak_bytes`` from the other fields: the forward/backward's peak or the optimizer step's."""
        return max(self.at_rest_bytes + self.step_peak_bytes, self.optimizer_step_peak_bytes)

    @property
    def model_state_bytes(self) -> int:
        """Parameters, gradients and optimizer state (ZeRO's "model states"), by storage."""
        return self.params_bytes + self.whole_copy_bytes + self.grad_bytes + self.optimizer_bytes


# NOTE: optimizer steps that read values
# The plan runs one optimizer step on fake tensors for the state it leaves (its shapes, dtypes
# and where it lives). Some steps read values: both Adafactors scale their update by root mean
# squares (``.item()``) and clamp with comparisons, which fake tensors cannot answer. What such
# a step allocates depends on shapes only, so the plan's step runs with every value read that
# fake tensors cannot answer answered by a placeholder (1, 1.0, False): the state is that of a
# real step, its values meaningless, as every value in a plan is. A truth test can choose what
# the step allocates (a step skipped when a gradient is not finite leaves no state), so a step
# that tested one runs again with the other answer (outside the collective count) and the two
# must leave the same state layout; where they do not, the plan is a clear error, not one
# branch's guess. transformers' Adafactor tests tensors (``max`` of a float and its RMS) and
# leaves the same state either way.


# kernels whose floating operands must share one dtype on a real device: fake tensors compute
# their outputs' metadata without checking, so the plan would pass a step the first forward fails
_SAME_DTYPE_KERNELS = {
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.baddbmm.default",
    "aten.convolution.default",
}


def _refuse_mixed_dtype_kernels(graphs: dict | None) -> None:
    """A matmul or convolution of two floating dtypes in the planned graphs is the error the real
    step raises at its first forward ("mat1 and mat2 must have the same dtype"), said before launch."""
    for (graph_id, kind), gm in sorted((graphs or {}).items(), key=lambda item: (item[0][0], item[0][1] == "backward")):
        for node in gm.graph.nodes:
            if node.op != "call_function" or str(node.target) not in _SAME_DTYPE_KERNELS:
                continue
            vals = [a.meta.get("val") for a in node.args if isinstance(a, torch.fx.Node)]
            dtypes = {v.dtype for v in vals if isinstance(v, torch.Tensor) and v.dtype.is_floating_point}
            if len(dtypes) > 1:
                names = " and ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
                raise ZeroFXError(
                    f"the {kind} graph of {graph_id} runs {node.target} on {names} operands ({node.name}), which "
                    "the real step refuses at its first forward: a tensor the model keeps in another dtype than "
                    "param_dtype (a float32 buffer added to bf16 activations) reaches a matmul; cast it in the "
                    "model or keep that module in full precision"
                )


class _PlaceholderScalars(TorchDispatchMode):
    """Answers each value read of a tensor that fake tensors cannot answer
    (``aten._local_scalar_dense``: ``.item()``, ``bool()``) with a placeholder of its kind: 1,
    1.0, and ``test`` for a truth value (NOTE: optimizer steps that read values). ``tested``:
    whether it answered a truth value."""

    def __init__(self, test: bool) -> None:
        super().__init__()
        self.test = test
        self.tested = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        try:
            return func(*args, **(kwargs or {}))
        except DataDependentOutputException:  # (a fake tensor that is a known constant still answers)
            if func is not torch.ops.aten._local_scalar_dense.default:
                raise
            dtype = args[0].dtype
            if dtype == torch.bool:
                self.tested = True
                return self.test
            return 1.0 if dtype.is_floating_point or dtype.is_complex else 1


def _state_layout(opt: torch.optim.Optimizer) -> list:
    """What the optimizer's state holds, value by value, without the values: per parameter (in
    the groups' order), each entry's key and kind, and a tensor's shape, dtype and placements."""

    def kind(v: Any) -> tuple:
        if not isinstance(v, torch.Tensor):
            return (type(v).__name__,)
        return (type(v).__name__, tuple(v.shape), v.dtype, tuple(getattr(v, "placements", ())))

    params = [p for g in opt.param_groups for p in g["params"]]
    return [sorted((k, kind(v)) for k, v in opt.state.get(p, {}).items()) for p in params]


def _step_planned(opt: torch.optim.Optimizer) -> bool:
    """Run ``opt``'s step on fake tensors (NOTE: optimizer steps that read values); whether it
    tested a tensor's truth (then ``_same_state_either_way`` must hold)."""
    answers = _PlaceholderScalars(test=False)
    with answers:
        opt.step()
    return answers.tested


# NOTE: the optimizer step's transient memory
# A step holds more than the state it starts from and keeps: AdamW's foreach kernels make a
# temporary per state tensor (the default on GPUs, and what the plan's named optimizers use for
# a GPU target), a whole-tensor step (Adafactor, Muon) holds each parameter it owns whole with
# its gradient, the exchanges' buffers and its own temporaries on them: for an embedding, some
# times its fp32 size on one rank. The plan measures it: after the planned step, one more step
# (a step after the first runs as every later one: on local shards, with state to update; no
# collective counted) under ``TransientBytes`` (zerofx/measure/transient.py), and within
# ``whole_step.as_a_rank`` so that this rank owns and exchanges what a rank of a real run does:
# rank 0 (the largest tensor of every window), and every rank that owns more of some window
# than any other (``whole_step.heaviest_ranks``: rank 1 of 2 owns more of a window of 10, 6 and
# 5 MiB tensors, the last two), one step each; the most any of them holds is the plan's
# transient (over tensor parallelism, as TP rank 0). The device's peak is then the larger of
# the forward/backward's and the step's (at rest + gradients + this). An offloaded step runs on the host: its device
# transient (one window of copies) is not counted. Planned by depth, it is extended like every
# other number: exact for elementwise optimizers (foreach: one more state tensor per block) and
# where every window holds one tensor (the largest: the same at any depth); over windows of many
# small tensors the owners' balance moves by a tensor as blocks are added (Adafactor on a small
# Llama, 5 and 8 blocks: 3.5% and 4.3% above the full trace's).


def _step_transient(opt: torch.optim.Optimizer, states: list) -> int:
    """The most bytes a steady-state step of ``opt`` holds above its start and what it keeps, on
    the rank that holds the most (NOTE: the optimizer step's transient memory); steps on fake
    tensors, uncounted, one per candidate rank (``states``: the model's ParamStates)."""
    from zerofx.measure.transient import TransientBytes
    from zerofx.runtime.whole_step import as_a_rank, heaviest_ranks

    peak = 0
    for rank in heaviest_ranks(opt):
        with _PlaceholderScalars(test=False), as_a_rank(rank, states), TransientBytes() as held:
            opt.step()
        peak = max(peak, held.peak)
    return peak


def _same_state_either_way(opt: torch.optim.Optimizer) -> None:
    """Run the step again from empty state with the other answer to every truth test (outside
    any collective count): the state it leaves must not differ from the planned step's, or the
    plan would be one branch's."""
    planned, opt.state = opt.state, collections.defaultdict(dict)  # as torch.optim.Optimizer's
    try:
        with _PlaceholderScalars(test=True):
            opt.step()
        other = _state_layout(opt)
    finally:
        opt.state = planned
    if other != _state_layout(opt):
        raise ZeroFXError(
            f"{type(opt).__name__}'s step tests tensor values (a condition on a tensor) and leaves other state "
            "by their outcome, which planning on fake tensors cannot know: plan with an optimizer whose state "
            "does not depend on values, such as optimizer='adamw'"
        )


SPLIT_EXAMPLES = 3  # parameters split along another dim that a plan names


@dataclass
class Plan:
    """What one training step costs per rank, predicted (``zerofx.plan``)."""

    model: str
    parameters: int
    world_size: int
    mesh: dict[str, int]  # dimension name -> size, outer first
    batch: int
    seq: int | None
    device: str
    options: dict[str, Any]
    per_rank: PerRank
    comm_bytes_per_step: dict[str, dict[str, int]]  # kind -> mesh dimension -> wire bytes per rank
    step_time_s: float
    compute_s: float
    exposed_comm_s: float
    optimizer_step_s: float
    device_memory: int | None = None
    max_batch: int | None = None
    max_seq: int | None = None
    plan_seconds: float = 0.0
    timeline: list[tuple[str, int]] = field(default_factory=list, repr=False)
    symbolic_peak: str | None = None
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    traced_depths: tuple[int, int] | None = None  # planned from traces of this many blocks (NOTE: planning by depth)
    seq_limit: int | None = None  # the model's positions
    # what bounds max_batch / max_seq: (binding node, polynomial coefficients or, where the live
    # bytes are no polynomial (an MoE's capacity), the expression in x, static bytes)
    bindings: dict[str, tuple] = field(default_factory=dict, repr=False)
    # parameters split along another dim than 0 (zerofx/ir/layout.py, NOTE: the sharded dim):
    # how many, and the first few as "name [shape]: Shard(k)"
    split_count: int = 0
    split_examples: list[str] = field(default_factory=list)
    grad_accumulation: int = 1  # micro-batches (of ``batch``) per optimizer step, all but the last under no_sync

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.per_rank.peak_bytes <= self.device_memory

    def advice(self) -> str | None:
        """For a plan that does not fit: by how much, and what each memory option frees."""
        if self.fits is not False:
            return None
        r, over = self.per_rank, self.per_rank.peak_bytes - self.device_memory
        graph_peak = r.at_rest_bytes + r.step_peak_bytes
        # (bytes off the forward/backward's peak, bytes off the optimizer step's, the option)
        frees = []
        if self.options.get("offload_optimizer") in (None, "none") and r.optimizer_bytes:
            # NOTE: what offload moves. Its step brings a window back (up to the window's bytes) and
            # its own transient is not known here: counted as in memory (--compare plans it)
            cap = self.options.get("host_memory_cap")
            window = cap // 8 if cap else 64 * 2**20
            if self.device == "cpu":  # host memory is the device's: only files move anything
                moved, what = r.optimizer_bytes + r.params_bytes, "offload_optimizer='disk'"
            else:
                moved, what = r.optimizer_bytes, "offload_optimizer='host'"
            frees.append((moved, max(0, moved - window), what))
        if self.options.get("stage", 3) != 3 and r.whole_copy_bytes:
            frees.append((r.whole_copy_bytes, r.whole_copy_bytes, "stage=3"))
        if (
            self.options.get("activation_budget") is None
            and self.options.get("checkpoint") != "full"
            and not self.options.get("checkpoint_modules")
            and r.activation_bytes
        ):
            frees.append((r.activation_bytes, 0, "checkpoint='full' (at most)"))
        listed = ", ".join(f"{what} {_gib(a)}" for a, _, what in sorted(frees, reverse=True)) or "nothing"
        # NOTE: what the advice offers for activations. Checkpointing's saving is an upper bound:
        # the blocks' boundaries stay saved and recomputing one block adds its activations back to
        # the backward's peak, so it is never said to fit alone without a plan of it. It offers
        # checkpoint='full' (each block recomputed whole, just before its own backward: one
        # block's activations at a time), not activation_budget=0: a budget counts saved bytes
        # only, and at 0 the recomputation runs across blocks, all of them rebuilt (and at stage 3
        # every block's parameters gathered) before the first gradient, which raised the peak
        # (13.0 MiB against 8.1 without a budget, 5.5 with checkpoint='full', on a 4-layer GPT)
        at_best = [
            what for a, b, what in frees if max(graph_peak - a, r.optimizer_step_peak_bytes - b) <= self.device_memory
        ]
        enough = [what for what in at_best if not what.startswith("checkpoint=")]
        if enough:
            verdict = f"{' or '.join(enough)} alone would fit"
        elif at_best:
            verdict = (
                "only checkpoint='full' might fit alone: it frees at most that much, and recomputing a block adds "
                "its activations back to the backward's peak (plan it with --compare)"
            )
        else:
            verdict = "no single option is enough: combine them"
        if r.optimizer_step_peak_bytes > self.device_memory:
            verdict += (
                f"; the optimizer step alone peaks at {_gib(r.optimizer_step_peak_bytes)} "
                f"({_gib(r.optimizer_step_bytes)} of it transient), whatever the batch"
            )
        elif self.batch > 1:
            verdict += f", or a smaller batch (the largest that fits: {self.max_batch}){self._accumulation_advice()}"
        step = r.peak_bytes - r.model_state_bytes + r.grad_bytes  # what does not shrink with more ranks
        ranks = ""
        if step < self.device_memory:
            state = (r.model_state_bytes - r.grad_bytes) * self.mesh.get("shard", self.world_size)
            ranks = (
                f"; from {math.ceil(state / (self.device_memory - step))} ranks on the sharded state would fit beside "
                "this step's peak (which the world size changes too: plan it)"
            )
        return (
            f"does not fit: peak {_gib(r.peak_bytes)} per rank is {_gib(over)} over device_memory "
            f"{_gib(self.device_memory)}; options free: {listed}; {verdict}{ranks} (plan each exactly with --compare)"
        )

    def _accumulation_advice(self) -> str:
        """What gradient accumulation would take to keep the sequences per step at a batch that
        fits (NOTE: planning gradient accumulation): each rank then holds whole gradients too."""
        if self.grad_accumulation > 1 or not self.max_batch:
            return ""  # planned with it: its whole gradients are in the peak already
        whole = self._whole_grad_bytes()
        binding = self.bindings.get("batch")
        if binding is None or self.device_memory is None:
            return ""
        _, fn, static = binding
        micro = min(_largest_fit(fn, self.device_memory - static - whole), self.batch - 1)
        if micro < 1:
            return (
                f"; gradient accumulation would not help: under no_sync each rank also holds whole gradients "
                f"({_gib(whole)})"
            )
        n = next(n for n in range(-(-self.batch // micro), self.batch + 1) if self.batch % n == 0)
        return (
            f"; or batch {self.batch // n} x --grad-accumulation {n}, the same sequences per step: each rank "
            f"then also holds whole gradients ({_gib(whole)}), room for which this plan's bytes leave (plan it to confirm)"
        )

    def _whole_grad_bytes(self) -> int:
        """Bytes of every gradient whole on one rank (what no_sync accumulates), from the shards:
        the rank-0 shard times the shard ranks, an upper bound where shards are padded."""
        r = self.per_rank
        if r.accumulated_grad_bytes:
            return r.accumulated_grad_bytes
        shards = self.mesh.get("shard", self.world_size)
        if self.options.get("secondary_shard"):  # hpZ: sharded over the whole data-parallel mesh
            shards = self.world_size // self.mesh.get("tp", 1)
        return r.grad_bytes if self.options.get("stage", 3) == 1 else r.grad_bytes * shards

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["per_rank"]["model_state_bytes"] = self.per_rank.model_state_bytes
        out["per_rank"]["optimizer_step_peak_bytes"] = self.per_rank.optimizer_step_peak_bytes
        out["fits"] = self.fits
        out["advice"] = self.advice()
        out["options"] = {k: str(v) if isinstance(v, torch.dtype) else v for k, v in self.options.items()}
        out["bindings"] = {  # a binding that is no polynomial (an MoE's capacity) as its expression in x
            k: [node, fn if isinstance(fn, tuple) else str(fn), static]
            for k, (node, fn, static) in self.bindings.items()
        }
        return out

    def report(self) -> str:
        r = self.per_rank
        mesh = "x".join(str(v) for v in self.mesh.values())
        lines = [
            f"zerofx plan: {self.model} ({_count(self.parameters)} parameters), {self.world_size} ranks "
            f"(mesh {mesh}: {', '.join(self.mesh)}), batch {self.batch} x seq {self.seq}, device {self.device}, "
            f"options {self.options or 'defaults'}",
            "per rank (rank 0):",
            f"  parameters (shards)        {_gib(r.params_bytes):>12}",
            f"  whole copies (stages 1-2)  {_gib(r.whole_copy_bytes):>12}",
            f"  gradients                  {_gib(r.grad_bytes):>12}",
            f"  optimizer state            {_gib(r.optimizer_bytes):>12}",
            f"  model state                {_gib(r.model_state_bytes):>12}",
            f"  buffers                    {_gib(r.buffer_bytes):>12}",
            f"  saved activations          {_gib(r.activation_bytes):>12}",
            f"  step peak above its start  {_gib(r.step_peak_bytes):>12}  (at {r.peak_node})",
            f"  optimizer step transient   {_gib(r.optimizer_step_bytes):>12}  "
            f"(the step's peak: {_gib(r.optimizer_step_peak_bytes)})",
            f"  peak (on the device)       {_gib(r.peak_bytes):>12}",
            f"  offloaded (host or disk)   {_gib(r.offloaded_bytes):>12}",
        ]
        if self.grad_accumulation > 1:
            lines.insert(
                -3,
                f"  whole gradients (no_sync)  {_gib(r.accumulated_grad_bytes):>12}  "
                f"(held across {self.grad_accumulation} micro-batches of {self.batch}: in the step's peak)",
            )
        if self.split_count:
            lines.append(
                f"  split along another dim than 0 (fewer rows than ranks, or shard_placement_fn): {self.split_count} parameters, "
                f"e.g. {'; '.join(self.split_examples)}"
            )
        lines.append("communication per step per rank:")
        for kind, dims in sorted(self.comm_bytes_per_step.items()):
            lines.append(f"  {kind:<15} " + ", ".join(f"{d}: {_gib(b)}" for d, b in dims.items()))
        lines.append(
            f"step time {self.step_time_s * 1e3:.1f} ms: compute {self.compute_s * 1e3:.1f} ms, exposed "
            f"communication {self.exposed_comm_s * 1e3:.1f} ms, optimizer step {self.optimizer_step_s * 1e3:.1f} ms "
            f"(roofline on {self.device}'s rates: a lower bound)"
        )
        if self.device_memory is not None:
            fit = "fits" if self.fits else "DOES NOT FIT"
            if self.max_batch is None and self.max_seq is None:  # tensor parallelism: traced at the given sizes
                solved = "largest batch and seq not solved (tensor parallelism: plan the sizes you want to check)"
            else:
                solved = f"largest batch {self.max_batch} (at seq {self.seq}), largest seq {self.max_seq} (at batch {self.batch})"
            lines.append(f"device memory {_gib(self.device_memory)}: {fit}; {solved}")
            if not self.fits:
                lines.append(self.advice())
        for alt in self.alternatives:
            lines.append(
                f"  with {alt['change']}: peak {_gib(alt['peak_bytes'])}, model state {_gib(alt['model_state_bytes'])}, "
                f"step {alt['step_time_s'] * 1e3:.1f} ms, comm {_gib(alt['comm_bytes'])}"
            )
        traced = (
            f" from traces of {self.traced_depths[0]} and {self.traced_depths[1]} blocks" if self.traced_depths else ""
        )
        lines.append(f"planned in {self.plan_seconds:.1f} s{traced}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------ the planner --


def _link(name: str) -> Any:
    from zerofx.passes.cost_model import CommModel

    # round per-rank collective bandwidths: NVLink-class inside a node, 400 Gb/s NICs across nodes
    links = {"intra": CommModel(latency_s=10e-6, seconds_per_byte=1 / 350e9), "inter": CommModel(20e-6, 1 / 45e9)}
    return links[name]


@contextlib.contextmanager
def _fake_world(world_size: int, rank: int, backend: str):
    """This process as ``rank`` of a fake process group of ``world_size`` ranks (no communication)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers torch's "fake" backend)

    from zerofx.ir.collectives import simulated_backend

    if dist.is_initialized():
        raise ZeroFXError(
            "zerofx.plan simulates the job with a fake process group and cannot run where one is already "
            "initialized: call it before init_process_group, or run `zerofx plan` in its own process"
        )
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=dist.HashStore())
    try:
        with simulated_backend(backend):
            yield
    finally:
        dist.destroy_process_group()


def _default_inputs(model: nn.Module) -> Callable[[int, int], tuple]:
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is None:
        raise ZeroFXError(
            f"zerofx.plan: cannot make inputs for {type(model).__name__} (no cfg.vocab_size / config.vocab_size): "
            "pass example_inputs_fn(batch, seq) -> (args, kwargs) (zerofx plan: --inputs MODULE:FUNCTION)"
        )
    hf = (
        hasattr(model, "config")
        and hasattr(model, "generation_config")
        or type(model).__module__.startswith("transformers")
    )

    def inputs(batch: int, seq: int) -> tuple:
        tokens = torch.randint(0, vocab, (batch, seq))
        if hf:
            return (), {"input_ids": tokens, "labels": tokens}
        return (tokens, tokens), {}

    return inputs


def _max_positions(model: nn.Module) -> int | None:
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    if type(model).__name__ == "GPT":
        return getattr(cfg, "seq_len", None)
    return getattr(cfg, "max_position_embeddings", None)


def _make_optimizer(params: list, optimizer: str | Callable, foreach: bool = False) -> torch.optim.Optimizer:
    """The optimizer the plan steps: ``optimizer(params)``, or a named one with torch's default
    implementation on the target (``foreach``: on a GPU; the plan's fake tensors are on the CPU,
    where torch would pick the single-tensor loop, whose temporaries are one parameter's)."""
    if callable(optimizer):
        return optimizer(params)
    table = {
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-3, foreach=foreach),
        "adam": lambda: torch.optim.Adam(params, lr=1e-3, foreach=foreach),
        "sgd": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach),
        "adafactor": lambda: torch.optim.Adafactor(params, lr=1e-2, foreach=foreach),
    }
    if optimizer not in table:
        raise ZeroFXError(
            f"optimizer {optimizer!r}: give adamw, adam, sgd, adafactor or a callable(params) -> Optimizer"
        )
    return table[optimizer]()


def plan(
    model_fn: str | Callable[..., nn.Module],
    mesh_shape: tuple[int, ...] | int | None = None,
    example_inputs_fn: Callable[[int, int], tuple] | None = None,
    *,
    world_size: int | None = None,
    batch: int = 1,
    seq: int | None = None,
    global_batch: int | None = None,
    device: str = "h100",
    device_memory: int | str | None = None,  # bytes, or a size such as "80GiB"
    optimizer: str | Callable = "adamw",
    backend: str | None = None,
    gpus_per_node: int = 8,
    factory_kwargs: dict | None = None,
    compare: bool = False,
    depth_kwarg: str | None = None,
    exact: bool = False,
    grad_accumulation: int = 1,
    tensor_parallel: int = 1,
    tp_plan: Callable[[nn.Module], dict] | None = None,
    **options: Any,
) -> Plan:
    """Plan one training step of ``model_fn()`` sharded by zerofx over ``mesh_shape`` (module docstring).

    ``model_fn``: a callable, a ``module:function`` path or a built-in name (``BUILTIN_MODELS``);
    ``mesh_shape``: ``(world,)`` or ``(replicate, shard)``; ``example_inputs_fn(batch, seq)`` ->
    ``(args, kwargs)`` of one forward (default: token ids and targets for models with a
    ``vocab_size``); ``batch``: sequences per rank per micro-step (or ``global_batch``, divided by
    the data-parallel size and ``grad_accumulation``); ``device``: the rates the step is priced with (``cpu``, ``a100``,
    ``h100``, ``h200``); ``grad_accumulation``: micro-batches per optimizer step, all but the last
    under ``zerofx.no_sync`` (NOTE: planning gradient accumulation; ``global_batch`` counts them
    all); ``backend``: the collective backend simulated (default nccl, gloo on cpu);
    ``compare``: also plan each memory option that changes the answer; ``depth_kwarg``: the
    factory keyword that sets the number of identical blocks (built-ins: ``n_layer``): deeper
    models are planned from traces of 3 and 4 blocks (NOTE: planning by depth) unless ``exact``;
    ``tensor_parallel``: the size of a tensor-parallel dimension inside each node next to
    ``mesh_shape``'s data-parallel ones (``(dp,)``, or ``(replicate, shard)`` for hybrid
    sharding; the job has dp·tp ranks): the model is
    parallelized with ``tp_plan(model)`` (default ``zerofx.tensor_parallel.plan_for``) and zerofx
    shards over dp (zerofx/sharding.py, NOTE: ZeRO with tensor parallelism); its collectives are
    reported under "tp"; ``options``: those of
    ``zerofx.compile``. Runs in a process without a process group (it simulates one), and resets
    dynamo's caches (``torch._dynamo.reset()``) before each trace: plan before compiling anything
    you keep in the same process."""
    started = time.perf_counter()
    if isinstance(mesh_shape, int):
        mesh_shape = (mesh_shape,)
    if mesh_shape is None:
        if world_size is None:
            raise ZeroFXError("zerofx.plan: give mesh_shape or world_size")
        mesh_shape = (world_size,)
    mesh_shape = tuple(mesh_shape)
    if len(mesh_shape) not in (1, 2) or not all(_positive_int(n) for n in mesh_shape):
        raise ZeroFXError(f"mesh {mesh_shape}: give (world,) or (replicate, shard) of ints >= 1, e.g. --mesh 128x8")
    mesh_shape = tuple(int(n) for n in mesh_shape)
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ZeroFXError(f"tensor_parallel={tensor_parallel!r}: give the tensor-parallel size, an int >= 1")
    if tensor_parallel > 1:  # the data-parallel dims: (shard,) or (replicate, shard) for hybrid sharding
        if world_size is not None and mesh_shape == (world_size,) and world_size % tensor_parallel:
            raise ZeroFXError(
                f"world size {world_size} is not divisible by the tensor-parallel size {tensor_parallel}: give a "
                "world size that is a multiple of it"
            )
        if world_size is not None and world_size % tensor_parallel == 0 and mesh_shape == (world_size,):
            mesh_shape = (world_size // tensor_parallel,)  # --world-size counts every rank
        mesh_shape = (*mesh_shape, tensor_parallel)
    world = math.prod(mesh_shape)
    if world_size is not None and world_size != world:
        raise ZeroFXError(
            f"mesh {'x'.join(map(str, mesh_shape))} has {world} ranks but world size is {world_size}: make the "
            "mesh dimensions multiply to --world-size"
        )
    if isinstance(grad_accumulation, bool) or not isinstance(grad_accumulation, int) or grad_accumulation < 1:
        raise ZeroFXError(
            f"grad_accumulation={grad_accumulation!r}: give the micro-batches per optimizer step, an int >= 1"
        )
    for label, value in (("batch", batch), ("global_batch", global_batch)):
        if value is not None and not _positive_int(value):
            raise ZeroFXError(f"{label}={value!r}: give a number of sequences, an int >= 1")
    batch, global_batch = (None if v is None else int(v) for v in (batch, global_batch))
    if backend not in (None, "nccl", "gloo"):
        raise ZeroFXError(f"backend={backend!r}: give 'nccl' (GPUs) or 'gloo' (CPUs), or None for the device's")
    if global_batch is not None:
        dp = world // tensor_parallel  # the ranks of a tensor-parallel group share their sequences
        per = dp * grad_accumulation  # sequences of one micro-batch over all ranks, times the micro-batches
        if global_batch % per:
            what = f"the data-parallel size {dp}" + (
                f" x {grad_accumulation} micro-batches = {per}" if grad_accumulation > 1 else ""
            )
            raise ZeroFXError(
                f"global batch {global_batch} is not divisible by {what}: give a multiple "
                f"of {per} (e.g. {per * max(1, global_batch // per)}) or --batch per rank"
            )
        batch = global_batch // per
    if batch < 1:
        raise ZeroFXError(f"batch {batch}: give at least one sequence per rank")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 1):
        raise ZeroFXError(f"seq {seq!r}: give the sequence length, an int >= 1 (or none: the model's positions)")
    memory = _parse_memory(device_memory)
    from zerofx.passes.cost_model import DeviceModel

    try:
        rates = DeviceModel.preset(device)
    except ValueError as e:
        raise ZeroFXError(f"device: {e}") from None
    backend = backend or ("gloo" if device == "cpu" else "nccl")
    factory = load_factory(model_fn, factory_kwargs)
    name = model_fn if isinstance(model_fn, str) else getattr(model_fn, "__name__", type(model_fn).__name__)
    request = _Request(
        factory, name, mesh_shape, example_inputs_fn, batch, seq, device, rates, backend, gpus_per_node, memory,
        # symbolic batch and sequence sizes do not pass through DTensor's sharding of the sequence
        # yet: with tensor parallelism the plan is traced at the given sizes and solves no maximum
        optimizer, memory is not None and tensor_parallel == 1, options, tensor_parallel, tp_plan,
        grad_accumulation=grad_accumulation,
    )  # fmt: skip
    depth = _depth(model_fn, factory_kwargs, depth_kwarg)
    # the traces have fewer blocks than the model they stand for: patterns are checked on the
    # model itself, and options that do not plan every block alike trace it all
    if depth is not None and not exact and depth[1] > TRACED_DEPTHS[1] and _blocks_plan_alike(request, depth[1]):
        run: Callable[[_Request], Plan] = lambda req: _plan_by_depth(req, model_fn, factory_kwargs, *depth)  # noqa: E731
    else:
        run = _plan_once
    result = run(request)
    if request.symbolic:
        _settle_max_batch(result, request, run)
    if compare:
        for change in _alternatives(options, device):
            alt = _plan_once(dataclasses.replace(request, memory=None, symbolic=False, options={**options, **change}))
            result.alternatives.append(
                {
                    "change": ", ".join(f"{k}={v!r}" for k, v in change.items()),
                    "peak_bytes": alt.per_rank.peak_bytes,
                    "model_state_bytes": alt.per_rank.model_state_bytes,
                    "step_time_s": alt.step_time_s,
                    "comm_bytes": sum(b for dims in alt.comm_bytes_per_step.values() for b in dims.values()),
                }
            )
    result.plan_seconds = time.perf_counter() - started
    return result


# NOTE: the largest batch is solved at its own batch
# The live-bytes polynomials of a trace are those of the graphs compiled at its batch (the hint
# of the symbolic trace: max(batch, 2)), and the passes decide at that size: the activation plan's
# min-cut (passes/activation_plan.py) weighs bytes saved against FLOPs recomputed at the hint. A
# value constant in the batch weighs more against one proportional to it the smaller the batch:
# the 2-layer GPT of tests/test_plan.py at stage 1 saves the block input x = tok + pos (B, T, d)
# traced at batch 2 and the position embedding (T, d) traced at batch 4 (recomputing the add),
# so traced at 2 it solved 10 where 11 fits, as traced at 4 it solves (and a run at batch 11,
# compiled at 11, saves as at 4). So the solved batch n is traced again at n: where that trace
# solves n too, n fits with the graphs a run at n compiles and n + 1 does not with n's; else the
# new answer is traced (at most _RETRACES times), and the answer is the largest traced batch
# that its own trace says fits. A trace is one more plan (of 3 and 4 blocks, by depth), paid
# wherever the answer is another batch than the traced one, i.e. nearly always: a plan with
# device_memory takes about twice as long as one without (a 2-layer GPT 2.4 -> 5.2 s, an 8-layer
# one 7.8 -> 16 s, at 14d960e). The sequence is solved from the trace
# at the given sequence alone (a small Llama's, traced at 128 and at 512, agreed with replans at
# n and n + 1; tests/test_plan.py checks an MoE's the same way): retracing it would cost a trace
# in nearly every plan, the longest sequence that fits being rarely the one traced.

_RETRACES = 3


def _settle_max_batch(result: Plan, request: _Request, run: Callable[[_Request], Plan]) -> None:
    """``result.max_batch`` solved at its own batch (NOTE: the largest batch is solved at its own
    batch): traced again at the solved batch until a trace confirms its own answer."""
    solved = {max(request.batch, 2): (result.max_batch, result.bindings.get("batch"))}
    n = result.max_batch
    for _ in range(_RETRACES):
        if n is None or not 2 <= n < _UNBOUNDED or n in solved:
            break
        again = run(dataclasses.replace(request, batch=n))
        solved[n] = (again.max_batch, again.bindings.get("batch"))
        n = again.max_batch
    if len(solved) == 1:
        return
    fits = [h for h, (m, _) in solved.items() if m is not None and m >= h]  # fits as compiled at h
    best = max(fits) if fits else min(m for m, _ in solved.values() if m is not None)
    result.max_batch = best
    if best in solved and solved[best][1] is not None:
        result.bindings["batch"] = solved[best][1]


# NOTE: planning by depth
# A transformer is a stack of identical blocks between an embedding and a head, and zerofx's
# passes treat every block alike (buckets are whole blocks, the schedule prefetches one ahead,
# the activation plan is per value): so every number a plan reports is affine in the depth L --
# bytes, collective bytes, FLOPs and times add one block's worth per block, and the step's live
# bytes at the binding node grow by one block's saved activations. The planner therefore traces
# the model with 3 and 4 blocks (TRACED_DEPTHS) and extends each number to L:
# v(L) = v(3) + (L - 3)(v(4) - v(3)), the polynomial that bounds the batch coefficient by
# coefficient. The peak is a maximum over nodes, each affine in L, so the extension holds only if
# the same kind of node is the peak (and binds the batch and the sequence) in both traces; then it
# matches full traces (tests/test_plan.py), else the planner traces the whole model instead. Three
# blocks, not two: with two, the head's logits can still outweigh one block's activations, and the
# peak moves as blocks are added. ``exact=True`` (``--exact``) always traces the whole model:
# minutes for 80 layers. Options that plan blocks otherwise than each other trace the whole
# model too (``_blocks_plan_alike``): a byte ``activation_budget`` (absolute per graph: the more
# blocks share it, the less each keeps; 0, the least any plan keeps, is per value and extends),
# and ``checkpoint_modules`` patterns that do not match the same modules in every block of the
# model at its own depth (``blocks.[0-3]`` of 8 matches every block of both traces) or match a
# module around them. Known to differ still: regions inside every block (``blocks.*.attn``)
# and fraction budgets, where the shallow traces' peak at the head's backward grows by more
# than a block's worth per block (and from 6 blocks on by exactly that): the extension
# over-predicts, 4.6% and 5.5% of the device peak on a 7-block d_model 64 GPT.


def _depth(model_fn: Any, kwargs: dict | None, depth_kwarg: str | None) -> tuple[str, int] | None:
    """(keyword, number of blocks) when the model's depth is a factory keyword."""
    kwargs = kwargs or {}
    if isinstance(model_fn, str) and model_fn in BUILTIN_MODELS:
        key, value = "n_layer", kwargs.get("n_layer", BUILTIN_MODELS[model_fn].depth)
    elif depth_kwarg is None:
        return None
    elif depth_kwarg not in kwargs:
        raise ZeroFXError(f"depth_kwarg {depth_kwarg!r}: give its value in the factory's kwargs (--kwargs)")
    else:
        key, value = depth_kwarg, kwargs[depth_kwarg]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ZeroFXError(f"{key}={value!r}: give the number of blocks, an int >= 1")
    return key, value


TRACED_DEPTHS = (3, 4)


def _affine(v2: Any, v3: Any, steps: int) -> Any:
    """``v2 + steps * (v3 - v2)``, through dicts and numbers."""
    if isinstance(v2, dict):
        return {k: _affine(v2.get(k, 0), v3.get(k, 0), steps) for k in {**v2, **v3}}
    if isinstance(v2, bool) or not isinstance(v2, (int, float)):
        return v3
    out = v2 + steps * (v3 - v2)
    return int(out) if isinstance(v2, int) and isinstance(v3, int) else out


def _blocks_plan_alike(req: _Request, depth: int) -> bool:
    """Whether the options plan every block of the ``depth``-block model alike, so that traces of
    3 and 4 blocks extend to it (NOTE: planning by depth). Not so for a byte ``activation_budget``
    (absolute per graph: shared by more blocks, each keeps less), nor for ``checkpoint_modules``
    patterns that match some blocks otherwise than others (``blocks.[0-3]`` of 8: every block of
    the traces matches, half of the model's) or a module around the blocks. The patterns are
    checked against the model at its own depth, built once under a ``FakeTensorMode``: the
    shallower models traced for it lack its deeper blocks (``blocks.40``), so
    ``zerofx.compile``'s own check is skipped on those traces."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerofx.options import Options
    from zerofx.passes.checkpoint import check_module_patterns

    opts = Options.from_kwargs(**req.options)
    patterns = opts.checkpoint_modules
    if patterns:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = _build(req.factory, req.name)
            check_module_patterns(patterns, model)
            alike = _patterns_match_blocks_alike(model, patterns, depth)
    budget = opts.activation_budget
    if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0:
        return False  # (0: the least any plan keeps, value by value, at every depth)
    return not patterns or alike


def _patterns_match_blocks_alike(model: nn.Module, patterns: tuple[str, ...], depth: int) -> bool:
    """Whether ``patterns`` match the same modules, relative to their block, in each of the
    model's ``depth`` blocks (the one ``nn.ModuleList`` of that length), and nothing around them."""
    from zerofx.passes.checkpoint import matches

    stacks = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == depth]
    if len(stacks) != 1 or not stacks[0]:
        return False  # which modules are the blocks is not known
    names = [n for n, _ in model.named_modules(remove_duplicate=False)]
    matched = {n for n in names if matches(n, patterns)}
    parts = stacks[0].split(".")
    around = {".".join(parts[:k]) for k in range(1, len(parts) + 1)}  # the stack and the modules holding it
    if matched & around:
        return False  # one region holding all the blocks
    signatures = set()
    for i in range(depth):
        block = f"{stacks[0]}.{i}"
        signatures.add(frozenset(n[len(block) :] for n in matched if n == block or n.startswith(block + ".")))
    return len(signatures) == 1


def _plan_by_depth(request: _Request, model_fn: Any, kwargs: dict | None, key: str, depth: int) -> Plan:
    plans = []
    for blocks in TRACED_DEPTHS:
        factory = load_factory(model_fn, {**(kwargs or {}), key: blocks})
        plans.append(_plan_once(dataclasses.replace(request, factory=factory, shallow=True)))
    p2, p3 = plans  # the shallower and the deeper trace
    steps = depth - TRACED_DEPTHS[0]
    bindings = {}
    for what in ("batch", "seq"):
        b2, b3 = p2.bindings.get(what), p3.bindings.get(what)
        if (b2 is None) != (b3 is None) or (b2 and b2[0] != b3[0]):
            return _plan_once(request)  # not the same binding node in both: trace it all (NOTE above)
        if b2 is not None:
            bindings[what] = b2
    if _node_kind(p2.per_rank.peak_node) != _node_kind(p3.per_rank.peak_node):
        return _plan_once(request)
    per_rank = PerRank(
        **{
            f.name: _affine(getattr(p2.per_rank, f.name), getattr(p3.per_rank, f.name), steps)
            for f in dataclasses.fields(PerRank)
        }
    )
    result = dataclasses.replace(
        p3,
        parameters=_affine(p2.parameters, p3.parameters, steps),
        split_count=_affine(p2.split_count, p3.split_count, steps),
        per_rank=per_rank,
        comm_bytes_per_step=_affine(p2.comm_bytes_per_step, p3.comm_bytes_per_step, steps),
        step_time_s=_affine(p2.step_time_s, p3.step_time_s, steps),
        compute_s=_affine(p2.compute_s, p3.compute_s, steps),
        exposed_comm_s=_affine(p2.exposed_comm_s, p3.exposed_comm_s, steps),
        optimizer_step_s=_affine(p2.optimizer_step_s, p3.optimizer_step_s, steps),
        traced_depths=TRACED_DEPTHS,
        symbolic_peak=None,
    )
    if request.memory is not None:
        for what, attr in (("batch", "max_batch"), ("seq", "max_seq")):
            if what not in bindings:
                continue
            (_, c2, s2), (_, c3, s3) = p2.bindings[what], p3.bindings[what]
            if isinstance(c2, tuple) and isinstance(c3, tuple):
                width = max(len(c2), len(c3))
                c2, c3 = (0,) * (width - len(c2)) + c2, (0,) * (width - len(c3)) + c3
                fn: Any = tuple(_affine(a, b, steps) for a, b in zip(c2, c3))
            else:  # no polynomial (an MoE's capacity): the expression extended as the coefficients are
                fn = sympy.expand(_as_expr(c2) + steps * (_as_expr(c3) - _as_expr(c2)))
            result.bindings[what] = (p3.bindings[what][0], fn, _affine(s2, s3, steps))
            value = _largest_fit(fn, request.memory - _affine(s2, s3, steps))
            if attr == "max_seq" and p3.seq_limit is not None:
                value = min(value, p3.seq_limit)
            setattr(result, attr, value)
    _settle_peak(result)
    return result


def _node_kind(label: str) -> str:
    """A timeline label without the node's running number (``mm_57`` -> ``mm``)."""
    return re.sub(r"_\d+$", "", label.split(":")[-1])


def _alternatives(options: dict, device: str = "h100") -> list[dict]:
    """The memory options that change a plan's answer, each changed alone."""
    out = []
    for stage in (1, 2, 3):
        if stage == options.get("stage", 3):
            continue
        change: dict[str, Any] = {"stage": stage}
        if stage != 3:  # ZeRO++'s weight gathers and hpZ are stage 3's; qgZ is not stage 1's
            forbidden: dict[str, Any] = {"quantize_weights": None, "secondary_shard": False}
            if stage == 1:
                forbidden["quantize_grads"] = None
            change.update({k: v for k, v in forbidden.items() if options.get(k)})
        out.append(change)
    if options.get("activation_budget") is None and options.get("checkpoint") != "full":
        # every block recomputed whole in its own backward (NOTE: what the advice offers for
        # activations): a budget of 0 recomputes across blocks and can raise the peak instead
        out.append({"checkpoint": "full"})
    if options.get("offload_optimizer") in (None, "none"):  # on a CPU target host moves nothing
        out.append({"offload_optimizer": "disk" if device == "cpu" else "host"})
    return out


@dataclass(frozen=True)
class _Request:
    """What one trace of the planner is asked."""

    factory: Callable[[], nn.Module]
    name: str
    mesh_shape: tuple[int, ...]
    example_inputs_fn: Callable | None
    batch: int
    seq: int | None
    device: str
    rates: Any  # DeviceModel
    backend: str
    gpus_per_node: int
    memory: int | None
    optimizer: str | Callable
    symbolic: bool
    options: dict[str, Any]
    tensor_parallel: int = 1  # > 1: mesh_shape is (dp, tp) or (replicate, shard, tp)
    tp_plan: Callable | None = None
    grad_accumulation: int = 1  # micro-batches per optimizer step (NOTE: planning gradient accumulation)
    shallow: bool = False  # a model with fewer blocks than the one planned (NOTE: planning by depth)


def _plan_once(req: _Request) -> Plan:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    if req.tensor_parallel > 1:
        dims: tuple[str, ...] = ("shard", "tp") if len(req.mesh_shape) == 2 else ("replicate", "shard", "tp")
    else:
        dims = ("shard",) if len(req.mesh_shape) == 1 else ("replicate", "shard")
    options = dict(req.options)
    options.setdefault("calibrate", False)
    if options.get("offload_optimizer") in ("disk", "auto"):
        # fake tensors cannot live in files: traced as host, the tier's bytes counted by
        # _offload (NOTE: what offload moves)
        options["offload_optimizer"] = "host"
    torch._dynamo.reset()  # a fresh compile, as at launch (and no recompile limit left over from earlier plans)
    with _fake_world(math.prod(req.mesh_shape), 0, req.backend):
        mesh = init_device_mesh("cpu", req.mesh_shape, mesh_dim_names=dims)  # real tensors: outside the fake mode
        with FakeTensorMode(allow_non_fake_inputs=True):
            return _trace_step(dataclasses.replace(req, options=options), mesh, dims, req.options)


def _build(factory: Callable[[], nn.Module], name: str) -> nn.Module:
    """``factory()``, its failure or a result that is no module being one clear error."""
    try:
        model = factory()
    except ZeroFXError:
        raise
    except Exception as e:
        raise ZeroFXError(f"the model factory {name!r} raised {type(e).__name__}: {e}") from e
    if not isinstance(model, nn.Module):
        raise ZeroFXError(f"the model factory {name!r} returned a {type(model).__name__}, not an nn.Module")
    return model


def _trace_step(req: _Request, mesh: Any, dims: tuple[str, ...], given: dict) -> Plan:
    """One training step of the fake model on the fake mesh, read into a Plan (``given``: the
    options as asked, before the trace's own: NOTE: what offload moves)."""
    from torch.fx.experimental import _config as fx_config

    import zerofx
    from zerofx.api import _compile, loss_of
    from zerofx.measure.model_state import local_nbytes, model_state_bytes
    from zerofx.passes.cost_model import CommModel, CostModel, DeviceModel
    from zerofx.runtime.eager_buckets import reduce_transient_bytes
    from zerofx.runtime.params import runtime_of

    factory, name, mesh_shape, batch, seq, device = (
        req.factory,
        req.name,
        req.mesh_shape,
        req.batch,
        req.seq,
        req.device,
    )
    rates, memory, symbolic, options = req.rates, req.memory, req.symbolic, req.options
    world = math.prod(mesh_shape)
    model = _build(factory, name)
    parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    limit = _max_positions(model)
    seq = seq or limit or 1024
    if limit is not None and seq > limit:
        raise ZeroFXError(f"seq {seq} is longer than the model's {limit} positions: give --seq <= {limit}")
    inputs_fn = req.example_inputs_fn or _default_inputs(model)
    # what a real compile decides with (default constants; accelerator rates for a GPU target)
    decide = CostModel(comm=CommModel(), device=None if device == "cpu" else DeviceModel())
    if req.tensor_parallel > 1:
        from zerofx.tensor_parallel import parallelize, plan_for

        parallelize(model, mesh["tp"], (req.tp_plan or plan_for)(model))
    if req.tensor_parallel > 1:
        dp_mesh = mesh["shard"] if len(dims) == 2 else mesh["replicate", "shard"]
    else:
        dp_mesh = mesh["shard"] if len(dims) == 1 else mesh
    _compile(model, dp_mesh, None, options, cost=decide, keep_graphs=True, check_patterns=not req.shallow)
    opt = _make_optimizer(list(model.parameters()), req.optimizer, foreach=device != "cpu")
    hints = (max(batch, 2), max(seq, 3)) if symbolic else (batch, seq)

    def micro_step() -> None:
        args, kwargs = _split(_example_inputs(inputs_fn, hints))
        if symbolic:
            for t in (*args, *kwargs.values()):
                if isinstance(t, torch.Tensor) and t.dim() >= 2:
                    torch._dynamo.mark_dynamic(t, 0)
                    torch._dynamo.mark_dynamic(t, 1)
        duck = fx_config.use_duck_shape
        fx_config.use_duck_shape = False  # batch and seq get symbols of their own even when equal
        try:
            # Each backward compiled with its forward, not lazily at its first run: the lazy compile
            # deep-copies the backward graph where it runs, here under the fake mode, where a
            # constant the trace lifted into it (a real tensor: T5's relative position buckets)
            # cannot be copied (torch copies it with the fake mode unset when it compiles eagerly).
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                loss = loss_of(model(*args, **kwargs))
            if loss is None:
                raise ZeroFXError(
                    "zerofx.plan: the model's output holds no tensor that requires grad: no backward to plan"
                )
            loss.backward()
        except ZeroFXError:
            raise
        except Exception as e:
            inner = _zerofx_cause(e)
            if inner is not None:  # zerofx's own error, which dynamo wrapped
                raise inner from None
            raise _step_failure(e, name, inputs_fn) from e
        finally:
            fx_config.use_duck_shape = duck

    runtime = runtime_of(model)
    compiled = runtime.compiled
    # NOTE: planning gradient accumulation: a micro-batch under no_sync, then the last one
    first_comm, first_frames, accumulated = None, None, 0
    if req.grad_accumulation > 1:
        with zerofx.CollectiveCounter() as first_comm, zerofx.no_sync(model):
            micro_step()
        first_frames = compiled.frames()
        accumulated = sum(
            local_nbytes(s.sink.grad) for s in runtime.states if s.sink is not None and s.sink.grad is not None
        )
    with zerofx.CollectiveCounter() as comm:
        micro_step()
        state = model_state_bytes(model, opt)  # the backward's gradients still held: the step's peak
        tested = _step_planned(opt)  # NOTE: optimizer steps that read values
    if tested:
        _same_state_either_way(opt)
    last_frames = [g for g in compiled.frames() if g not in (first_frames or ())] or first_frames
    _refuse_mixed_dtype_kernels(compiled.graphs)
    whole = sum({id(s.full): local_nbytes(s.full) for s in runtime.states if s.full is not None}.values())
    buffers = sum(local_nbytes(b) for b in model.buffers())
    opt_bytes = model_state_bytes(model, opt).optimizer
    group_dim = {mesh.get_group(i).group_name: d for i, d in enumerate(dims)}
    # any other group spans the whole mesh (hpZ's flattened mesh: secondary_shard) and crosses nodes
    whole_mesh = "all" if "replicate" in dims else "shard"
    comm_bytes: dict[str, dict[str, int]] = {}
    for counter, times in ((first_comm, req.grad_accumulation - 1), (comm, 1)):
        for (kind, group), nbytes in (counter.by_group if counter else {}).items():
            dim = group_dim.get(group, whole_mesh)
            comm_bytes.setdefault(kind, {}).setdefault(dim, 0)
            comm_bytes[kind][dim] += times * int(hint(nbytes))

    inner = mesh_shape[-1] * (mesh_shape[-2] if req.tensor_parallel > 1 else 1)  # ranks the shard dim spans
    links = {
        "tp": _link("intra"),  # tensor parallelism stays inside a node
        "shard": _link("intra" if inner <= req.gpus_per_node else "inter"),
        "replicate": _link("inter"),
        "all": _link("inter"),
    }
    if device == "cpu":
        links = {d: CommModel() for d in (*dims, "all")}
    link_of = lambda group: links[group_dim.get(group, whole_mesh)]  # noqa: E731
    time_parts = _step_time(compiled, rates, comm, link_of, last_frames)
    if first_comm is not None:  # the micro-batches before the last, under no_sync
        earlier = _step_time(compiled, rates, first_comm, link_of, first_frames)
        time_parts = tuple(t + (req.grad_accumulation - 1) * e for t, e in zip(time_parts, earlier))
    params_bytes = state.params - whole
    tier, window = _offload_tier(given, params_bytes, device)
    offloaded = {"none": 0, "host": 0 if device == "cpu" else opt_bytes, "disk": params_bytes + opt_bytes}[tier]
    opt_s = 2 * (state.params + state.grads + opt_bytes) / rates.memory_bytes_per_s
    # stage 1 reduces at the end of the backward, as does the last micro-batch of an accumulation
    boundary = reduce_transient_bytes(runtime.states) if runtime.stage == 1 or accumulated else 0
    # NOTE: the optimizer step's transient memory (last: it steps the optimizer once more); the
    # gradients it starts from (stage 1: the shards the end-of-backward reduce left)
    step_grads = model_state_bytes(model, opt).grads
    if tier == "none":
        step_bytes = _step_transient(opt, runtime.states)
    else:
        step_bytes = _windowed_step_transient(opt, runtime.states, tier, window, device)
    per_rank, act, timeline, sym_peak, (max_batch, max_seq, bindings) = _memory(
        compiled,
        symbolic,
        batch,
        seq,
        params_bytes + whole + opt_bytes + buffers - offloaded,
        memory,
        boundary,
        (first_frames, last_frames, accumulated),
    )
    timeline.append(("optimizer step", step_grads + step_bytes))
    if limit is not None and max_seq is not None and max_seq > limit:
        max_seq = limit  # memory would allow more; the model has no more positions
    split = [s.layout for s in runtime.states if s.shard_dim]
    result = Plan(
        model=name,
        parameters=parameters,
        split_count=len(split),
        split_examples=split[:SPLIT_EXAMPLES],
        world_size=world,
        mesh=dict(zip(dims, mesh_shape)),
        batch=batch,
        seq=seq,
        device=device,
        options={k: v for k, v in given.items() if k != "calibrate" or v},
        per_rank=PerRank(
            params_bytes=params_bytes,
            whole_copy_bytes=whole,
            grad_bytes=state.grads,
            optimizer_bytes=opt_bytes,
            buffer_bytes=buffers,
            activation_bytes=act,
            step_peak_bytes=per_rank[0],
            peak_bytes=0,  # device_peak, below
            peak_node=per_rank[1],
            offloaded_bytes=offloaded,
            optimizer_step_bytes=step_bytes,
            optimizer_step_grad_bytes=step_grads,
            accumulated_grad_bytes=accumulated,
        ),
        comm_bytes_per_step=comm_bytes,
        step_time_s=time_parts[0] + opt_s,
        compute_s=time_parts[1],
        exposed_comm_s=time_parts[2],
        optimizer_step_s=opt_s,
        device_memory=memory,
        max_batch=max_batch,
        max_seq=max_seq,
        timeline=timeline,
        symbolic_peak=sym_peak,
        seq_limit=limit,
        bindings=bindings,
        grad_accumulation=req.grad_accumulation,
    )
    _settle_peak(result)
    return result


# NOTE: what offload moves
# zerofx/runtime/offload_store.py, per tier, on the device the plan is for:
#   host on a CPU target: nothing (host memory is the device's memory; docs/memory.md);
#   host on a GPU: the optimizer state, parked in pinned host memory after each window's step;
#     the parameter shards stay on the device (``place_model_state`` moves shards into files
#     only for disk), as do the gradients;
#   disk (CPU only: the graphs read the shards from their mappings): the parameter shards and
#     the optimizer state, each in its memory-mapped file.
# ``auto`` is disk when three times the shards' bytes exceed ``host_memory_cap``, else host. The
# offloaded step runs a window of parameters at a time (``host_memory_cap / 8``, else 64 MiB,
# counting parameter + two moments): its transient is, over the windows, the most of what the
# window brings back to the device (host on a GPU: its state; disk: its shards and state, paged
# in) plus what the window's own step allocates (the optimizer's step on that window alone, on
# fake tensors, as ``_step_transient``). A whole-tensor step (Adafactor, Muon) is planned as in
# memory (its windows hold the largest tensor whole anyway), plus the largest window's
# brought-back bytes.


def _offload_tier(options: dict, params_bytes: int, device: str) -> tuple[str, int]:
    """(where model state lives: none, host or disk, the step's window bytes) as
    ``place_model_state`` decides it (NOTE: what offload moves)."""
    tier = options.get("offload_optimizer") or "none"
    cap = options.get("host_memory_cap")
    if tier == "auto":
        tier = "disk" if 3 * params_bytes > cap else "host"
    if tier == "disk" and device != "cpu":
        raise ZeroFXError(
            f"offload_optimizer={options['offload_optimizer']!r} keeps parameter shards in memory-mapped files"
            f"{' (auto: they exceed host_memory_cap)' if options['offload_optimizer'] == 'auto' else ''}, which "
            f"the device reads directly only on CPU; on {device} use offload_optimizer='host'"
        )
    return tier, cap // 8 if cap else 64 * 2**20


def _windowed_step_transient(opt: torch.optim.Optimizer, states: list, tier: str, window: int, device: str) -> int:
    """The offloaded step's transient on the device (NOTE: what offload moves): a window of
    parameters at a time, each window's step on fake tensors (uncounted)."""
    from zerofx.measure.model_state import local_nbytes
    from zerofx.measure.transient import TransientBytes
    from zerofx.runtime.offload_store import _windows
    from zerofx.runtime.whole_step import whole_step_class

    def brought(win: list) -> int:  # what the window brings back to the device
        nbytes = sum(local_nbytes(p) for p in win) if tier == "disk" else 0
        if tier == "disk" or device != "cpu":
            nbytes += sum(
                local_nbytes(v)
                for p in win
                for v in opt.state.get(p, {}).values()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            )
        return nbytes

    groups = [list(g["params"]) for g in opt.param_groups]
    ordered = [p for ps in groups for p in ps if p.grad is not None]
    windows = _windows(ordered, window)
    if whole_step_class(opt) is not None:
        return _step_transient(opt, states) + max((brought(w) for w in windows), default=0)
    worst = 0
    try:
        for win in windows:
            members = set(win)
            for g, ps in zip(opt.param_groups, groups):
                g["params"] = [p for p in ps if p in members]
            with _PlaceholderScalars(test=False), TransientBytes() as held:
                opt.step()
            worst = max(worst, brought(win) + held.peak)
    finally:
        for g, ps in zip(opt.param_groups, groups):
            g["params"] = ps
    return worst


def _settle_peak(p: Plan) -> None:
    """The device's peak from the per-rank fields, and no batch or sequence where the optimizer
    step alone does not fit (it does not grow with either)."""
    p.per_rank.peak_bytes = p.per_rank.device_peak()
    if p.device_memory is not None and p.per_rank.optimizer_step_peak_bytes > p.device_memory:
        p.max_batch = 0 if p.max_batch is not None else None
        p.max_seq = 0 if p.max_seq is not None else None


def _positive_int(n: Any) -> bool:
    """Whether ``n`` is an integer >= 1 (a Python or numpy int; not a bool, not a float that
    happens to be whole)."""
    return isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1


def _example_inputs(inputs_fn: Callable, hints: tuple[int, int]) -> Any:
    """``inputs_fn(batch, seq)``, its failure or a result holding no tensor being one clear error."""
    name = getattr(inputs_fn, "__name__", type(inputs_fn).__name__)
    try:
        inputs = inputs_fn(*hints)
    except ZeroFXError:
        raise
    except Exception as e:
        raise ZeroFXError(f"zerofx.plan: the example inputs function {name!r} raised {type(e).__name__}: {e}") from e
    args, kwargs = _split(inputs)
    if not any(isinstance(t, torch.Tensor) for t in (*args, *kwargs.values())):
        raise ZeroFXError(
            f"zerofx.plan: the example inputs function {name!r} returned {type(inputs).__name__} {inputs!r:.80} "
            "with no tensor in it: return (args, kwargs), a tuple of forward arguments, or a dict of keyword ones"
        )
    return inputs


def _zerofx_cause(error: BaseException) -> ZeroFXError | None:
    """The ZeroFXError ``error`` wraps (dynamo wraps what a backend raises while compiling), if any."""
    seen, cause = set(), error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, ZeroFXError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or getattr(cause, "inner_exception", None)
    return None


def _step_failure(error: Exception, model_name: str, inputs_fn: Callable) -> ZeroFXError:
    """The planned training step's failure (the model's forward on the example inputs, a shape
    that does not fit) as one ZeroFXError naming the model and the inputs, with the error's
    first line (the innermost cause's: dynamo's wrappers say only where it happened)."""
    seen = set()
    while error.__cause__ is not None and id(error) not in seen:
        seen.add(id(error))
        error = error.__cause__
    text = str(error)
    what = f"{type(error).__name__}: {first_line(text)[:400]}"
    # dynamo's "RuntimeError when making fake tensor call" names the op's own error inside
    found = re.search(r"got (\w+)\((['\"])(.*?)\2\)", text)
    if found:
        what = f"{found.group(1)}: {found.group(3)[:400]}"
    inputs = getattr(inputs_fn, "__name__", type(inputs_fn).__name__)
    return ZeroFXError(
        f"zerofx.plan: a training step of {model_name!r} on the inputs of {inputs!r} failed: {what} "
        "(zerofx.plan from Python shows the traceback)"
    )


def _split(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict):
        return tuple(inputs[0]), inputs[1]
    if isinstance(inputs, dict):
        return (), inputs
    return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), {}


def _step_time(compiled, rates, counter, link_of, frames=None) -> tuple[float, float, float]:
    """(graph time, compute, exposed communication) of a step (of the graphs of ``frames``, default
    all), ``link_of(group name)`` pricing each collective; collectives outside the graphs (stages
    1-2: the post-step all-gather, stage 1's boundary reduce) are exposed in full."""
    from zerofx.measure.instrument import graph_collectives
    from zerofx.passes.cost_model import estimate_time

    total = compute = 0.0
    in_graphs: dict[tuple[str, str], int] = {}
    for (gid, _), gm in compiled.graphs.items():
        if frames is not None and gid not in frames:
            continue
        t = estimate_time(gm, rates, link_of)
        total, compute = total + t.total_s, compute + t.compute_s
        for kind, nbytes, group, *_ in graph_collectives(gm):
            in_graphs[(kind, group)] = in_graphs.get((kind, group), 0) + hint(nbytes)
    eager = 0.0
    for (kind, group), nbytes in counter.by_group.items():
        rest = hint(nbytes) - in_graphs.get((kind, group), 0)
        if rest > 0:
            eager += link_of(group).time(rest)
    total += eager
    return total, compute, total - compute


# NOTE: planning gradient accumulation
# With ``grad_accumulation=N`` the step is N micro-batches of ``batch``, the first N-1 under
# ``zerofx.no_sync`` (zerofx/runtime/accumulation.py). Their parameters take the ``local_grad``
# route at every stage (zerofx/runtime/params.py, NOTE: the accumulation boundary): each backward
# returns whole, unreduced gradients, which autograd adds into one whole buffer per parameter,
# held until the last micro-batch's backward ends and the boundary reduce lands each rank's
# shard. The plan runs what a rank runs: a micro-batch under no_sync, whose gradients are those
# buffers (``accumulated_grad_bytes``: whole, in the reduce dtype, per rank; 4 bytes per
# parameter in fp32, not sharded), then the last micro-batch, whose graphs (the same local
# route, compiled once more) run on top of them, then the boundary reduce (its eager buckets'
# transient, as stage 1's at every step). The step's peak is the largest of the first
# micro-batch alone, the later ones on top of the held gradients, and the boundary; measured on
# gloo ranks it is where the run peaks (tests/test_plan.py). Collective bytes and times count N
# micro-batches: N-1 of the first, one of the last (stage 3 gathers N times, reduces once).
# ``global_batch`` is ``batch`` x data-parallel size x N.


# NOTE: solving for the largest batch
# With symbolic batch B and sequence S, the live bytes after every node of every graph of the
# step are polynomials in (B, S) with non-negative coefficients (a sum of the sizes of the tensors
# live there), so the step's peak is the largest of them and grows with B and S. The largest batch
# that fits is the smallest, over those polynomials, of the positive root of
# static + p_i(B, seq) = device_memory: each is linear in B (transformers' tensors are), solved in
# exact rationals; the largest sequence is the same with p_i(batch, S), at most quadratic (attention
# without a fused kernel), solved by sympy. Polynomials are deduplicated first, and ones dominated
# coefficient by coefficient by another are dropped (their roots are never the smallest). An
# expression that is no polynomial in the variable, as an MoE's capacity ``max(1, b*t*k //
# n_experts)`` (zerofx/models.py) makes one (Max and floor: sympy.Poly refuses it), is solved by
# evaluating it at integers, which the live bytes allow because they do not decrease as batch or
# sequence grow: doubling from 1, then bisecting, below the polynomials' smallest root (the same
# answer the roots give where both apply; tests/test_plan.py). Planned by depth, such a binding
# is extended as the coefficients are, expression by expression.


def _memory(compiled, symbolic, batch, seq, static, memory, boundary=0, accumulation=(None, None, 0)):
    """((step peak, peak node), saved activations, downsampled timeline, symbolic peak, (max batch,
    max seq, what binds them)). Saved activations: what the forward graphs allocate and return
    beyond their inputs. ``accumulation``: (the frames of a micro-batch under no_sync, those of
    the last micro-batch, the bytes of whole gradients held from the first to the last) when
    micro-batches accumulate (NOTE: planning gradient accumulation); ``boundary``: the transient of
    the reduce at the end of the last backward."""
    from zerofx.passes.cost_model import memory_timeline, predict_step_peak, returned_bytes, tangent_bytes

    first_frames, frames, accumulated = accumulation
    frames = frames or compiled.frames()
    graphs = compiled.graphs
    labels: list[str] = []
    values: list[Any] = []
    live: Any = sympy.Integer(0) if symbolic else 0

    def walk(gid: str, kind: str, base: Any) -> Any:
        gm = graphs[(gid, kind)]
        tl, out = memory_timeline(gm, inputs_freed_at_last_use=(kind == "backward"), symbolic=symbolic)
        for node, v in tl:
            labels.append(f"{gid}.{kind}:{node}")
            values.append(base + v)
        return out

    def micro_batch(frames: list[str], live: Any) -> tuple[dict, Any]:
        fw_out = {}
        for gid in frames:
            fw_out[gid] = walk(gid, "forward", live)
            live = live + fw_out[gid]
        for i, gid in enumerate(reversed(frames)):  # the first gets its gradients from the engine
            engine = tangent_bytes(graphs[(gid, "backward")], symbolic) if i == 0 else 0
            out = walk(gid, "backward", live + engine)
            live = live + out - fw_out[gid]
        return fw_out, live

    if first_frames:  # the first micro-batch under no_sync: its gradients become the whole ones held
        micro_batch(first_frames, live)
        live = live + accumulated
    fw_out, live = micro_batch(frames, live)
    if accumulated:  # the last backward's whole gradients were added to those held, in place
        live = sympy.Integer(accumulated) if symbolic else accumulated
    if boundary:  # the end-of-backward reduce of pending gradients, outside the graphs, ...
        held = sum(  # ... before backward() returns: the caller still holds what the forwards returned
            (returned_bytes(graphs[(gid, "forward")], compiled.num_fwd_outputs[gid], symbolic) for gid in frames),
            sympy.Integer(0) if symbolic else 0,
        )
        labels.append("boundary reduce (eager buckets)")
        values.append(live + held + boundary)
    if not symbolic:
        graphs_peak = predict_step_peak(compiled.memory_estimates, frames)
        if first_frames:  # the last micro-batch's graphs on top of the whole gradients held
            graphs_peak = max(accumulated + graphs_peak, predict_step_peak(compiled.memory_estimates, first_frames))
        peak = max(graphs_peak, values[-1] if boundary else 0)
        i = max(range(len(values)), key=lambda j: values[j]) if values else 0
        node = labels[i] if labels else "start"
        return (peak, node), int(sum(fw_out.values())), _downsample(labels, values), None, (None, None, {})
    B, S = _symbols(compiled)
    at = {B: batch, S: seq} if B is not None else {}
    numeric = [int(sympy.sympify(v).subs(at)) for v in values]
    i = max(range(len(numeric)), key=lambda j: numeric[j])
    peak = max(numeric[i], 0)
    polys = _envelope(labels, values)
    max_batch = max_seq = None
    bindings = {}
    if B is not None:
        max_batch, bindings["batch"] = _solve(polys, B, {S: seq}, memory - static)
        max_seq, bindings["seq"] = _solve(polys, S, {B: batch}, memory - static)
    bindings = {k: (*v, static) for k, v in bindings.items() if v is not None}
    sym = str(sympy.sympify(values[i]).expand()) if values else None
    act = int(sympy.sympify(sum(fw_out.values(), sympy.Integer(0))).subs(at))
    return (peak, labels[i]), act, _downsample(labels, numeric), sym, (max_batch, max_seq, bindings)


def _symbols(compiled) -> tuple[Any, Any]:
    """The size symbols of batch and sequence: the first forward input with two symbolic dims."""
    for (gid, kind), gm in sorted(compiled.graphs.items()):
        if kind != "forward":
            continue
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() >= 2:
                b, s = val.shape[0], val.shape[1]
                if isinstance(b, torch.SymInt) and isinstance(s, torch.SymInt):
                    return b.node.expr, s.node.expr
    return None, None


def _envelope(labels: list[str], values: list[Any]) -> dict[sympy.Expr, str]:
    """The distinct symbolic live-bytes expressions of the step, each with its first node."""
    out: dict[sympy.Expr, str] = {}
    for label, v in zip(labels, values):
        e = sympy.expand(sympy.sympify(v))
        if e.free_symbols and e not in out:
            out[e] = label
    return out


def _solve(exprs: dict[sympy.Expr, str], var: Any, fixed: dict, room: int) -> tuple[int, tuple | None]:
    """The largest integer ``var`` >= 1 at which every expression (at ``fixed``) is <= ``room``
    (NOTE: solving for the largest batch), 0 when even 1 does not fit; and what binds it: (the
    node's kind, the polynomial's coefficients in ``var``, highest first, or for an expression
    that is no polynomial in ``var`` the expression in ``_X``)."""
    if room <= 0:
        return 0, None
    best: Any = None
    binding = None
    seen: set = set()
    others: dict[sympy.Expr, str] = {}  # not polynomials in var (an MoE's capacity: Max, floor)
    for expr, label in exprs.items():
        e = sympy.expand(expr.subs(fixed))
        if var not in e.free_symbols:
            if e > room:
                return 0, None
            continue
        try:
            coeffs = tuple(sympy.Poly(e, var).all_coeffs())
        except sympy.PolynomialError:
            others.setdefault(e, label)
            continue
        if coeffs in seen:
            continue
        seen.add(coeffs)
        bound = _first_crossing(coeffs, room)
        if bound is not None and (best is None or bound < best):
            best, binding = bound, (_node_kind(label), tuple(int(c) for c in coeffs))
    cap = _UNBOUNDED if best is None else max(int(sympy.floor(best)), 0)
    if others and cap >= 1:  # searched below the polynomials' bound: the smaller binds
        n, e = _search_largest(list(others), var, room, cap)
        if e is not None:
            return n, (_node_kind(others[e]), e.xreplace({var: _X}))
    return cap, binding


_UNBOUNDED = 2**62  # the largest batch or sequence where nothing grows with it: any size fits
_X = sympy.Symbol("x", integer=True, positive=True)  # the variable of a binding that is no polynomial


def _search_largest(exprs: list[sympy.Expr], var: Any, room: int, cap: int) -> tuple[int, sympy.Expr | None]:
    """The largest integer n in [0, ``cap``] at which every expression of ``var`` is <= ``room``,
    by evaluating them at integers (NOTE: solving for the largest batch: live bytes do not decrease
    as batch or sequence grow): doubling from 1, then bisecting. With the expression that rises
    above ``room`` at n + 1, or None when all of them fit at ``cap``."""
    order = list(exprs)

    def above(n: int) -> sympy.Expr | None:  # the first expression above room at n (moved to the front)
        at = {var: sympy.Integer(n)}
        for i, e in enumerate(order):
            if int(e.xreplace(at)) > room:
                order.insert(0, order.pop(i))
                return e
        return None

    if above(cap) is None:
        return cap, None
    if above(1) is not None:
        return 0, order[0]
    lo, hi = 1, 2  # above(lo) is None; above(cap) is not
    while hi < cap and above(hi) is None:
        lo, hi = hi, hi * 2
    hi = min(hi, cap)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if above(mid) is None else (lo, mid)
    return lo, above(lo + 1)


def _largest_fit(fn: tuple | sympy.Expr, room: int) -> int:
    """The largest integer x >= 1 at which a binding's function of x (polynomial coefficients,
    highest first, or an expression in ``_X``) is <= ``room``; 0 if none, ``_UNBOUNDED`` if any."""
    if isinstance(fn, tuple):
        bound = _first_crossing(tuple(sympy.Rational(c) for c in fn), room)
        return _UNBOUNDED if bound is None else max(int(sympy.floor(bound)), 0)
    return _search_largest([fn], _X, room, _UNBOUNDED)[0]


def _as_expr(fn: tuple | sympy.Expr) -> sympy.Expr:
    """A binding's function of x as an expression in ``_X``."""
    if isinstance(fn, tuple):
        return sum((sympy.Integer(c) * _X**k for k, c in enumerate(reversed(fn))), sympy.Integer(0))
    return fn


def _first_crossing(coeffs: tuple, room: int) -> Any:
    """The smallest x > 0 where the polynomial with ``coeffs`` (highest first) rises through
    ``room``; 0 if it is above ``room`` already at x -> 0+; None if it never rises through it.
    Closed form for degree 1 (exact rationals), sympy's real roots above."""
    if len(coeffs) == 2:  # a*x + b
        a, b = (sympy.Rational(c) for c in coeffs)
        if a <= 0:
            return None if b <= room else 0
        return (room - b) / a
    x = sympy.Symbol("x", positive=True)
    poly = sympy.Poly(sum(c * x**k for k, c in enumerate(reversed(coeffs))) - room, x)
    if poly.eval(0) > 0:
        return 0
    for r in sorted(poly.real_roots()):
        if r > 0 and poly.diff(x).eval(r) >= 0:
            return r
    return None


def _downsample(labels: list[str], values: list[int], points: int = 2000) -> list[tuple[str, int]]:
    """At most ``points`` (label, bytes), keeping each bin's largest value (the peak survives)."""
    if len(values) <= points:
        return [(lbl, int(v)) for lbl, v in zip(labels, values)]
    step = len(values) / points
    out = []
    for k in range(points):
        lo, hi = int(k * step), max(int((k + 1) * step), int(k * step) + 1)
        j = max(range(lo, min(hi, len(values))), key=lambda i: values[i])
        out.append((labels[j], int(values[j])))
    return out


def write_timeline_plot(p: Plan, path: str) -> str:
    """The step's estimated memory timeline per rank (matplotlib, the ``plots`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = p.per_rank
    at_rest = r.peak_bytes - r.step_peak_bytes
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot([(at_rest + v) / 2**30 for _, v in p.timeline], lw=1, label="live bytes (estimate)")
    ax.axhline(at_rest / 2**30, color="gray", ls=":", label="model state at rest")
    if p.device_memory is not None:
        ax.axhline(p.device_memory / 2**30, color="red", ls="--", label="device memory")
    title = f"{p.model}: {p.world_size} ranks, batch {p.batch} x seq {p.seq}"
    if p.traced_depths:  # the timeline is the deeper trace's; the peak is the whole model's
        ax.axhline(r.peak_bytes / 2**30, color="black", ls="-.", label="peak of the whole model (extended by depth)")
        title += f"\ntimeline of the {p.traced_depths[1]}-block trace the plan was extended from"
    ax.set_xlabel("graph nodes in execution order (forward, then backward)")
    ax.set_ylabel("GiB per rank")
    ax.set_title(title)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def dump_json(p: Plan, path: str) -> None:
    with open(path, "w") as f:
        json.dump(p.to_json(), f, indent=1)
