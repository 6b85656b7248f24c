"""What a training step costs: model-state bytes per rank and collective bytes on the wire.

# NOTE: counting collective bytes
Bytes are counted per rank, as the ZeRO paper and nccl-tests' "bus bandwidth" count them for
ring algorithms: an all-gather of an ``S``-byte output moves ``S·(N-1)/N`` bytes into each rank,
a reduce-scatter of an ``S``-byte input moves ``S·(N-1)/N`` out of each rank, an all-reduce
(reduce-scatter + all-gather) ``2·S·(N-1)/N``. So ZeRO-3 moves ``3·Ψ·(N-1)/N`` per step (forward
gather, backward re-gather, gradient reduce-scatter; Ψ = parameter bytes) and DDP ``2·Ψ·(N-1)/N``.
The backend's actual traffic can differ (gloo runs reduce_scatter as an all-reduce of the whole
input); these numbers describe the algorithm, comparable across backends.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

__all__ = ["wire_bytes", "CollectiveCounter", "record_collectives", "ModelStateBytes", "model_state_bytes",
           "local_nbytes", "COLLECTIVE_OPS", "AllocationTrace"]

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
}


def collective_group_size(spec: CollectiveSpec, args: tuple) -> int:
    if spec.group_size_arg is not None:
        return args[spec.group_size_arg]
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


class CollectiveCounter:
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

    def __enter__(self) -> CollectiveCounter:
        with _active_lock:
            _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _active_lock:
            _active.remove(self)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


_active: list[CollectiveCounter] = []
_active_lock = threading.Lock()


def record_collectives(collectives: list[tuple[str, int]]) -> None:
    """Add ``(kind, wire_bytes)`` pairs to every active CollectiveCounter (cheap when none is)."""
    if not _active:
        return
    with _active_lock:
        for counter in _active:
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


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> ModelStateBytes:
    """Local bytes of parameters, gradients and per-element optimizer state.

    Scalar optimizer state (e.g. Adam's ``step``) is not per-element state and is left out.
    """
    params = list(model.parameters())
    param_bytes = sum(local_nbytes(p) for p in params)
    grad_bytes = sum(local_nbytes(p.grad) for p in params if p.grad is not None)
    opt_bytes = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    opt_bytes += local_nbytes(value)
    return ModelStateBytes(param_bytes, grad_bytes, opt_bytes)


class AllocationTrace:
    """Live bytes over time as the allocator saw them, for CPU (profiler) and CUDA (allocator stats).

    On CPU there is no allocator counter to read, and torch.compile does not run compiled code
    under a dispatch mode, so a dispatch-level storage tracker would measure a different
    (eager) program. The profiler's memory events do see every allocation and free made by
    compiled and eager code alike, each with the running total of bytes allocated since the
    trace started: that running total is the curve this class reads. Use ``mark()`` to take
    timestamps between phases::

        with AllocationTrace() as trace:
            t0 = trace.mark(); step(); t1 = trace.mark()
        trace.peak_between(t0, t1) - trace.live_at(t0)   # bytes a step needed above its start

    Values are relative to the moment the trace started (tensors alive before are not seen).
    """

    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []  # (time_ns, live bytes since start)
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

        events = []
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                events.append((node.start_time_ns, node.extra_fields.total_allocated))
            stack.extend(node.children)
        self.events = sorted(events)

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
