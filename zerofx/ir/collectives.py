"""The collectives zerofx's graphs and markers issue: which ops they are, how to read them, how
their bytes on the wire are counted, and the counter that adds them up.

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

# NOTE: gloo all-gathers in flight
On a gloo process group, torch's out-of-place all-gather (``_c10d_functional.all_gather_into_tensor``)
runs ProcessGroupGloo's *coalesced* all-gather work (``allgather_into_tensor_coalesced``). When two
of those run at once on gloo's two worker threads, a small heap block (the shared_ptr control
block gloo allocates for a transport buffer) is freed twice (or while in use), and glibc aborts
later, on whichever thread allocates next (``malloc(): unaligned tcache chunk detected``,
``munmap_chunk(): invalid pointer``). This was issue 13's intermittent crash. tests/gloo_repro.py
reproduces it with torch alone, usually within seconds; calling the process group's coalesced
all-gather directly does too, and a group with one worker thread does not. The ``out=`` form (``all_gather_into_tensor_out``:
ProcessGroupGloo's plain all-gather work, what ``dist.all_gather_into_tensor`` runs) and the other
functional collectives ran the same loop clean (docs/measurements.md, transport: gloo
all-gathers). So zerofx never issues the out-of-place all-gather on gloo: graphs are rewritten by
passes/transport.py, eager code gathers through ``all_gather`` below. NCCL graphs keep the
out-of-place op. DTensor's own gathers (``full_tensor``, reading a parameter) wait before the next
one is issued, so they never have two in flight.

# NOTE: pair exchange
ProcessGroupGloo's all-gather (the ``out=`` form too) gathers into a flat buffer it allocates
itself, then copies every rank's chunk out of it into the output: per all-gather one more
output-sized allocation and two output-sized copies on gloo's worker thread, on top of the
transfer. Its all-to-all sends from and receives into the caller's tensors. Between two ranks an
all-gather is an exchange: each rank keeps its own rows and receives its peer's, so
``zerofx::all_gather_pair_out(x, group, out=buf)`` is one ``all_to_all_single`` that sends
``x`` (written into its rows of ``buf`` first, unless it already is those rows, as a bucket's
input is) and receives the peer's rows into theirs; the work is registered on ``buf``, so
``wait_tensor(buf)`` waits for it, as for the functional collectives. Same bytes on the wire
(``S·(N-1)/N``), counted as an all-gather. passes/exchange.py puts it in place of every gloo
all-gather over two ranks (measured: docs/measurements.md, exchange).

# NOTE: pair reduce-scatter
passes/transport.py runs a gloo reduce-scatter as an all-to-all of the whole input, then sums
the chunks. ``all_to_all_single`` sends each rank its chunk, this rank's own chunk included,
which gloo copies from the input into the output on its worker thread, into a receive buffer as
large as the input. Between two ranks only the peer's half has to move:
``zerofx::reduce_scatter_pair_out(x, group, out=buf)`` sends the peer's half of ``x`` and
receives the peer's contribution to this rank's half into ``buf`` (half of ``x``). After the
wait, ``zerofx::pair_sum_(buf, x, group, divisor)`` adds this rank's half of ``x`` into ``buf``
in place (and divides, for "avg"). Half the receive buffer, no self-copy, no sum buffer, and
the same bits, since ``a + b == b + a`` exactly for two floats. Same bytes on the wire, counted
as a reduce-scatter. passes/exchange.py rewrites transport's two-rank lowering into it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from zerofx._scoped import Scoped
from zerofx.ir.meta import COLLECTIVE

__all__ = [
    "CollectiveSpec",
    "COLLECTIVE_OPS",
    "ALL_GATHER",
    "ALL_GATHER_OUT",
    "REDUCE_SCATTER",
    "ALL_REDUCE",
    "ALL_TO_ALL",
    "PAIR_GATHER_OUT",
    "PAIR_REDUCE_SCATTER_OUT",
    "PAIR_SUM",
    "WAIT",
    "all_gather",
    "collective_kind",
    "collective_group_size",
    "wire_bytes",
    "backend_of",
    "CollectiveCounter",
    "record_collectives",
    "simulated_backend",
]

_F = torch.ops._c10d_functional
ALL_GATHER = _F.all_gather_into_tensor.default
ALL_GATHER_OUT = _F.all_gather_into_tensor_out.default
REDUCE_SCATTER = _F.reduce_scatter_tensor.default
ALL_REDUCE = _F.all_reduce.default
ALL_TO_ALL = _F.all_to_all_single.default
WAIT = _F.wait_tensor.default


def all_gather(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Issue the all-gather of ``x`` (contiguous) along dim 0 on ``group_name``: the output,
    ``group_size`` times ``x``'s rows, to ``wait_tensor`` before use. Always the ``out=`` form
    (NOTE: gloo all-gathers in flight)."""
    out = x.new_empty((x.shape[0] * group_size, *x.shape[1:]))
    return ALL_GATHER_OUT(x, group_size, group_name, out=out)


