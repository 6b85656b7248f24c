"""reduce: lower each gradient marker into a collective issued as soon as the gradient exists.

``zerofx::reduce_grad`` (a sharded parameter's gradient) becomes a reduce-scatter landing in the
shard. IR produced for a full gradient ``g`` of a parameter with ``R`` rows over ``N`` ranks
(``r = ceil(R / N)``; casts, contiguity copy, pad and slice only appear when needed)::

    c  = prims.convert_element_type(g, reduce_dtype)        # reduce in the chosen dtype
    c  = aten.clone(c, memory_format=contiguous)            # collectives need dense input
    p  = aten.constant_pad_nd(c, [..., 0, r*N - R])
    rs = _c10d_functional.reduce_scatter_tensor(p, "avg", N, group)   # right after g exists
    w  = _c10d_functional.wait_tensor(rs)                   # before the next collective is issued
    gs = aten.slice(w, 0, 0, shard_rows)                    # this rank's rows, no padding
    gs = prims.convert_element_type(gs, master_dtype)       # lands on the fp32 master shard

``zerofx::all_reduce_grad`` (a whole parameter's gradient, or a shard's gradient across the
replicas of a 2-D mesh) becomes ``all_reduce(c, "avg", group)`` with the same casts and waits.

The collective is issued as soon as the gradient is produced, so it runs while the rest of
the backward computes. Its wait is placed before the next collective is issued (or the first
use, if earlier): at most one full-size gradient is kept alive by an in-flight collective,
which bounds memory without a cost model. The schedule pass may do better.

Tied weights: when the backward sums several gradients of the same parameter (one per module
reading it), ``sum(reduce_grad(g_i))`` is rewritten to ``reduce_grad(sum(g_i))`` first, so a tied
weight costs one collective, not one per use. Averaging is linear, so numerics agree to
rounding.
"""

from __future__ import annotations

import torch
from torch import fx

from zerofx.ir.collectives import ALL_REDUCE, REDUCE_SCATTER, WAIT
from zerofx.ir.layout import padded_rows
from zerofx.ir.markers import ALL_REDUCE_GRAD, GRAD_MARKERS, REDUCE_GRAD
from zerofx.ir.meta import ROLE
from zerofx.passes.contract import Pass, PassContext
from zerofx.passes.graph import CONVERT, full_args, insert_call, positions

aten = torch.ops.aten


def _marker_behind(node: object) -> fx.Node | None:
    """The gradient marker feeding ``node`` directly or through a shape-preserving view."""
    if not isinstance(node, fx.Node) or len(node.users) != 1:
        return None
    if node.target in (aten.view.default, aten._unsafe_view.default, aten.alias.default):
        inner = node.args[0]
        if isinstance(inner, fx.Node) and inner.meta["val"].shape == node.meta["val"].shape:
            node = inner
            if len(node.users) != 1:
                return None
    return node if node.target in GRAD_MARKERS else None


def _merge_tied(gm: fx.GraphModule, ctx: PassContext) -> None:
    """add(marker(a), marker(b)) -> marker(add(a, b)) for equal markers and layouts."""
    merged_count = 0
    changed = True
    while changed:
        changed = False
        for node in gm.graph.nodes:
            if node.target is not aten.add.Tensor or len(node.args) != 2 or node.kwargs:
                continue
            a, b = (_marker_behind(x) for x in node.args)
            if a is None or b is None or a.target is not b.target or full_args(a)[1:] != full_args(b)[1:]:
                continue
            if a.args[0].meta["val"].shape != b.args[0].meta["val"].shape:
                continue
            later = max(a.args[0], b.args[0])  # fx nodes compare by graph order
            with gm.graph.inserting_after(later):
                total = insert_call(gm, aten.add.Tensor, (a.args[0], b.args[0]), role="reduce")
            with gm.graph.inserting_after(total):
                merged = insert_call(gm, a.target, (total, *a.args[1:]))
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


def _issue(gm: fx.GraphModule, marker: fx.Node) -> fx.Node:
    """Insert the collective of ``marker`` right after its gradient exists; return the collective."""
    args = full_args(marker)
    grad, group_size, group_name = args[:3]
    reduce_dtype = args[4] if marker.target is REDUCE_GRAD else args[3]
    anchor = grad if grad.op != "placeholder" else _last_placeholder(gm)
    src = grad
    with gm.graph.inserting_after(anchor):
        if reduce_dtype is not None and reduce_dtype != grad.meta["val"].dtype:
            src = insert_call(gm, CONVERT, (src, reduce_dtype), role="reduce")
    with gm.graph.inserting_after(src):
        if not src.meta["val"].is_contiguous():
            src = insert_call(gm, aten.clone.default, (src,), {"memory_format": torch.contiguous_format}, role="reduce")
    with gm.graph.inserting_after(src):
        if marker.target is ALL_REDUCE_GRAD:
            return insert_call(gm, ALL_REDUCE, (src, "avg", group_name), role="reduce")
        full_rows = grad.meta["val"].shape[0]
        rows = padded_rows(full_rows, group_size)
        if rows * group_size != full_rows:
            pad = [0, 0] * (grad.meta["val"].dim() - 1) + [0, rows * group_size - full_rows]
            src = insert_call(gm, aten.constant_pad_nd.default, (src, pad), role="reduce")
    with gm.graph.inserting_after(src):
        return insert_call(gm, REDUCE_SCATTER, (src, "avg", group_size, group_name), role="reduce")


def _finish(gm: fx.GraphModule, collective: fx.Node, marker: fx.Node) -> fx.Node:
    """Wait for ``collective`` at the insertion point and shape its result like ``marker``'s."""
    waited = insert_call(gm, WAIT, (collective,), role="reduce")
    out = waited
    want = marker.meta["val"]
    if marker.target is REDUCE_GRAD and want.shape[0] != waited.meta["val"].shape[0]:
        out = insert_call(gm, aten.slice.Tensor, (out, 0, 0, marker.args[3]), role="reduce")
    if want.dtype != out.meta["val"].dtype:
        out = insert_call(gm, CONVERT, (out, want.dtype), role="reduce")
    return out


def reduce_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Turn "this full gradient must be averaged across ranks" into an early collective."""
    _merge_tied(gm, ctx)
    pending = [(_issue(gm, marker), marker) for marker in [n for n in gm.graph.nodes if n.target in GRAD_MARKERS]]
    if not pending:
        return gm
    order = positions(gm.graph)
    issues = sorted(pending, key=lambda pair: order[pair[0]])
    for i, (collective, marker) in enumerate(issues):
        first_use = min(marker.users, key=order.__getitem__)
        next_issue = issues[i + 1][0] if i + 1 < len(issues) else None
        wait_before = first_use if next_issue is None or order[first_use] < order[next_issue] else next_issue
        with gm.graph.inserting_before(wait_before):
            result = _finish(gm, collective, marker)
        marker.replace_all_uses_with(result)
        gm.graph.erase_node(marker)
    return gm


PASS = Pass("reduce", reduce_pass, kinds=("backward",), reads=(), writes=(ROLE,))
