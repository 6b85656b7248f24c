"""What a training step costs: model-state bytes per rank and collective bytes on the wire.

# NOTE: counting collective bytes
Bytes are counted per rank, as the ZeRO paper and nccl-tests' "bus bandwidth" count them for
ring algorithms: an all-gather of an ``S``-byte output moves ``S·(N-1)/N`` bytes into each rank,
a reduce-scatter of an ``S``-byte input moves ``S·(N-1)/N`` out of each rank, an all-reduce
(reduce-scatter + all-gather) ``2·S·(N-1)/N``. So ZeRO-3 moves ``3·Ψ·(N-1)/N`` per step (forward
gather, backward re-gather, gradient reduce-scatter; Ψ = parameter bytes), ZeRO-1/2 and DDP
``2·Ψ·(N-1)/N`` (ZeRO-1/2: gradient reduce-scatter, then the all-gather of updated shards after
the optimizer step). Collectives zerofx runs outside graphs (ZeRO-1's end-of-backward reduce,
the post-step all-gather) go through the same marker ops and are counted the same way.
The backend's actual traffic can differ (gloo runs reduce_scatter as an all-reduce of the whole
input); these numbers describe the algorithm, comparable across backends.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from zerofx._scoped import Scoped

__all__ = ["wire_bytes", "collective_kind", "CollectiveCounter", "record_collectives", "ModelStateBytes", "model_state_bytes",
           "model_state_addresses", "local_nbytes", "COLLECTIVE_OPS", "AllocationTrace"]

_F = torch.ops._c10d_functional


@dataclass(frozen=True)
class CollectiveSpec:
    """How to read one collective op: its kind, which tensor's size counts, where its group size is."""

    kind: str
    sized: str  # "out" or "in"
    group_size_arg: int | None  # None: resolve from the group name (all_reduce has no size arg)
    group_name_arg: int


COLLECTIVE_OPS: dict = {
    _F.all_gather_into_tensor.default: CollectiveSpec("all_gather", "out", 1, 2),
    _F.all_gather_into_tensor_out.default: CollectiveSpec("all_gather", "out", 1, 2),
    _F.reduce_scatter_tensor.default: CollectiveSpec("reduce_scatter", "in", 2, 3),
    _F.all_reduce.default: CollectiveSpec("all_reduce", "in", None, 2),
    _F.all_to_all_single.default: CollectiveSpec("all_to_all", "in", None, 3),
}


def collective_kind(node) -> str:
    """What a graph's collective node counts as: its op's kind, unless a pass ran the algorithm
    on another op (passes/transport.py lowers gloo reduce-scatters to all-to-alls, recording
    ``meta["zerofx_collective"] = "reduce_scatter"``)."""
    return node.meta.get("zerofx_collective") or COLLECTIVE_OPS[node.target].kind


def collective_group_size(spec: CollectiveSpec, args: tuple) -> int:
    if spec.group_size_arg is not None:
        return args[spec.group_size_arg]
    if spec.kind == "all_to_all" and args[1]:
        return len(args[1])  # one output split per rank
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(args[spec.group_name_arg]).size()


def wire_bytes(kind: str, tensor_bytes: int, group_size: int) -> int:
    """Per-rank bytes of one collective (see NOTE: counting collective bytes)."""
    share = tensor_bytes * (group_size - 1) // group_size
    return 2 * share if kind == "all_reduce" else share


def local_nbytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for ``t`` (its local shard when ``t`` is a DTensor)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