_lib = torch.library.Library("zerofx", "FRAGMENT")
_lib.define("all_gather_pair_out(Tensor x, str group_name, *, Tensor(a!) out) -> Tensor(a!)")


@torch.library.impl(_lib, "all_gather_pair_out", "CompositeExplicitAutograd")
def _all_gather_pair_out(x: torch.Tensor, group_name: str, *, out: torch.Tensor) -> torch.Tensor:
    """The all-gather of ``x`` (dim 0) over a group of two ranks into ``out``, as an exchange
    (NOTE: pair exchange). Asynchronous: ``wait_tensor(out)`` before reading ``out``."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    if group.size() != 2 or out.shape[0] != 2 * x.shape[0]:
        raise ValueError(
            f"all_gather_pair_out: a group of 2 ranks and an output of twice the input's rows "
            f"(got group size {group.size()}, rows {x.shape[0]} -> {out.shape[0]})"
        )
    rows = x.shape[0]
    rank = dist.get_rank(group)
    mine, theirs = out.narrow(0, rank * rows, rows), out.narrow(0, (1 - rank) * rows, rows)
    if mine.data_ptr() != x.data_ptr() or mine.stride() != x.stride():
        mine.copy_(x)
    splits = [0, 0]
    splits[1 - rank] = rows
    work = dist.all_to_all_single(theirs, mine, splits, splits, group=group, async_op=True)
    torch._C._distributed_c10d._register_work(out, work)
    return out


@torch.library.register_fake("zerofx::all_gather_pair_out")
def _all_gather_pair_out_fake(x: torch.Tensor, group_name: str, *, out: torch.Tensor) -> torch.Tensor:
    return out


PAIR_GATHER_OUT = torch.ops.zerofx.all_gather_pair_out.default

_lib.define("reduce_scatter_pair_out(Tensor x, str group_name, *, Tensor(a!) out) -> Tensor(a!)")
_lib.define("pair_sum_(Tensor(a!) received, Tensor x, str group_name, int divisor) -> Tensor(a!)")


def _pair_halves(x: torch.Tensor, group_name: str, what: str) -> tuple[int, torch.Tensor, torch.Tensor]:
    """This rank's index in a group of two, and ``x``'s two halves (dim 0): its own, its peer's."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    if group.size() != 2 or x.shape[0] % 2:
        raise ValueError(
            f"{what}: a group of 2 ranks and an even number of rows (got group size {group.size()}, rows {x.shape[0]})"
        )
    half, rank = x.shape[0] // 2, dist.get_rank(group)
    return rank, x.narrow(0, rank * half, half), x.narrow(0, (1 - rank) * half, half)


