"""reduce: lower each ``zerofx::reduce_grad`` marker into a reduce-scatter landing in the shard.

IR produced for a full gradient ``g`` of a parameter with ``R`` rows over ``N`` ranks
(``r = ceil(R / N)``; contiguity copy, pad and slice only appear when needed)::

    c  = aten.clone(g, memory_format=contiguous)            # collectives need dense input
    p  = aten.constant_pad_nd(c, [..., 0, r*N - R])
    rs = _c10d_functional.reduce_scatter_tensor(p, "avg", N, group)   # right after g exists
    w  = _c10d_functional.wait_tensor(rs)                   # before the next reduce-scatter
    gs = aten.slice(w, 0, 0, shard_rows)                    # this rank's rows, no padding

The reduce-scatter is issued as soon as the gradient is produced, so it runs while the rest
of the backward computes. Its wait is placed before the next reduce-scatter is issued (or the
first use, if earlier): at most one full-size gradient is kept alive by an in-flight
collective, which bounds memory without a cost model. The schedule pass may do better.

Tied weights: when the backward sums several gradients of the same shard (one per module
reading it), ``sum(reduce_grad(g_i))`` is rewritten to ``reduce_grad(sum(g_i))`` first, so a tied
weight costs one reduce-scatter, not one per use. Averaging is linear, so numerics agree to
rounding.
"""

from __future__ import annotations

import torch
from torch import fx

from zerofx.ops import REDUCE_GRAD, padded_rows
from zerofx.passes.fx_nodes import REDUCE_SCATTER, WAIT, insert_call
from zerofx.passes.pipeline import PassContext

aten = torch.ops.aten


def _marker_behind(node: object) -> fx.Node | None:
    """The reduce_grad marker feeding ``node`` directly or through a shape-preserving view."""
    if not isinstance(node, fx.Node) or len(node.users) != 1:
        return None
    if node.target in (aten.view.default, aten._unsafe_view.default, aten.alias.default):
        inner = node.args[0]
        if isinstance(inner, fx.Node) and inner.meta["val"].shape == node.meta["val"].shape:
            node = inner
            if len(node.users) != 1:
                return None
    return node if node.target is REDUCE_GRAD else None


def _merge_tied(gm: fx.GraphModule, ctx: PassContext) -> None:
    """add(reduce_grad(a), reduce_grad(b)) -> reduce_grad(add(a, b)) for equal layouts."""
    merged_count = 0
    changed = True
    while changed:
        changed = False
        for node in gm.graph.nodes:
            if node.target is not aten.add.Tensor or len(node.args) != 2 or node.kwargs:
                continue
            a, b = (_marker_behind(x) for x in node.args)
            if a is None or b is None or a.args[1:] != b.args[1:]:
                continue
            if a.args[0].meta["val"].shape != b.args[0].meta["val"].shape:
                continue
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            later = max(a.args[0], b.args[0], key=order.__getitem__)
            with gm.graph.inserting_after(later):
                total = insert_call(gm, aten.add.Tensor, (a.args[0], b.args[0]), role="reduce")
            with gm.graph.inserting_after(total):
                merged = insert_call(gm, REDUCE_GRAD, (total, *a.args[1:]))
            node.replace_all_uses_with(merged)
            dead = [node, *(x for x in node.args if x not in (a, b)), a, b]
            for d in dead:
                gm.graph.erase_node(d)
            merged_count += 1
            changed = True
            break
    if merged_count:
        ctx.report(f"merged {merged_count} gradient sum(s) of tied parameters before reduce-scatter")


def _last_placeholder(gm: fx.GraphModule) -> fx.Node:
    return [n for n in gm.graph.nodes if n.op == "placeholder"][-1]


def reduce_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Turn "this full gradient belongs to that shard" into an early, averaged reduce-scatter."""
    _merge_tied(gm, ctx)
    pending_waits: list[tuple[fx.Node, fx.Node]] = []  # (collective, marker it replaces)
    for marker in [n for n in gm.graph.nodes if n.target is REDUCE_GRAD]:
        grad, group_size, group_name, shard_rows = marker.args
        full_rows = grad.meta["val"].shape[0]
        rows = padded_rows(full_rows, group_size)
        anchor = grad if grad.op != "placeholder" else _last_placeholder(gm)
        with gm.graph.inserting_after(anchor):
            src = grad
            if not grad.meta["val"].is_contiguous():
                src = insert_call(gm, aten.clone.default, (src,), {"memory_format": torch.contiguous_format},
                                  role="reduce")
        with gm.graph.inserting_after(src):
            if rows * group_size != full_rows:
                pad = [0, 0] * (grad.meta["val"].dim() - 1) + [0, rows * group_size - full_rows]
                src = insert_call(gm, aten.constant_pad_nd.default, (src, pad), role="reduce")
        with gm.graph.inserting_after(src):
            reduced = insert_call(gm, REDUCE_SCATTER, (src, "avg", group_size, group_name), role="reduce")
        pending_waits.append((reduced, marker))

    if not pending_waits:
        return gm
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    issues = sorted(pending_waits, key=lambda pair: order[pair[0]])
    for i, (reduced, marker) in enumerate(issues):
        first_use = min(marker.users, key=order.__getitem__)
        next_issue = issues[i + 1][0] if i + 1 < len(issues) else None
        wait_before = first_use if next_issue is None or order[first_use] < order[next_issue] else next_issue
        with gm.graph.inserting_before(wait_before):
            waited = insert_call(gm, WAIT, (reduced,), role="reduce")
            shard_grad = waited
            if marker.meta["val"].shape[0] != waited.meta["val"].shape[0]:
                shard_grad = insert_call(gm, aten.slice.Tensor, (waited, 0, 0, marker.args[3]), role="reduce")
        marker.replace_all_uses_with(shard_grad)
        gm.graph.erase_node(marker)
    return gm
