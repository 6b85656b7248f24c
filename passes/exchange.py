"""exchange: an all-gather over two gloo ranks becomes one all-to-all into the graph's buffer.

After transport, every gloo all-gather is ``all_gather_into_tensor_out(x, N, group, out=buf)``.
ProcessGroupGloo runs that op by gathering into a flat buffer of its own and copying each
rank's chunk out of it into ``buf``: one more ``buf``-sized allocation and two ``buf``-sized
copies per all-gather, on gloo's worker thread, which on a machine whose cores the ranks already
fill takes them from compute (NOTE: pair exchange, zerofx/ir/collectives.py). Over two ranks
an all-gather is an exchange, so where ``N == 2`` this pass writes

    ag = _c10d_functional.all_gather_into_tensor_out(x, 2, group, out=buf)
  as
    ag = zerofx.all_gather_pair_out(x, group, out=buf)

an all-to-all that sends ``x`` (already this rank's rows of ``buf`` when a bucket gathered it)
and receives the peer's rows straight into theirs. The result, its wait, the bytes on the wire
and the buffer frees transport placed are unchanged; the cost model's gloo workspace
(NOTE: collective workspace) is gone with it. Groups of more than two ranks keep the
all-gather: an all-to-all would need this rank's rows once per peer in its input.

Reduce-scatters get the same treatment. transport lowers a gloo reduce-scatter to an all-to-all
of the whole input and a rank-ordered local sum; over two ranks this pass writes

    a = _c10d_functional.all_to_all_single(x, [h, h], [h, h], group);  w = wait_tensor(a)
    v = aten.view(w, [2, h, ...]);  s = v[0] + v[1];  s = aten.div(s, 2)
  as
    buf = aten.empty([h, ...]);  a = zerofx.reduce_scatter_pair_out(x, group, out=buf)
    w = wait_tensor(a);  s = zerofx.pair_sum_(w, x, group, 2)

which moves only the peer's half, receives into a buffer half the size, and sums in place
(NOTE: pair reduce-scatter, zerofx/ir/collectives.py). transport's free of the received chunks
goes (they are the result now); its free of ``x`` stays where it was, after the wait and so
after the sum, which runs right after the wait and reads ``x``.

``disable_passes=("exchange",)`` turns both off (bit for bit the same values). Graphs for
``executor="inductor"`` keep the all-gather, which Inductor lowers as a collective of its own.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from zerofx.ir.collectives import (
    ALL_GATHER_OUT,
    ALL_TO_ALL,
    PAIR_GATHER_OUT,
    PAIR_REDUCE_SCATTER_OUT,
    PAIR_SUM,
    WAIT,
    backend_of,
)
from zerofx.ir.meta import COLLECTIVE, QUANTIZED, ROLE
from zerofx.passes.contract import Pass, PassContext
from zerofx.passes.graph import insert_call, size_args

aten = torch.ops.aten
RELEASE = torch.ops.inductor.resize_storage_bytes_.default


def exchange_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Gloo all-gathers over two ranks -> exchanges into the same buffer."""
    if ctx.options.codegen.executor == "inductor":
        return gm
    backends: dict[str, str] = {}
    rewritten = 0
    for ag in [n for n in gm.graph.nodes if n.target is ALL_GATHER_OUT]:
        x, world, group = ag.args[:3]
        if world != 2:
            continue
        if group not in backends:
            backends[group] = backend_of(group)
        if backends[group] != "gloo":
            continue
        ag.target = PAIR_GATHER_OUT
        ag.args = (x, group)
        rewritten += 1
    if rewritten:
        ctx.report(f"{rewritten} all-gathers over two gloo ranks exchange rows with one all-to-all")
    paired = sum(
        _pair_reduce_scatter(gm, a2a, backends) for a2a in [n for n in gm.graph.nodes if n.target is ALL_TO_ALL]
    )
    if paired:
        ctx.report(f"{paired} reduce-scatters over two gloo ranks send only the peer's half and sum in place")
    return gm


