"""The collectives zerofx issues outside its graphs, in flat buckets: the stage-1/2 refresh of
the whole copies after an optimizer step, and the accumulation-boundary reduce (zerofx/runtime/params.py,
NOTE: the accumulation boundary).

Issued one per parameter, these cost a collective's fixed price per parameter (gloo's latency,
docs/measurements.md; a launch and NCCL's latency on a GPU). Here consecutive
parameters of one process group and dtype travel together, in parameter order (the same on every
rank), up to ``BUCKET_BYTES`` per collective. Inside a bucket the layout is rank-major: rank r's
part is its padded shards of the bucket's parameters, one after the other (zerofx/ir/markers.py, NOTE:
shard layout), so one all-gather (refresh) or one reduce-scatter (boundary) moves them all. On
gloo the reduce-scatter runs as an all-to-all plus a local sum, as the transport pass does in the
graphs (passes/transport.py: half the bytes of gloo's all-reduce-based reduce-scatter); over two
gloo ranks, as the exchange pass does, only the peer's half moves and this rank's half is added
into what arrives (zerofx/ir/collectives.py, NOTE: pair reduce-scatter).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Hashable, Iterator, TypeVar

import torch

from zerofx import stress
from zerofx.ir.collectives import (
    PAIR_REDUCE_SCATTER_OUT,
    PAIR_SUM,
    all_gather,
    backend_of,
    record_collectives,
    wire_bytes,
)
from zerofx.ir.layout import local_rows, pad_rows, padded_rows, row_offset

__all__ = ["BUCKET_BYTES", "from_owners", "refresh", "reduce_pending", "reduce_transient_bytes", "to_owners"]

BUCKET_BYTES = 32 << 20  # past the size where gloo and NCCL reach their bandwidth; bounds the transient copy

_F = torch.ops._c10d_functional
T = TypeVar("T")


def _buckets(items: list[T], key: Callable[[T], Hashable], nbytes: Callable[[T], int]) -> Iterator[list[T]]:
    """Runs of consecutive ``items`` with one ``key``, each at most ``BUCKET_BYTES`` (or one item)."""
    bucket: list[T] = []
    used = 0
    for item in items:
        size = nbytes(item)
        if bucket and (key(item) != key(bucket[0]) or used + size > BUCKET_BYTES):
            yield bucket
            bucket, used = [], 0
        bucket.append(item)
        used += size
    if bucket:
        yield bucket


def rank_ordered_sum(chunks: torch.Tensor) -> torch.Tensor:
    """``chunks[0] + chunks[1] + ...`` added one after another in rank order (a new tensor): the
    order the transport pass fixes in the graphs (see its docstring), not ``sum(0)``'s."""
    total = chunks[0] + chunks[1] if chunks.shape[0] > 1 else chunks[0].clone()
    for chunk in chunks[2:]:
        total += chunk
    return total