class CollectiveCounter(Scoped):
    """Count the collectives zerofx runs, in bytes per kind (see NOTE: counting collective bytes).

    Every graph zerofx compiled reports its collectives each time it runs (the executor knows
    them from the graph's fake-tensor metadata), and the marker ops report theirs when they run
    eagerly (no compile, a graph break, a disabled pass). Collectives issued outside zerofx
    (say, ``clip_grad_norm_``'s all-reduce) are not counted. A dispatch mode would see those
    too, but torch.compile does not run compiled code under a dispatch mode, so it would count
    a different (eager) program than the one that trains. Use around forward and backward::

        with CollectiveCounter() as comm:
            model(x).backward()
        comm.bytes["all_gather"]
    """

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def record_collectives(collectives: list[tuple[str, int]]) -> None:
    """Add ``(kind, wire_bytes)`` pairs to every active CollectiveCounter (cheap when none is)."""
    if not CollectiveCounter._scoped_entered:
        return
    with CollectiveCounter._scoped_lock:
        for counter in CollectiveCounter._scoped_entered:
            for kind, nbytes in collectives:
                counter.bytes[kind] += nbytes
                counter.calls[kind] += 1


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model state held by this rank (ZeRO's "model states")."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _storages(tensors: list[torch.Tensor]) -> dict[int, int]:
    """The distinct storages behind ``tensors`` (local shards for DTensors): address -> bytes.

    Counting storages, not numel, is what memory really holds: a stage-1/2 shard that is a view
    of its rows of the whole copy costs nothing extra, and a gradient that is a view of a larger
    (padded or whole) buffer keeps all of that buffer alive."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if t.numel() == 0 or 0 in t.stride():  # empty shards; stride-0 gradient sinks hold one element
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return seen


def _model_state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
    params = list(model.parameters())
    states = [getattr(p, "_zerofx_state", None) for p in params]
    param_tensors = params + [s.full for s in states if s is not None and s.full is not None]
    grad_tensors = [p.grad for p in params if p.grad is not None]
    grad_tensors += [s.sink.grad for s in states if s is not None and s.sink is not None and s.sink.grad is not None]
    opt_tensors = []
    if optimizer is not None:
        for state in optimizer.state.values():
            opt_tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return param_tensors, grad_tensors, opt_tensors


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> ModelStateBytes:
    """Local bytes of parameters, gradients and per-element optimizer state, by storage.

    Parameters include the whole copies stages 1 and 2 keep; gradients include the whole,
    unreduced gradients pending reduction (stage 1 and ``zerofx.no_sync``). Scalar optimizer
    state (e.g. Adam's ``step``) is not per-element state and is left out.
    """
    params, grads, opt = _model_state_tensors(model, optimizer)
    return ModelStateBytes(*(sum(_storages(ts).values()) for ts in (params, grads, opt)))


def model_state_addresses(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> set[int]:
    """Addresses of the storages :func:`model_state_bytes` counts (for ``AllocationTrace.step_peak``)."""
    return {addr for ts in _model_state_tensors(model, optimizer) for addr in _storages(ts)}


class AllocationTrace:
    """Live bytes over time as the allocator saw them, for the CPU (profiler memory events).

    On CPU there is no allocator counter to read, and torch.compile does not run compiled code
    under a dispatch mode, so a dispatch-level storage tracker would measure a different
    (eager) program. The profiler's memory events see every allocation and free that compiled
    and eager code make on the thread that traces. Use ``mark()`` to take timestamps between
    phases::

        with AllocationTrace() as trace:
            t0 = trace.mark(); step(); t1 = trace.mark()
        trace.peak_between(t0, t1) - trace.live_at(t0)   # bytes a step needed above its start

    # NOTE: frees the profiler does not see
    The profiler records a free only on a thread it profiles. Collective backends drop their
    last reference to a collective's buffers on their own worker thread (gloo's work objects
    hold the input until the work is destroyed there), so those frees never appear, and the
    allocator's running total (the events' ``total_allocated``) drifts upward by them, step
    after step, and across traces in one process (measured: FSDP2 eager 1.67 -> 7.26 MiB of
    "live" bytes at step start over four steps with a flat process RSS). So this class keeps
    its own ledger from the events' addresses and sizes: a block is live from its allocation
    until its free, or until the allocator hands out the same address again (which proves
    the block was freed in between, unseen); frees of blocks allocated before the trace are
    ignored. What remains is an over-count, never an under-count: an unseen free is taken
    to happen at the address's next reuse, at the latest the end of the trace.

    Over many steps that over-count piles up: zerofx's gloo reduce-scatters (all-to-all input
    and output, 3 MiB each on the medium benchmark GPT) were still "live" at later steps'
    starts, 9-18 MiB of them, while the process's in-use heap (glibc ``mallinfo2``) between
    steps stayed flat (and its excess over eager FSDP2's, ~15 MiB, was compiled code: compiled
    FSDP2 showed ~12 MiB). ``step_peak`` is the measure for one
    step of a long run: at the step's start it counts only what a rank provably holds between
    steps: blocks allocated before ``persistent_before`` (pass the end of model construction:
    the model, its shards, wrappers' buffers) and the storages at ``held`` (model state the
    previous step kept: :func:`model_state_addresses` taken before ``zero_grad``, so storages
    that gradients are views of, such as DDP's buckets with ``gradient_as_bucket_view``, are
    included). A step leaves nothing else behind, so the rest of the ledger at that moment is
    blocks a backend thread freed unseen. Unseen frees within the measured step still
    over-count.
    Checked against the kernel's count (VmHWM - VmRSS over a step with
    ``MALLOC_MMAP_THRESHOLD_=65536``, so each tensor is its own mapping), medium GPT, 2 ranks,
    four steps each: growth above the step's start 59.7-59.8 (kernel) vs 58.7-59.8 MiB (ledger)
    for FSDP2 eager, 56.1-59.0 vs 56.1-59.2 MiB for zerofx.
    """

    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []  # (time_ns, live bytes since the trace started)
        self._raw: list[tuple[int, int, int]] = []  # (time_ns, bytes (< 0: a free), address)
        self._prof = None

    def __enter__(self) -> AllocationTrace:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def mark(self) -> int:
        """A timestamp on the profiler's clock (epoch nanoseconds)."""
        return time.time_ns()

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(*exc)
        from torch._C._profiler import _EventType

        raw = []
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                f = node.extra_fields
                raw.append((node.start_time_ns, f.alloc_size, f.ptr))
            stack.extend(node.children)
        raw.sort(key=lambda e: e[0])
        self._raw = raw
        live, ledger, events = 0, {}, []
        for t, size, ptr in raw:
            if size > 0:
                live += size - ledger.pop(ptr, 0)  # a reused address: its old block was freed
                ledger[ptr] = size
            else:
                live -= ledger.pop(ptr, 0)  # 0: allocated before the trace, not counted
            events.append((t, live))
        self.events = events

    def live_at(self, t_ns: int) -> int:
        live = 0
        for t, total in self.events:
            if t > t_ns:
                break
            live = total
        return live

    def peak_between(self, t0: int, t1: int) -> int:
        return max([self.live_at(t0)] + [total for t, total in self.events if t0 <= t <= t1])

    @property
    def peak(self) -> int:
        return max((total for _, total in self.events), default=0)

    def step_peak(self, t0: int, t1: int, persistent_before: int, held: Collection[int] = ()) -> int:
        """Most bytes live during ``[t0, t1]``, counting as live at ``t0`` only blocks allocated
        before ``persistent_before`` or at an address in ``held`` (see the NOTE above)."""
        ledger: dict[int, tuple[int, int]] = {}  # address -> (bytes, allocated at)
        start = bisect.bisect_right(self._raw, t0, key=lambda e: e[0])
        for t, size, ptr in self._raw[:start]:
            if size > 0:
                ledger[ptr] = (size, t)
            else:
                ledger.pop(ptr, None)
        sizes = {ptr: size for ptr, (size, t) in ledger.items() if t < persistent_before or ptr in held}
        live = peak = sum(sizes.values())
        for t, size, ptr in self._raw[start:]:
            if t > t1:
                break
            if size > 0:
                live += size - sizes.pop(ptr, 0)
                sizes[ptr] = size
            else:
                live -= sizes.pop(ptr, 0)
            peak = max(peak, live)
        return peak