def _local_sum(landed: fx.Node) -> tuple[list[fx.Node], fx.Node, int] | None:
    """transport's local sum after ``landed`` (``rank_ordered_sum`` of two chunks): its nodes, the
    one whose value is the result, and the divisor; None for anything else."""
    users = [u for u in landed.users if u.target is not RELEASE]
    if len(users) != 1 or users[0].target is not aten.view.default:
        return None
    chunks = users[0]
    picks = sorted(chunks.users, key=lambda n: n.args[2] if n.target is aten.select.int else -1)
    if [(n.target, n.args[1:]) for n in picks] != [(aten.select.int, (0, 0)), (aten.select.int, (0, 1))]:
        return None
    total = next(iter(picks[0].users), None)
    if (
        total is None
        or total.target is not aten.add.Tensor
        or total.args != (picks[0], picks[1])
        or len(picks[0].users) != 1
        or len(picks[1].users) != 1
    ):
        return None
    nodes, result, divisor = [chunks, *picks, total], total, 1
    div = next(iter(total.users), None) if len(total.users) == 1 else None
    if div is not None and div.target is aten.div.Tensor and div.args == (total, 2):
        nodes, result, divisor = [*nodes, div], div, 2
    return nodes, result, divisor


def _pair_reduce_scatter(gm: fx.GraphModule, a2a: fx.Node, backends: dict[str, str]) -> bool:
    x, out_splits, in_splits, group = a2a.args[:4]
    if a2a.meta.get(COLLECTIVE) != "reduce_scatter" or QUANTIZED in a2a.meta or len(a2a.users) != 1:
        return False
    val = x.meta["val"]
    if (
        len(in_splits) != 2
        or out_splits != in_splits
        or in_splits[0] is not in_splits[1]
        and in_splits[0] != in_splits[1]
    ):
        return False
    # a split is an int, or (dynamic shapes) the node that reads it in the graph
    split = in_splits[0].meta["val"] if isinstance(in_splits[0], fx.Node) else in_splits[0]
    if not statically_known_true(2 * split == val.shape[0]):
        return False
    if group not in backends:
        backends[group] = backend_of(group)
    if backends[group] != "gloo":
        return False
    (landed,) = a2a.users
    found = _local_sum(landed) if landed.target is WAIT else None
    if found is None:
        return False
    nodes, result, divisor = found
    role = a2a.meta.get(ROLE)
    graph = gm.graph
    with graph.inserting_before(a2a):
        shape = [in_splits[0], *size_args(gm, x, range(1, val.dim()), role)]  # symbolic sizes read in the graph
        buf = insert_call(
            gm,
            aten.empty.memory_format,
            (shape,),
            {"dtype": val.dtype, "device": val.device},
            role=role,
        )
        pair = insert_call(gm, PAIR_REDUCE_SCATTER_OUT, (x, group), {"out": buf}, role=role)
    for key in (COLLECTIVE, "stack_trace", "nn_module_stack"):
        if key in a2a.meta:
            pair.meta[key] = a2a.meta[key]
    landed.args = (pair,)
    landed.meta["val"] = pair.meta["val"]
    # right after the wait: transport frees ``x`` after that wait or later, so after the sum too
    with graph.inserting_after(landed):
        summed = insert_call(gm, PAIR_SUM, (landed, x, group, divisor), role=role)
    result.replace_all_uses_with(summed)
    for node in reversed(nodes):
        graph.erase_node(node)
    for release in [u for u in landed.users if u.target is RELEASE]:
        graph.erase_node(release)  # the received half is the result now
    graph.erase_node(a2a)
    return True


PASS = Pass(
    "exchange",
    exchange_pass,
    kinds=("forward", "backward", "inference"),
    reads=(COLLECTIVE, QUANTIZED, ROLE),
    writes=(COLLECTIVE, ROLE),
)
