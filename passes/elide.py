"""elide: write results where they are going instead of allocating and copying them there.

Two patterns the lowering leaves in every bucketed graph, each one buffer-sized allocation and
one pass over memory more than the values need:

* an all-gather bucket's input (passes/bucket.py, the same nodes as torch's
  ``merge_all_gather_bucket``): the shards are concatenated into a new buffer, which is then
  copied into this rank's rows of the gathered output (the collective gathers in place)::

      c = aten.cat([s0, s1, ...]);  x = aten.copy_(rows, c)
    becomes
      x = aten.cat.out([s0, s1, ...], out=rows)

* the local sum of a gloo reduce-scatter (passes/transport.py): ``s = add(c0, c1)``, then
  ``avg``'s ``div(s, N)`` into another new buffer; the division now runs in place on ``s``
  (``div_``), which nothing else reads.

Same arithmetic in the same order, so the same bits; only an allocation and a copy less.
``disable_passes=("elide",)`` turns it off. Graphs for ``executor="inductor"`` are left alone:
Inductor re-traces them and plans their buffers itself (and lowers no ``out=`` ops).
"""

from __future__ import annotations

import torch
from torch import fx

from zerofx.ir.meta import ROLE
from zerofx.passes.contract import Pass, PassContext
from zerofx.passes.graph import positions

aten = torch.ops.aten


def _cat_into_rows(gm: fx.GraphModule) -> int:
    done = 0
    order = positions(gm.graph)
    for copy in [n for n in gm.graph.nodes if n.target is aten.copy_.default]:
        rows, cat = copy.args[:2]
        if (
            not isinstance(cat, fx.Node)
            or cat.target is not aten.cat.default
            or len(cat.users) != 1
            or not isinstance(rows, fx.Node)
            or rows.target is not aten.slice.Tensor
            or copy.kwargs
        ):
            continue
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        cat_val, rows_val = cat.meta.get("val"), rows.meta.get("val")
        if (
            cat_val is None
            or rows_val is None
            or dim != 0
            or cat_val.dim() != 1
            or tuple(cat_val.shape) != tuple(rows_val.shape)
            or cat_val.dtype != rows_val.dtype
            or not rows_val.is_contiguous()
        ):
            continue
        if order[rows] > order[cat]:  # the rows must exist where the concatenation runs
            continue
        with gm.graph.inserting_before(cat):
            out = gm.graph.call_function(aten.cat.out, (cat.args[0],), {"dim": 0, "out": rows})
        out.meta = dict(copy.meta)
        copy.replace_all_uses_with(out)
        gm.graph.erase_node(copy)
        gm.graph.erase_node(cat)
        done += 1
    return done


def _divide_in_place(gm: fx.GraphModule) -> int:
    done = 0
    for div in [n for n in gm.graph.nodes if n.target is aten.div.Tensor]:
        total = div.args[0]
        if (
            not isinstance(total, fx.Node)
            or total.target is not aten.add.Tensor
            or len(total.users) != 1
            or total.meta.get(ROLE) != "reduce"
            or div.meta.get(ROLE) != "reduce"
            or isinstance(div.args[1], fx.Node)
        ):
            continue
        div.target = aten.div_.Tensor
        done += 1
    return done


def elide_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Concatenate bucket inputs into the gathered buffer's rows; divide local sums in place."""
    if ctx.options.codegen.executor == "inductor":
        return gm
    cats = _cat_into_rows(gm)
    divs = _divide_in_place(gm)
    if cats or divs:
        ctx.report(
            f"{cats} bucket inputs concatenated into their all-gather's rows (one copy each, not two); "
            f"{divs} local-sum averages divided in place"
        )
    return gm


PASS = Pass("elide", elide_pass, kinds=("forward", "backward", "inference"), reads=(ROLE,), writes=())