@torch.library.impl(_lib, "reduce_scatter_pair_out", "CompositeExplicitAutograd")
def _reduce_scatter_pair_out(x: torch.Tensor, group_name: str, *, out: torch.Tensor) -> torch.Tensor:
    """The exchange half of a reduce-scatter of ``x`` (dim 0) over a group of two ranks (NOTE:
    pair reduce-scatter): sends the peer's half of ``x`` and receives the peer's contribution to
    this rank's half into ``out`` (half of ``x``'s rows). Asynchronous: ``wait_tensor(out)``,
    then ``pair_sum_(out, x, ...)`` for the reduced half."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    rank, _, theirs = _pair_halves(x, group_name, "reduce_scatter_pair_out")
    if out.shape != theirs.shape:
        raise ValueError(
            f"reduce_scatter_pair_out: out must have half of x's rows ({tuple(theirs.shape)}, got {tuple(out.shape)})"
        )
    splits = [0, 0]
    splits[1 - rank] = theirs.shape[0]
    work = dist.all_to_all_single(
        out, theirs.contiguous(), splits, splits, group=_resolve_process_group(group_name), async_op=True
    )
    torch._C._distributed_c10d._register_work(out, work)
    return out


@torch.library.register_fake("zerofx::reduce_scatter_pair_out")
def _reduce_scatter_pair_out_fake(x: torch.Tensor, group_name: str, *, out: torch.Tensor) -> torch.Tensor:
    return out


@torch.library.impl(_lib, "pair_sum_", "CompositeExplicitAutograd")
def _pair_sum_(received: torch.Tensor, x: torch.Tensor, group_name: str, divisor: int) -> torch.Tensor:
    """The local sum of a pair reduce-scatter, in place in ``received``: this rank's half of ``x``
    plus the peer's contribution, divided by ``divisor`` (2 for "avg", 1 for "sum"). The same bits
    as the rank-ordered ``c0 + c1`` of passes/transport.py: IEEE addition of two values is
    commutative."""
    _, mine, _ = _pair_halves(x, group_name, "pair_sum_")
    received.add_(mine)
    if divisor != 1:
        received.div_(divisor)
    return received


@torch.library.register_fake("zerofx::pair_sum_")
def _pair_sum_fake(received: torch.Tensor, x: torch.Tensor, group_name: str, divisor: int) -> torch.Tensor:
    return received


PAIR_REDUCE_SCATTER_OUT = torch.ops.zerofx.reduce_scatter_pair_out.default
PAIR_SUM = torch.ops.zerofx.pair_sum_.default


@dataclass(frozen=True)
class CollectiveSpec:
    """How to read one collective op: its kind, which tensor's size counts, where its group size is."""

    kind: str
    sized: str  # "out" or "in"
    group_size_arg: int | None  # None: resolve from the group name (all_reduce has no size arg)
    group_name_arg: int


COLLECTIVE_OPS: dict = {
    ALL_GATHER: CollectiveSpec("all_gather", "out", 1, 2),
    ALL_GATHER_OUT: CollectiveSpec("all_gather", "out", 1, 2),
    REDUCE_SCATTER: CollectiveSpec("reduce_scatter", "in", 2, 3),
    ALL_REDUCE: CollectiveSpec("all_reduce", "in", None, 2),
    ALL_TO_ALL: CollectiveSpec("all_to_all", "in", None, 3),
    PAIR_GATHER_OUT: CollectiveSpec("all_gather", "out", None, 1),
    PAIR_REDUCE_SCATTER_OUT: CollectiveSpec("reduce_scatter", "in", None, 1),
}


def collective_kind(node) -> str:
    """What a graph's collective node counts as: its op's kind, unless a pass ran the algorithm
    on another op (passes/transport.py lowers gloo reduce-scatters to all-to-alls, recording
    ``meta["zerofx_collective"] = "reduce_scatter"``)."""
    return node.meta.get(COLLECTIVE) or COLLECTIVE_OPS[node.target].kind


