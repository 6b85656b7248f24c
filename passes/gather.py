"""gather: make each parameter's full value available where the forward markers ask for it.

``unshard`` becomes an asynchronous all-gather and its wait. IR produced, for a shard ``s`` of a
parameter with ``R`` rows over ``N`` ranks (``r = ceil(R / N)``; the cast only appears with
mixed precision, the pad and the slice only when ``N`` does not divide ``R``)::

    c  = prims.convert_element_type(s, bf16)                    # cast BEFORE the gather: half the bytes
    p  = aten.constant_pad_nd(c, [..., 0, r - s.rows])          # equal-sized all-gather input
    ag = _c10d_functional.all_gather_into_tensor(p, N, group)   # issued where the marker was
    w  = _c10d_functional.wait_tensor(ag)                       # just before the first use
    full = aten.slice(w, 0, 0, R)                               # drop the padding (a view)

The other forward markers need no communication in the forward, only in their backward (which
the reduce pass lowers): ``read_full(shard, full)`` becomes ``full`` (stages 1 and 2 keep the
whole parameter), ``sync_grad(x)`` becomes ``x`` or its cast (whole parameters), and
``local_grad(x, sink)`` becomes ``x``. Their eager implementations copy because custom ops may
not return an input; once lowered, no copy is made.

Markers that read the same value with the same layout in one graph (a tied weight read by two
modules) become one. The schedule pass moves issue and wait to overlap compute; here the issue
sits where the parameter is first needed, which keeps peak memory minimal.
"""

from __future__ import annotations

import torch
from torch import fx

from zerofx.errors import ZeroFXError
from zerofx.ir.collectives import ALL_GATHER, WAIT
from zerofx.ir.layout import padded_rows
from zerofx.ir.markers import FORWARD_MARKERS, LOCAL_GRAD, READ_FULL, UNSHARD
from zerofx.ir.meta import ROLE
from zerofx.passes.contract import Pass, PassContext
from zerofx.passes.graph import CONVERT, first_user, full_args, insert_call

aten = torch.ops.aten


def _dedupe_markers(gm: fx.GraphModule) -> None:
    seen: dict[tuple, fx.Node] = {}
    for node in list(gm.graph.nodes):  # producers first, so a deduped input makes its users equal
        if node.target not in FORWARD_MARKERS:
            continue
        key = (node.target, *full_args(node))
        if key in seen:
            node.replace_all_uses_with(seen[key])
            gm.graph.erase_node(node)
        else:
            seen[key] = node


def _replace(gm: fx.GraphModule, marker: fx.Node, value: fx.Node) -> None:
    """Use ``value`` for ``marker``; a graph output keeps its own copy (outputs must not alias inputs)."""
    marker.replace_all_uses_with(value, delete_user_cb=lambda user: user.op != "output" or value.op != "placeholder")
    if marker.users:  # returned as a graph output while ``value`` is a graph input
        with gm.graph.inserting_before(marker):
            copy = insert_call(gm, aten.clone.default, (value,), role="gather")
        marker.replace_all_uses_with(copy)
    gm.graph.erase_node(marker)


def _check_static_layout(marker: fx.Node, shard: fx.Node, group_size: object, full_rows: object) -> None:
    """Refuse an unshard whose layout is not a set of ints: a parameter's layout is static
    (docs/architecture.md, Dynamic shapes), and the markers carry it as Python ints
    (zerofx/runtime/params.py, NOTE: static layouts in a frame of their own). A graph value here
    (a size symbol dynamo traced) would fail in the padding arithmetic below with a bare TypeError."""
    symbolic = [
        what
        for what, value in (
            ("row count", full_rows),
            ("group size", group_size),
            ("shard's rows", shard.meta["val"].shape[0]),
        )
        if type(value) is not int
    ]
    if not symbolic:
        return
    stack = list((marker.meta.get("nn_module_stack") or {}).values())  # (path, class), outermost first
    module = stack[-1][0] if stack and isinstance(stack[-1], tuple) else None
    where = f"read in module {module!r}" if module else "(the graph records no module for it)"
    raise ZeroFXError(
        f"zerofx.unshard ({marker.name}, shard {shard.name}) of a sharded parameter {where}: its "
        f"{' and '.join(symbolic)} reached the gather pass "
        "as graph values (size symbols of dynamic shapes), but a parameter's layout must be static ints. "
        "Compile with static shapes to work around it (zerofx.compile(model, mesh, dynamic=False)), and "
        "report it: zerofx's markers should carry the layout as Python ints"
    )


def _lower_unshard(gm: fx.GraphModule, marker: fx.Node) -> None:
    shard, group_size, group_name, full_rows, compute_dtype = full_args(marker)[:5]
    _check_static_layout(marker, shard, group_size, full_rows)
    rows = padded_rows(full_rows, group_size)
    shard_rows = shard.meta["val"].shape[0]
    # hpZ's backward re-gather of a secondary shard (passes/secondary.py) keeps its own role
    role = "secondary_gather" if marker.meta.get(ROLE) == "secondary_gather" else "gather"
    # the module the parameter was read in: graph inputs carry none, and the bucket and
    # checkpoint passes group a gather by the block it serves (passes/modules.py, module_block)
    stack = marker.meta.get("nn_module_stack")

    def call(target, args: tuple) -> fx.Node:
        node = insert_call(gm, target, args, role=role)
        if stack:
            node.meta["nn_module_stack"] = stack
        return node

    with gm.graph.inserting_before(marker):
        src = shard
        if compute_dtype is not None and compute_dtype != shard.meta["val"].dtype:
            src = call(CONVERT, (src, compute_dtype))
        if shard_rows < rows:
            pad = [0, 0] * (shard.meta["val"].dim() - 1) + [0, rows - shard_rows]
            src = call(aten.constant_pad_nd.default, (src, pad))
        gathered = call(ALL_GATHER, (src, group_size, group_name))
    with gm.graph.inserting_before(first_user(marker)):
        waited = call(WAIT, (gathered,))
        full = waited
        if rows * group_size != full_rows:
            full = call(aten.slice.Tensor, (waited, 0, 0, full_rows))
    marker.replace_all_uses_with(full)
    gm.graph.erase_node(marker)


def _lower_identity(gm: fx.GraphModule, marker: fx.Node) -> None:
    args = full_args(marker)
    if marker.target is READ_FULL:
        _replace(gm, marker, args[1])
    elif marker.target is LOCAL_GRAD:
        _replace(gm, marker, args[0])
    else:  # SYNC_GRAD(x, group_size, group_name, compute_dtype, reduce_dtype)
        x, compute_dtype = args[0], args[3]
        if compute_dtype is not None and compute_dtype != x.meta["val"].dtype:
            with gm.graph.inserting_before(marker):
                x = insert_call(gm, CONVERT, (x, compute_dtype), role="gather")
        _replace(gm, marker, x)


def gather_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Turn "this parameter is needed whole here" into an all-gather the scheduler can move, or
    into nothing where the rank holds the whole value already."""
    _dedupe_markers(gm)
    identities = 0
    for marker in [n for n in gm.graph.nodes if n.target in FORWARD_MARKERS]:
        if marker.target is UNSHARD:
            _lower_unshard(gm, marker)
        else:
            _lower_identity(gm, marker)
            identities += 1
    if identities:
        ctx.report(f"{identities} markers of whole values (read_full/sync_grad/local_grad) need no gather")
    return gm


PASS = Pass("gather", gather_pass, kinds=("forward", "backward", "inference"), reads=(ROLE,), writes=(ROLE,))