def _on_gloo(group_name: str) -> bool:
    return backend_of(group_name) == "gloo"


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` flattened one after another into one contiguous tensor (no copy for one)."""
    flats = [t.reshape(-1) for t in tensors]
    return torch.cat(flats) if len(flats) > 1 else flats[0].contiguous()


def _gather_bucket(shards: list[tuple[torch.Tensor, int]], group) -> torch.Tensor:
    """One all-gather of a bucket of ``(local rows, whole rows)`` shards over ``group``: each
    padded to the rows every rank holds, flattened one after another. Returns ``[group size,
    bucket]``: row r is rank r's part, each shard's padded rows in bucket order."""
    flat = _flat([pad_rows(local, padded_rows(rows, group.size)) for local, rows in shards])
    gathered = _F.wait_tensor(all_gather(flat, group.size, group.name)).view(group.size, -1)
    record_collectives(
        [("all_gather", wire_bytes("all_gather", gathered.numel() * gathered.element_size(), group.size), group.name)]
    )
    return gathered


@stress.eager  # seeded sleeps at collectives when ZEROFX_STRESS_DELAY is set (zerofx/stress.py)
@torch.no_grad()
def refresh(states: list) -> None:
    """All-gather every state's updated shard into its whole copy ``full`` (a collective)."""
    todo = [s for s in states if s.full is not None]

    def padded(s) -> int:
        return padded_rows(s.full_rows, s.shard_group.size) * s.row_numel

    for bucket in _buckets(
        todo, lambda s: (s.shard_group.name, s.full.dtype), lambda s: padded(s) * s.full.element_size()
    ):
        group = bucket[0].shard_group
        dtype = bucket[0].full.dtype
        gathered = _gather_bucket([(s.rows(s.param.to_local()).to(dtype), s.full_rows) for s in bucket], group)
        offset = 0
        for s in bucket:
            n = padded(s)
            part = gathered[:, offset : offset + n]
            full = s.rows(s.full)  # (NOTE: the sharded dim)
            if padded_rows(s.full_rows, group.size) * group.size == s.full_rows and not s.shard_dim:
                full.view(group.size, n).copy_(part)
            else:  # padding rows sit after the last real row: drop them on the way
                full.copy_(part.reshape(-1, *full.shape[1:])[: s.full_rows])
            s.mark_synced()  # after the copy: without mixed precision the shard is a view of ``full``
            offset += n


# NOTE: exact splits
# ``to_owners`` / ``from_owners`` move each rank's real rows only. A Shard(0) tensor's rows are
# split as torch.chunk splits them: ranks in order, ceil(rows / N) each, the last ones short or
# empty. Padding every rank's part to ceil(rows / N) rows, as the graphs' all-gathers do (their
# collectives take equal parts), would have the owner receive and hold N * ceil(rows / N) rows:
# for a tensor with fewer rows than ranks (a mixture of experts' [experts, ffn, d] weights over
# more ranks than experts) N / rows times the tensor, mostly zeros. ``all_to_all_single`` takes a
# size per peer, so each rank sends its real rows and the owner receives exactly the tensor:
# in rank order a tensor's parts are its rows in order, so a lone tensor arrives whole, in place.


def _rows_of(whole_rows: int, n: int, rank: int) -> tuple[int, int]:
    """(first row, rows) of ``rank``'s part of a tensor of ``whole_rows`` rows split over ``n``."""
    return row_offset(whole_rows, n, rank), local_rows(whole_rows, n, rank)


@stress.eager
@torch.no_grad()
def to_owners(parts: list[list[tuple[torch.Tensor, int]]], group: Any) -> list[torch.Tensor]:
    """Each rank of ``group`` (a ``GroupInfo``) gets the whole tensors it owns. ``parts[o]``:
    this rank's dim-0 rows (a parameter's shard, its gradient's, or a state tensor sharded like
    it) of each tensor rank ``o`` owns, with its whole number of rows; all of one dtype, the same
    list structure on every rank. Returns the whole tensors of ``parts[group.rank]``, contiguous
    (a reduction over a strided view may round differently from the unsharded tensor's): each
    assembled from every rank's rows, or for a lone tensor the received buffer itself. One
    ``all_to_all_single`` of every rank's real rows, flat (NOTE: exact splits); a collective of
    the group. For the optimizer's whole-tensor step (zerofx/runtime/whole_step.py)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    n, me = group.size, group.rank
    template = next((t for owned in parts for t, _ in owned), None)
    if template is None:
        return []
    chunks = [t[: local_rows(whole, n, me)] for owned in parts for t, whole in owned]  # (a shard is never padded)
    send = [sum(local_rows(whole, n, me) * math.prod(t.shape[1:]) for t, whole in owned) for owned in parts]
    mine = parts[me]
    row = [math.prod(t.shape[1:]) for t, _ in mine]
    recv = [sum(_rows_of(whole, n, r)[1] * k for (_, whole), k in zip(mine, row)) for r in range(n)]
    sent = _flat(chunks) if chunks else template.new_empty(0)
    wire, dtype = _wire(sent)
    received = template.new_empty(sum(recv), dtype=wire)
    pg = _resolve_process_group(group.name)
    dist.all_to_all_single(received, sent.view(wire), recv, send, group=pg)
    # on torch's fake group (zerofx.plan) this one rank owns every tensor: count what a rank of a
    # real run moves, its share less the part it owns itself (whole_step.py: ``_owners``)
    sent_elems = sum(send) * (n - 1) // n if dist.get_backend(pg) == "fake" else sum(send) - send[me]
    record_collectives([("all_to_all", sent_elems * sent.element_size(), group.name)])
    del sent, chunks  # the flat copy is spent: not held while the owned tensors are assembled
    received = received.view(dtype)
    if len(mine) == 1:  # a lone tensor's parts in rank order are its rows in order
        return [received.view(-1, *mine[0][0].shape[1:])]
    pieces: list[list[torch.Tensor]] = [[] for _ in mine]  # per tensor, every rank's rows in rank order
    for r, buffer in enumerate(received.split(recv)):
        offset = 0
        for (t, whole), k, got in zip(mine, row, pieces):
            rows = _rows_of(whole, n, r)[1]
            got.append(buffer[offset : offset + rows * k].view(rows, *t.shape[1:]))
            offset += rows * k
    out = [torch.cat(got) for got in pieces]
    return out


@stress.eager
@torch.no_grad()
def from_owners(
    sent: list[torch.Tensor],
    expect: list[list[tuple[torch.Size, bool]]],
    dtype: torch.dtype,
    device: torch.device,
    group: Any,
) -> list[list[torch.Tensor]]:
    """The inverse of ``to_owners``, and more: ``expect[o]`` lists what rank ``o`` of ``group``
    sends (the same on every rank), each a ``(whole shape, rows?)``: a tensor laid out as a
    dim-0-sharded parameter (``rows`` True: every rank gets its rows, torch.chunk's split as a
    Shard(0) DTensor's) or a small one every rank gets whole. ``sent``: this rank's tensors,
    those of ``expect[group.rank]``. Returns, per owner, what this rank got of each of its
    tensors: views of one buffer. One ``all_to_all_single`` of exactly those rows (NOTE: exact
    splits), flat; a collective of the group."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    n, me = group.size, group.rank

    def size(shape: torch.Size, rows: bool, r: int) -> int:  # what rank r gets of it
        return _rows_of(shape[0], n, r)[1] * math.prod(shape[1:]) if rows else math.prod(shape)

    send = [sum(size(*e, r) for e in expect[me]) for r in range(n)]
    recv = [sum(size(*e, me) for e in owned) for owned in expect]
    outgoing = _outgoing(sent, expect[me], n, dtype, device)
    wire, _ = _wire(outgoing)
    received = torch.empty(sum(recv), dtype=wire, device=device)
    pg = _resolve_process_group(group.name)
    dist.all_to_all_single(received, outgoing.view(wire), recv, send, group=pg)
    # on torch's fake group (zerofx.plan) this one rank owns every tensor: a real rank owns 1/n of them
    sending = sum(send) - send[me]
    if dist.get_backend(pg) == "fake":
        sending //= n
    record_collectives([("all_to_all", sending * outgoing.element_size(), group.name)])
    del outgoing  # the flat copy is spent: not held while the caller takes its parts
    received = received.view(dtype)
    out: list[list[torch.Tensor]] = []
    offset = 0
    for owned in expect:
        got = []
        for shape, rows in owned:
            k = size(shape, rows, me)
            got.append(
                received[offset : offset + k].view(-1, *shape[1:])
                if rows
                else received[offset : offset + k].view(shape)
            )
            offset += k
        out.append(got)
    return out


def _outgoing(
    sent: list[torch.Tensor], expect: list[tuple[torch.Size, bool]], n: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """What ``from_owners`` sends, flat in rank order: each rank's rows of each tensor laid out
    as rows (``expect``: ``(whole shape, rows?)``), every other tensor whole to every rank."""
    if len(sent) == 1 and expect[0][1]:  # one tensor's rows alone: in rank order they are the message
        return sent[0].to(device).reshape(-1)
    pieces: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for t, (shape, rows) in zip(sent, expect):
        t = t.to(device)  # (torch keeps its step counts on the host)
        for r in range(n):
            if rows:
                first, count = _rows_of(shape[0], n, r)
                pieces[r].append(t[first : first + count].reshape(-1))
            else:
                pieces[r].append(t.reshape(-1))
    flat = [p for r in range(n) for p in pieces[r]]
    return _flat(flat) if flat else torch.empty(0, dtype=dtype, device=device)


def _wire(t: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """The dtype ``t``'s bytes travel as (gloo takes no bool: as bytes), and its own."""
    return (torch.uint8 if t.dtype == torch.bool else t.dtype), t.dtype


@stress.eager
@torch.no_grad()
def reduce_pending(states: list) -> None:
    """Land every pending local gradient in its parameter's gradient (a collective): dim-0
    sharded parameters in buckets, whole or 2-D-mesh ones one by one after them."""
    pending = [s for s in states if s.sink.grad is not None]
    sharded = _sharded_with_sinks(states, pending_only=True)
    for bucket in _buckets(
        sharded,
        lambda s: (s.shard_group.name, s.reduce_dtype or s.sink.dtype),
        lambda s: s.sink.grad.numel() * s.sink.grad.element_size(),
    ):
        _reduce_bucket(bucket)
    for s in pending:
        if s not in sharded:
            s.land_pending()


def _sharded_with_sinks(states: list, pending_only: bool) -> list:
    return [
        s
        for s in states
        if (s.sink.grad is not None or (not pending_only and s.param.requires_grad))
        and not s.whole and s.replicate_group is None
    ]  # fmt: skip


def reduce_transient_bytes(states: list) -> int:
    """The most bytes ``reduce_pending`` allocates at once above the pending gradients, for every
    parameter with a sink, as if all were pending (what ``zerofx.plan`` adds at the end of a
    stage-1 backward, where they are): per
    bucket, the padded copies of gradients that need padding or a cast, the flat input, and the
    collective's buffers: on gloo the received chunks and their sum (over two gloo ranks only the
    peer's half, summed in place), elsewhere the reduce-scatter's output. The same buckets and
    the same allocations as ``_reduce_bucket``."""
    sharded = _sharded_with_sinks(states, pending_only=False)
    worst = 0
    for bucket in _buckets(
        sharded,
        lambda s: (s.shard_group.name, s.reduce_dtype or s.sink.dtype),
        lambda s: s.sink.numel() * s.sink.element_size(),
    ):
        world = bucket[0].shard_group.size
        dtype = bucket[0].reduce_dtype or bucket[0].sink.dtype
        size = torch.empty((), dtype=dtype).element_size()
        whole = copies = 0  # bytes of the bucket's padded gradients; of the padded or cast copies
        for s in bucket:
            rows = padded_rows(s.full_rows, world) * world
            nbytes = rows * s.row_numel * size
            whole += nbytes
            if rows != s.full_rows or dtype != s.sink.dtype or s.shard_dim:  # (a permuted view is copied)
                copies += nbytes
        flat = 0 if len(bucket) == 1 and not copies else whole  # torch.cat, unless one gradient is viewed
        # gloo: the received chunks and their sum; over two ranks only the peer's half arrives
        # and is summed in place. Else the reduce-scatter's output.
        received = whole if _on_gloo(bucket[0].shard_group.name) and world != 2 else 0
        worst = max(worst, copies + flat + received + whole // world)
    return worst


def _reduce_bucket(bucket: list) -> None:
    group = bucket[0].shard_group
    world = group.size
    grads = []
    for s in bucket:
        g, s.sink.grad = s.sink.grad, None
        grads.append(s.rows(g))  # (NOTE: the sharded dim)
    dtype = bucket[0].reduce_dtype or grads[0].dtype
    chunks = [
        pad_rows(g.to(dtype), padded_rows(s.full_rows, world) * world).reshape(world, -1) for s, g in zip(bucket, grads)
    ]
    inp = torch.cat(chunks, dim=1) if len(chunks) > 1 else chunks[0].contiguous()  # [world, my part of each]
    if _on_gloo(group.name) and world == 2:  # only the peer's half moves (NOTE: pair reduce-scatter)
        received = torch.empty_like(inp[:1])
        _F.wait_tensor(PAIR_REDUCE_SCATTER_OUT(inp, group.name, out=received))
        reduced = PAIR_SUM(received, inp, group.name, world).view(-1)
    elif _on_gloo(group.name):
        split = [inp.shape[1]] * world
        received = _F.wait_tensor(_F.all_to_all_single(inp.view(-1), split, split, group.name))
        reduced = rank_ordered_sum(received.view(world, -1)).div_(world)
    else:
        reduced = _F.wait_tensor(_F.reduce_scatter_tensor(inp.view(-1), "avg", world, group.name))
    record_collectives(
        [("reduce_scatter", wire_bytes("reduce_scatter", inp.numel() * inp.element_size(), world), group.name)]
    )
    offset = 0
    for s, g, chunk in zip(bucket, grads, chunks):
        n = chunk.shape[1]
        rows = reduced[offset : offset + n].view(-1, *g.shape[1:])[: s.shard_rows]
        s.land(s.unrows(g), s.unrows(rows.to(s.param.dtype)))
        offset += n
