"""gather: lower each ``zerofx::unshard`` marker into an asynchronous all-gather and its wait.

IR produced, for a shard ``s`` of a parameter with ``R`` rows over ``N`` ranks
(``r = ceil(R / N)``; the pad and the slice only appear when ``N`` does not divide ``R``)::

    p  = aten.constant_pad_nd(s, [..., 0, r - s.rows])          # equal-sized all-gather input
    ag = _c10d_functional.all_gather_into_tensor(p, N, group)   # issued where the marker was
    w  = _c10d_functional.wait_tensor(ag)                       # just before the first use
    full = aten.slice(w, 0, 0, R)                               # drop the padding (a view)

Markers that gather the same shard with the same layout in one graph (a tied weight read by
two modules) become one gather. The schedule pass moves issue and wait to overlap compute;
here the issue sits where the parameter is first needed, which keeps peak memory minimal.
"""

from __future__ import annotations

import torch
from torch import fx

from zerofx.ops import UNSHARD, padded_rows
from zerofx.passes.fx_nodes import ALL_GATHER, WAIT, first_user, insert_call
from zerofx.passes.pipeline import PassContext

aten = torch.ops.aten


def _dedupe_markers(gm: fx.GraphModule) -> None:
    seen: dict[tuple, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.target is not UNSHARD:
            continue
        key = tuple(node.args)
        if key in seen:
            node.replace_all_uses_with(seen[key])
            gm.graph.erase_node(node)
        else:
            seen[key] = node


def gather_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Turn "this shard is needed whole here" into a real all-gather the scheduler can move."""
    _dedupe_markers(gm)
    for marker in [n for n in gm.graph.nodes if n.target is UNSHARD]:
        shard, group_size, group_name, full_rows = marker.args
        rows = padded_rows(full_rows, group_size)
        shard_rows = shard.meta["val"].shape[0]
        with gm.graph.inserting_before(marker):
            src = shard
            if shard_rows < rows:
                pad = [0, 0] * (shard.meta["val"].dim() - 1) + [0, rows - shard_rows]
                src = insert_call(gm, aten.constant_pad_nd.default, (shard, pad), role="gather")
            gathered = insert_call(gm, ALL_GATHER, (src, group_size, group_name), role="gather")
        with gm.graph.inserting_before(first_user(marker)):
            waited = insert_call(gm, WAIT, (gathered,), role="gather")
            full = waited
            if rows * group_size != full_rows:
                full = insert_call(gm, aten.slice.Tensor, (waited, 0, 0, full_rows), role="gather")
        marker.replace_all_uses_with(full)
        gm.graph.erase_node(marker)
    return gm
