"""transport: how each collective moves on its process group's backend, and when its buffers die.

The passes before this one speak in terms of what a collective computes; this one decides how
it moves. Today that means three rewrites, on gloo groups only. First, every all-gather gathers
into a buffer the graph allocates:

    ag = _c10d_functional.all_gather_into_tensor(x, N, group)
  becomes
    buf = aten.empty([N * rows, ...]);  ag = _c10d_functional.all_gather_into_tensor_out(x, N, group, out=buf)

Why: on gloo the out-of-place op runs ProcessGroupGloo's coalesced all-gather, which corrupts
the heap when two of them are in flight at once (zerofx/ir/collectives.py, NOTE: gloo all-gathers
in flight); the ``out=`` op runs its plain all-gather, which does not. Same bytes on the wire,
same result, and the buffer is allocated where the collective used to allocate it.

# NOTE: symbolic gathers
Parameter gathers have static shapes (parameters never get size symbols), but a graph traced
with dynamic shapes may gather a value whose rows are a symbol (a user's own all-gather of an
activation). Leaving that one out of place would bring back the heap corruption, so its buffer
is sized in the graph: ``aten.sym_size.int`` of the input's symbolic dims, dim 0 times N, as
arguments of ``aten.empty``; every size the graph runs at gets a buffer of its own shape.

Second:

    rs = _c10d_functional.reduce_scatter_tensor(x, "avg", N, group)
    w  = _c10d_functional.wait_tensor(rs)
  becomes
    a  = _c10d_functional.all_to_all_single(x, [R/N]*N, [R/N]*N, group)   # where rs was issued
    w  = _c10d_functional.wait_tensor(a)                                   # where w was
    v  = aten.view(w, [N, R/N, ...]);  s = v[0] + v[1] (+ v[2] ...);  s = aten.div(s, N)   # "avg" only

Why: gloo implements ``reduce_scatter_tensor`` as an all-reduce of the whole input followed by
a copy of the shard, twice the bytes a ring reduce-scatter needs. An all-to-all sends each
rank exactly its chunk ((N-1)/N of the input out of each rank, the reduce-scatter's own wire
volume) and the receiver sums the N chunks it got: same result, half the traffic (measured:
docs/measurements.md, transport). NCCL's reduce-scatter is a true ring/tree reduce-scatter, so other backends are left alone.

The local sum adds the N chunks one after another in rank order, ((c0 + c1) + c2) + ..., on
every rank, so results depend neither on arrival order nor on ATen: ``aten.sum`` over dim 0
picks its own association (sequential up to 4 rows on torch 2.13, not from 5 on), and the
fixed order is what lets ``zerofx.testing.ShardedReference`` reproduce the reduction bit for
bit. For N > 2 the N-1 adds keep one more R/N-sized intermediate alive than a sum would.

Memory: the receive buffer is as large as the input (the reduce-scatter's
output is 1/N of it), alive from issue to the sum right after the wait; the dump's estimate
and the counted bytes (NOTE: counting collective bytes) see the lowered graph. The counters
keep calling it a reduce-scatter (``meta[COLLECTIVE]``): the algorithm did not change.

The third rewrite, also gloo only, decides when a collective's buffers die. gloo's work
object holds a collective's input and output, and its worker thread drops that reference
whenever it next gets a core after finishing, often after the graph has dropped its own: on
two busy cores that is milliseconds later, the free happens on the worker thread (where the
profiler's allocation trace cannot see it) and the step's memory depends on thread scheduling.
So after each wait, once the last reader of a buffer the graph allocated has run, the graph
frees the buffer's bytes itself (``inductor::resize_storage_bytes_(t, 0)``, the op FSDP2's
compiled path frees its all-gather buffers with): the all-gather's flat input and gathered
output, the all-to-all's input and received chunks. Parameters, graph inputs, values the graph
returns or saves for backward, and anything aliasing them are never touched. Aliasing is read
from the fake values' storages plus what fake tensors do not show: a wait returns its
collective's tensor, an ``out=`` collective writes into ``out`` (what it changed:
docs/measurements.md, transport). NCCL's buffers are left to the caching allocator's stream
semantics.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from zerofx.ir.collectives import (
    ALL_GATHER,
    ALL_GATHER_OUT,
    ALL_TO_ALL,
    COLLECTIVE_OPS,
    REDUCE_SCATTER,
    WAIT,
    backend_of,
)
from zerofx.ir.meta import COLLECTIVE, QUANTIZED, ROLE
from zerofx.passes.contract import Pass, PassContext
from zerofx.passes.cost_model import storage_root
from zerofx.passes.graph import insert_call, positions, rows_arg, size_args

aten = torch.ops.aten
RELEASE = torch.ops.inductor.resize_storage_bytes_.default


def transport_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """On gloo, gather into graph-allocated buffers (the out-of-place all-gather corrupts the heap
    when two are in flight), lower reduce-scatters to an all-to-all plus a local sum (half the wire
    bytes), and free collectives' buffers on the graph's thread after their last reader."""
    backends: dict[str, str] = {}
    _gather_into_buffers(gm, ctx, backends)
    _lower_reduce_scatters(gm, ctx, backends)
    _release_buffers(gm, ctx, backends)
    return gm


def _on_gloo(group: str, backends: dict[str, str]) -> bool:
    if group not in backends:
        backends[group] = backend_of(group)
    return backends[group] == "gloo"


def _gather_into_buffers(gm: fx.GraphModule, ctx: PassContext, backends: dict[str, str]) -> None:
    lowered = 0
    for ag in [n for n in gm.graph.nodes if n.target is ALL_GATHER]:
        inp, world, group = ag.args[:3]
        val = ag.meta["val"]
        if not _on_gloo(group, backends):
            continue
        role = ag.meta.get(ROLE)
        with gm.graph.inserting_before(ag):
            shape = _gathered_shape(gm, ag, role)
            buf = insert_call(
                gm, aten.empty.memory_format, (shape,), {"dtype": val.dtype, "device": val.device}, role=role
            )
            out = insert_call(gm, ALL_GATHER_OUT, (inp, world, group), {"out": buf}, role=role)
        if QUANTIZED in ag.meta:
            out.meta[QUANTIZED] = ag.meta[QUANTIZED]
        ag.replace_all_uses_with(out)
        gm.graph.erase_node(ag)
        lowered += 1
    if lowered:
        ctx.report(f"{lowered} all-gathers on gloo gather into graph-allocated buffers (out= form)")


def _gathered_shape(gm: fx.GraphModule, ag: fx.Node, role: Any) -> list[Any]:
    """The all-gather's output shape as ``aten.empty`` arguments: ints where static; a symbolic
    size (an activation gathered under dynamic shapes) read from the input in the graph, so the
    buffer follows every size the graph runs at (see NOTE: symbolic gathers)."""
    inp, world = ag.args[:2]
    shape = size_args(gm, inp, range(inp.meta["val"].dim()), role)
    rows = shape[0]
    shape[0] = rows * world if isinstance(rows, int) else insert_call(gm, operator.mul, (rows, world), role=role)
    return shape


def _lower_reduce_scatters(gm: fx.GraphModule, ctx: PassContext, backends: dict[str, str]) -> None:
    lowered = 0
    for rs in [n for n in gm.graph.nodes if n.target is REDUCE_SCATTER]:
        inp, op, world, group = rs.args[:4]
        if op not in ("sum", "avg") or world < 2:
            continue
        val = inp.meta["val"]
        waits = [u for u in rs.users if u.target is WAIT]
        if not _on_gloo(group, backends) or len(waits) != len(rs.users) or val.shape[0] % world:
            continue
        role = rs.meta.get(ROLE)  # "reduce", or None: a tensor-parallel plan's
        with gm.graph.inserting_before(rs):  # symbolic sizes (dynamic shapes) read in the graph
            rows = rows_arg(gm, inp, world, role)
            splits = [rows] * world
            shape = [world, rows, *size_args(gm, inp, range(1, val.dim()), role)]
            a2a = insert_call(gm, ALL_TO_ALL, (inp, splits, splits, group), role=role)
        a2a.meta[COLLECTIVE] = "reduce_scatter"
        for wait in waits:
            with gm.graph.inserting_after(wait):
                landed = insert_call(gm, WAIT, (a2a,), role=role)
            with gm.graph.inserting_after(landed):
                chunks = insert_call(gm, aten.view.default, (landed, shape), role=role)
            reduced = rank_ordered_sum(gm, chunks, world, op, role)
            wait.replace_all_uses_with(reduced)
            gm.graph.erase_node(wait)
        gm.graph.erase_node(rs)
        lowered += 1
    if lowered:
        ctx.report(f"{lowered} reduce-scatters on gloo lowered to all-to-all + local sum")


def rank_ordered_sum(gm: fx.GraphModule, chunks: fx.Node, world: int, op: str, role: str | None = "reduce") -> fx.Node:
    """``chunks[0] + chunks[1] (+ chunks[2] ...)`` in rank order (divided by ``world`` for "avg"),
    inserted right after ``chunks`` (``[world, ...]``, one chunk per sending rank): the local
    sum of an all-to-all reduce-scatter, the same association on every rank whatever ATen's
    ``sum`` would pick. Returns the result node."""
    reduced = chunks
    for i in range(world):
        with gm.graph.inserting_after(reduced):
            part = insert_call(gm, aten.select.int, (chunks, 0, i), role=role)
        if i == 0:
            reduced = part
            continue
        with gm.graph.inserting_after(part):
            reduced = insert_call(gm, aten.add.Tensor, (reduced, part), role=role)
    if op == "avg":
        with gm.graph.inserting_after(reduced):
            reduced = insert_call(gm, aten.div.Tensor, (reduced, world), role=role)
    return reduced


def _alias_sets(graph: fx.Graph) -> dict[fx.Node, set[fx.Node]]:
    """Each node -> every node whose value may share its buffer. Two relations, closed
    transitively: same fake storage (views, ``getitem`` of a split, ``_unsafe_view``), and
    ``storage_root`` (the cost model's aliasing: waits and ``out=`` ops, which fake tensors do
    not show). Neither alone is enough: a wait's views have the wait's fake storage, not the
    collective's."""
    parent: dict[fx.Node, fx.Node] = {}

    def find(n: fx.Node) -> fx.Node:
        while parent.setdefault(n, n) is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    by_storage: dict[Any, fx.Node] = {}
    for node in graph.nodes:
        vals = node.meta.get("val")
        for val in vals if isinstance(vals, (list, tuple)) else [vals]:
            if isinstance(val, torch.Tensor):
                parent[find(node)] = find(by_storage.setdefault(StorageWeakRef(val.untyped_storage()), node))
        parent[find(node)] = find(storage_root(node))
    groups: dict[fx.Node, set[fx.Node]] = {}
    for node in parent:
        groups.setdefault(find(node), set()).add(node)
    return {node: groups[find(node)] for node in parent}


