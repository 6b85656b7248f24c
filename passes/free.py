"""free: a gathered parameter lives from its gather to its last forward use, and no longer.

In the forward, the executor drops every value after its last use, so a gathered parameter is
freed as soon as the last op reading it has run. What remains is the partitioner: left alone,
AOTAutograd's min-cut partitioner happily saves the full weight for the backward (it is an
input of ``mm`` backward), which would keep every gathered parameter alive from forward to
backward: ZeRO-3 would hold the whole model unsharded at the peak. This pass marks the gather
chain — each ``zerofx::unshard`` marker and the pure views of its output — as MUST_RECOMPUTE in
the joint graph, so the backward re-runs the marker (a re-gather) wherever it needs the weight
and the forward saves only shards and activations.

``check_no_gathered_saved`` asserts the result on the partitioned forward graph: none of the
values it saves for backward is a gathered parameter or a view of one. Values *computed from*
a gathered parameter and data (``x @ w.T``) are activations and are of course allowed.
"""

from __future__ import annotations

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from zerofx.errors import ZeroFXError
from zerofx.ops import UNSHARD
from zerofx.passes.cost_model import saved_values
from zerofx.passes.fx_nodes import is_view
from zerofx.passes.pipeline import PassContext


def gather_chain(graph: fx.Graph) -> list[fx.Node]:
    """Every ``unshard`` marker and every view reachable from one only through views."""
    chain: list[fx.Node] = []
    in_chain: set[fx.Node] = set()
    for node in graph.nodes:  # topological order: producers come first
        if node.target is UNSHARD or (is_view(node) and node.args and node.args[0] in in_chain):
            chain.append(node)
            in_chain.add(node)
    return chain


def free_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Make the backward re-gather parameters instead of saving the gathered ones."""
    chain = gather_chain(gm.graph)
    for node in chain:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["zerofx_role"] = "gather"
    if chain:
        markers = sum(1 for n in chain if n.target is UNSHARD)
        ctx.report(f"tagged MUST_RECOMPUTE: {markers} unshard markers and {len(chain) - markers} views of them")
    return gm


def check_no_gathered_saved(fw_gm: fx.GraphModule, num_fwd_outputs: int, graph_id: str) -> None:
    """Raise if the partitioned forward saves a gathered parameter (or a view of one)."""
    chain = set(gather_chain(fw_gm.graph))
    bad = [n.name for n in saved_values(fw_gm, num_fwd_outputs) if n in chain]
    if bad:
        raise ZeroFXError(
            f"{graph_id}: the forward saves gathered parameters for backward ({', '.join(bad)}); "
            "this would keep full weights alive between forward and backward. "
            "Please report this graph (ZEROFX_DUMP=<dir>)."
        )
