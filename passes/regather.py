"""free: a gathered parameter lives from its gather to its last forward use, and no longer.

In the forward, the executor drops every value after its last use, so a gathered parameter is
freed as soon as the last op reading it has run. What remains is the partitioner: left alone,
AOTAutograd's min-cut partitioner happily saves the full weight for the backward (it is an
input of ``mm`` backward), which would keep every gathered parameter alive from forward to
backward: ZeRO-3 would hold the whole model unsharded at the peak. This pass marks the gather
chain — each ``zerofx::unshard`` marker and the pure views and layout copies of its output — as MUST_RECOMPUTE in
the joint graph, so the backward re-runs the marker (a re-gather) wherever it needs the weight
and the forward saves only shards and activations. The markers of values a rank holds whole
(``read_full``, ``sync_grad``, ``local_grad``: stages 1 and 2, small parameters, no-sync
micro-batches) are tagged the same way: re-running them costs nothing once lowered, and saving
their results would save a second copy of a whole parameter.

Selective unsharding (``Options.keep_gathered_bytes``, DeepCompile's idea) is the one
exception, decided here with the cost model: within that budget, some gathered parameters are
marked MUST_SAVE instead and skip their backward re-gather.

``check_no_gathered_saved`` asserts the result on the partitioned forward graph: none of the
values it saves for backward is a gathered parameter or a view of one. Values *computed from*
a gathered parameter and data (``x @ w.T``) are activations and are of course allowed.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from zerofx.errors import ZeroFXError
from zerofx.ir.collectives import wire_bytes
from zerofx.ir.markers import FORWARD_MARKERS, UNSHARD
from zerofx.ir.meta import RECOMPUTE, ROLE
from zerofx.passes.contract import Pass, PassContext
from zerofx.passes.cost_model import CostModel, saved_values, tensor_bytes
from zerofx.passes.graph import is_view

aten = torch.ops.aten


def _same_values(node: fx.Node) -> bool:
    """A view, or a layout copy (``aten.clone``: a parameter split along another dim than 0 is
    gathered with that dim first and copied to its own layout, zerofx/ir/layout.py NOTE: the
    sharded dim): the gathered parameter itself, re-run in the backward rather than saved."""
    return is_view(node) or (node.op == "call_function" and node.target is aten.clone.default)


def gather_chain(graph: fx.Graph) -> list[fx.Node]:
    """Every forward marker (``unshard`` and the markers of whole values) and every view or
    layout copy reachable from one only through views and layout copies."""
    chain: list[fx.Node] = []
    in_chain: set[fx.Node] = set()
    for node in graph.nodes:  # topological order: producers come first
        if node.target in FORWARD_MARKERS or (_same_values(node) and node.args and node.args[0] in in_chain):
            chain.append(node)
            in_chain.add(node)
    return chain


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes of the joint graph that depend on a tangent: the backward half."""
    seen: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
            i in seen for i in node.all_input_nodes
        ):
            seen.add(node)
    return seen


def chain_of(marker: fx.Node) -> list[fx.Node]:
    chain, stack = [], [marker]
    while stack:
        n = stack.pop()
        chain.append(n)
        stack.extend(u for u in n.users if _same_values(u))
    return chain


def choose_kept(graph: fx.Graph, budget: int, cost: CostModel) -> list[fx.Node]:
    """Selective unsharding: markers whose gathered value stays alive until the backward.

    Only markers the backward reads are candidates (the others are never re-gathered). Each
    saves one re-gather; its price is the gathered bytes held from forward to backward. Taken
    greedily by communication time saved per byte held (small parameters first: their
    collectives are latency-bound), while the total fits ``budget``.
    """
    if budget <= 0:
        return []
    backward = backward_nodes(graph)
    candidates = []
    for marker in (n for n in graph.nodes if n.target is UNSHARD and n not in backward):
        if any(u in backward for n in chain_of(marker) for u in n.users):
            nbytes = tensor_bytes(marker.meta["val"])
            group_size = marker.args[1]
            saved_s = cost.comm.time(wire_bytes("all_gather", nbytes, group_size))
            candidates.append((-saved_s / max(nbytes, 1), marker.name, marker, nbytes))
    kept, used = [], 0
    for _, _, marker, nbytes in sorted(candidates):
        if used + nbytes <= budget:
            kept.append(marker)
            used += nbytes
    return kept


def regather_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Make the backward re-gather parameters instead of saving the gathered ones."""
    budget = ctx.options.comm.keep_gathered_bytes
    kept = choose_kept(gm.graph, budget, ctx.cost)
    kept_nodes = {n for marker in kept for n in chain_of(marker)}
    chain = gather_chain(gm.graph)
    for node in chain:
        keep = node in kept_nodes
        node.meta[RECOMPUTE] = CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.MUST_RECOMPUTE
        node.meta[ROLE] = "kept_gather" if keep else "gather"
    if chain:
        gathers = sum(1 for n in chain if n.target is UNSHARD)
        others = sum(1 for n in chain if n.target in FORWARD_MARKERS) - gathers
        views = len(chain) - gathers - others
        whole = f", {others} markers of whole values" if others else ""
        ctx.report(f"tagged MUST_RECOMPUTE: {gathers - len(kept)} unshard markers{whole} and {views} views of them")
    if kept:
        held = sum(tensor_bytes(m.meta["val"]) for m in kept)
        ctx.report(
            f"selective unsharding: kept {len(kept)} gathered parameters for backward, {held} B "
            f"(budget {budget} B): {', '.join(m.name for m in kept)}"
        )
    return gm


def check_no_gathered_saved(fw_gm: fx.GraphModule, num_fwd_outputs: int, graph_id: str) -> None:
    """Raise if the partitioned forward saves a gathered parameter (or a view or layout copy of
    one). Selective unsharding's kept gathers and hpZ's secondary partitions (a copy of this
    rank's rows, passes/secondary.py) are saved on purpose."""
    chain = {n for n in gather_chain(fw_gm.graph) if n.meta.get(ROLE) not in ("kept_gather", "secondary")}
    bad = [n.name for n in saved_values(fw_gm, num_fwd_outputs) if n in chain]
    if bad:
        raise ZeroFXError(
            f"{graph_id}: the forward saves gathered parameters for backward ({', '.join(bad)}); "
            "this would keep full weights alive between forward and backward. "
            "Please report this graph (ZEROFX_DUMP=<dir>)."
        )


PASS = Pass("regather", regather_pass, kinds=("joint",), reads=(), writes=(RECOMPUTE, ROLE))