def collective_group_size(spec: CollectiveSpec, args: tuple) -> int:
    if spec.group_size_arg is not None:
        return args[spec.group_size_arg]
    if spec.kind == "all_to_all" and args[1]:
        return len(args[1])  # one output split per rank
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(args[spec.group_name_arg]).size()


_simulated: list[str] = []

# process group name -> the mesh dimension it is ("dp", "tp", "replicate", ...): what the dump and
# the planner label collectives with; filled where zerofx learns the meshes (zerofx/sharding.py)
_MESH_DIMS: dict[str, str] = {}


def name_mesh_dims(mesh, unnamed: tuple[str, ...] | None = None) -> None:
    """Remember which mesh dimension each of ``mesh``'s process groups is: its name, or for an
    unnamed mesh ``unnamed`` (else ``dim<i>``)."""
    names = mesh.mesh_dim_names or unnamed or tuple(f"dim{i}" for i in range(mesh.ndim))
    for i, name in enumerate(names):
        _MESH_DIMS[mesh.get_group(i).group_name] = name


def mesh_dim_of(group_name: str) -> str:
    """The mesh dimension a process group was registered as (``name_mesh_dims``), else
    ``group <name>``."""
    return _MESH_DIMS.get(group_name, f"group {group_name}")


def mesh_dim_or_size(group_name: str) -> str:
    """The mesh dimension a process group was registered as, else its size (``"4 ranks"``): the
    same on every rank of a dimension, unlike the names of its groups."""
    if group_name in _MESH_DIMS:
        return _MESH_DIMS[group_name]
    from torch.distributed.distributed_c10d import _resolve_process_group

    return f"{_resolve_process_group(group_name).size()} ranks"


def backend_of(group_name: str) -> str:
    """The backend ("gloo", "nccl", ...) of the process group registered as ``group_name``; inside
    ``simulated_backend(name)``, a fake process group answers ``name``."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    backend = str(dist.get_backend(_resolve_process_group(group_name)))
    if backend == "fake" and _simulated:
        return _simulated[-1]
    return backend


class simulated_backend:
    """``with simulated_backend("nccl"):`` the fake process groups ``zerofx.plan`` builds stand for
    ``name``, so every decision that depends on the backend (passes/transport.py's gloo
    rewrite, the eager buckets' algorithm) is the one a real run on that backend makes."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> simulated_backend:
        _simulated.append(self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        _simulated.pop()


def wire_bytes(kind: str, tensor_bytes: int, group_size: int) -> int:
    """Per-rank bytes of one collective (see NOTE: counting collective bytes)."""
    share = tensor_bytes * (group_size - 1) // group_size
    return 2 * share if kind == "all_reduce" else share


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
        self.by_group: Counter[tuple[str, str]] = Counter()  # (kind, process group name) -> bytes
        # (kind, what is on the wire: a dtype, or a block-quantized format such as "int8") -> bytes
        self.by_wire: Counter[tuple[str, str]] = Counter()
        # bytes the same collectives would have moved unquantized (passes/quantize.py)
        self.unquantized: Counter[str] = Counter()

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def record_collectives(collectives: list[tuple]) -> None:
    """Add ``(kind, wire_bytes, group_name[, wire, unquantized_bytes])`` to every active
    CollectiveCounter (cheap when none is). ``wire`` says what moved (a dtype name, or a
    quantized format: "int8", "int4"; "" when unknown), ``unquantized_bytes`` what the
    collective would have moved unquantized (default: ``wire_bytes``)."""
    if not CollectiveCounter._scoped_entered:
        return
    with CollectiveCounter._scoped_lock:
        for counter in CollectiveCounter._scoped_entered:
            for kind, nbytes, group, *more in collectives:
                counter.bytes[kind] += nbytes
                counter.calls[kind] += 1
                counter.by_group[(kind, group)] += nbytes
                counter.by_wire[(kind, more[0] if more else "")] += nbytes
                counter.unquantized[kind] += more[1] if len(more) > 1 else nbytes