def _release_buffers(gm: fx.GraphModule, ctx: PassContext, backends: dict[str, str]) -> None:
    graph = gm.graph
    order = positions(graph)
    aliases = _alias_sets(graph)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    done: set[int] = set()
    released = 0
    for wait in [n for n in graph.nodes if n.target is WAIT]:
        coll = wait.args[0]
        if coll.target not in COLLECTIVE_OPS:
            continue
        group = coll.args[COLLECTIVE_OPS[coll.target].group_name_arg]
        if not _on_gloo(group, backends):
            continue
        for buf in (coll.args[0], wait):
            if not isinstance(buf, fx.Node) or id(aliases[buf]) in done:
                continue
            same = aliases[buf]
            done.add(id(same))
            if any(n.op == "placeholder" or n in output.all_input_nodes for n in same):
                continue  # a parameter, an input, or a value the graph hands on
            readers = set(same) | {u for n in same for u in n.users}
            # a collective reading the buffer holds it until its wait
            readers |= {w for r in list(readers) if r.target in COLLECTIVE_OPS for w in r.users}
            last = max(readers, key=order.__getitem__)
            with graph.inserting_after(last):
                free = graph.call_function(RELEASE, (buf, 0))
            free.meta["val"] = None
            free.meta[ROLE] = "release"
            released += 1
    if released:
        ctx.report(f"{released} collective buffers freed by the graph after their last reader")


PASS = Pass(
    "transport",
    transport_pass,
    kinds=("forward", "backward", "inference"),
    reads=(QUANTIZED,),
    writes=(COLLECTIVE, QUANTIZED, ROLE),
)
