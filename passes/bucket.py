"""bucket: merge neighbouring all-gathers (and reduce-scatters) into one collective per bucket.

Every collective pays a fixed latency (the cost model's ``CommModel.latency_s``, measured by
``calibrate_comm``), and a transformer has many small parameters
(norm weights, biases). Merging collectives pays the latency once per bucket.

How big a bucket grows (``Options.bucket_bytes``; "auto" by default):

* an explicit byte count is a hard cap: neighbours merge while the bucket stays within it;
* "auto" buckets whole transformer blocks (the outermost indexed module, ``blocks.3``: the
  unit FSDP2 users wrap with ``fully_shard``; parameters outside every block form one unit per
  top-level module). A bucket takes the next block until it has reached the cost model's
  bandwidth-saturating size (four latencies' worth of bytes: ~1 MB with the default
  constants), so small blocks are gathered a few at a time and a large block is gathered
  alone, in one collective, whatever its size. A size cap cannot tell "one more parameter of
  this layer" from "the next layer, a whole layer early"; blocks can (docs/measurements.md,
  bucket);
* ``host_memory_cap`` bounds "auto": gathered buckets are model state in host memory (on a CPU
  device), with up to two in flight (one waited, one prefetched) and each briefly held twice
  (flat buffer and per-parameter copies), so no bucket grows past a sixteenth of the cap (a
  block larger than that is split).

The block of a collective comes from the module stack dynamo records (``module_block``); every
quantity the decision reads (graph structure, gathered and full-gradient sizes) is the same on
every rank even when shards are uneven, so all ranks build the same buckets without talking.

Only the collectives zerofx inserted (role ``gather`` or ``reduce``) are merged: a
tensor-parallel plan's collectives, traced from DTensor, stay as they are.

Buckets are consecutive collectives of one kind, group and dtype, in graph order, so every
rank builds the same buckets in the same order, and the values a parameter receives do not
change (merging only moves bytes; the reductions are the same elementwise averages).

The graph surgery (flat copy-in, one collective, split and copy-out) writes the same nodes
PyTorch's ``torch._inductor.fx_passes.bucketing.merge_*_bucket`` writes (NOTE: bucket surgery),
and falls back to those functions for what it does not cover; zerofx decides which collectives
form a bucket and where the merged collective is issued and waited:

* all-gather buckets are issued where the first member was and waited where the first
  member's result was first needed (later members are gathered early: that is the cost, and
  why the cap exists);
* reduce-scatter buckets are issued when the last member's gradient exists and waited at
  once; the schedule pass moves waits later.

# NOTE: bucket surgery
torch's ``merge_all_gather_bucket`` / ``merge_reduce_scatter_bucket`` trace a merge function
with ``make_fx`` for every bucket, copy the traced nodes in, then record on every new node the
module stacks and stack traces of every member (new nodes x members) and re-run the fake
values of the replaced waits' users. On deep models that was the largest part of zerofx's
compile (docs/measurements.md, "bucket: compile time of the surgery"). ``_merge_gathers`` and
``_merge_reduce_scatters`` insert the same ops with the same arguments directly, each with its
fake value (``insert_call``): the flat copy-in (``reshape`` as ATen decomposes it: a ``view``
with the requested shape where the strides allow one, else a contiguous ``clone`` and an
``_unsafe_view``), the collective and its wait, the split and the copy-out. Every new node
carries the first member's module stack, stack trace and ``custom`` metadata, as torch's do.
The final graphs are the same node for node (tests/test_passes.py compares them with torch's
surgery's on the same graphs). Where the direct path does not apply (a member whose input is a
dtype cast torch folds into the bucket's copy-in, symbolic sizes, a process group given as a
graph value, an output whose layout would differ from the wait it replaces), torch's functions
do the surgery.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.distributed as dist
from torch import fx
from torch._inductor.fx_passes import bucketing as _torch_bucketing
from torch._inductor.fx_passes.bucketing import (
    has_mergeable_all_gather_convert_dtype,
    merge_all_gather_bucket,
    merge_reduce_scatter_bucket,
)
from torch.distributed.distributed_c10d import _resolve_process_group

from zerofx.ir.collectives import ALL_GATHER, ALL_GATHER_OUT, REDUCE_SCATTER, WAIT
from zerofx.ir.meta import BUCKET_SEGMENTS, ROLE
from zerofx.passes.contract import Pass, PassContext
from zerofx.passes.cost_model import tensor_bytes
from zerofx.passes.graph import first_user, hoist_before, insert_call, wait_of
from zerofx.passes.modules import module_block

# the roles of the collectives zerofx inserted (gather, reduce passes): only those are merged;
# any other (a tensor-parallel plan's, traced from DTensor) stays as it is, where it is
_OWN = ("gather", "secondary_gather", "reduce")


def _key(node: fx.Node) -> tuple:
    val = node.meta["val"]
    if node.target is ALL_GATHER:
        return ("ag", node.args[1], node.args[2], val.dtype)
    return ("rs", node.args[1], node.args[2], node.args[3], val.dtype)


def _size(node: fx.Node) -> int:
    return tensor_bytes(node.meta["val"] if node.target is ALL_GATHER else node.args[0].meta["val"])


def _units(nodes: list[fx.Node], by_block: bool, ceiling: int | None) -> list[list[fx.Node]]:
    """Split collectives (graph order) into units no bucket divides: with ``by_block``, each
    maximal run of same-key collectives from one block (cut where it would exceed ``ceiling``);
    otherwise every collective alone."""
    units: list[list[fx.Node]] = []
    last_block, unit_size = None, 0
    for node in nodes:
        block = module_block(node) if by_block else None
        if (
            units
            and block is not None
            and block == last_block
            and _key(node) == _key(units[-1][0])
            and (ceiling is None or unit_size + _size(node) <= ceiling)
        ):
            units[-1].append(node)
            unit_size += _size(node)
        else:
            units.append([node])
            unit_size = _size(node)
        last_block = block
    return units


def choose_buckets(
    gm: fx.GraphModule, target, cap: int, *, by_block: bool = False, ceiling: int | None = None
) -> list[list[fx.Node]]:
    """Buckets of consecutive same-key collectives, in graph order.

    With a fixed cap (``by_block=False``), a bucket takes collectives while it stays within
    ``cap`` bytes. With ``by_block``, it takes whole blocks (``_units``) and closes once it has
    reached ``cap`` (so blocks smaller than the saturating size are gathered a few at a time,
    and a larger block is one bucket), never growing past ``ceiling``."""
    nodes = [
        n
        for n in gm.graph.nodes
        if n.target is target and n.meta.get(ROLE) in _OWN and len(n.users) == 1 and wait_of(n) is not None
    ]
    buckets: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    size = 0
    for unit in _units(nodes, by_block, ceiling):
        unit_size = sum(map(_size, unit))
        if by_block:
            full = size >= cap or (ceiling is not None and size + unit_size > ceiling)
        else:
            full = size + unit_size > cap
        if current and (_key(unit[0]) != _key(current[0]) or full):
            buckets.append(current)
            current, size = [], 0
        current.extend(unit)
        size += unit_size
    if current:
        buckets.append(current)
    return [b for b in buckets if len(b) > 1]


aten = torch.ops.aten
# the metadata torch's bucketing copies from a bucket's first member onto every node it adds
_INHERITED = (("nn_module_stack", ""), ("fwd_nn_module_stack", ""), ("stack_trace", ""), ("custom", {}))
# torch's own reordering after a bucket is inserted (a member's wait may have users before
# the merged reduce-scatter, which must move after it): the same call keeps the graphs the same
_sort_region = getattr(_torch_bucketing, "_sort_bucket_region", None)


class _Builder:
    """Inserts a bucket's nodes at the graph's current insertion point, remembering them (in
    order) so that a bucket the direct path cannot finish is taken out again."""

    def __init__(self, gm: fx.GraphModule, role: str):
        self.gm, self.role, self.nodes = gm, role, []

    def call(self, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
        node = insert_call(self.gm, target, args, kwargs, role=self.role)
        self.nodes.append(node)
        return node

    def reshape(self, x: fx.Node, shape: list[int]) -> fx.Node:
        """``x.reshape(shape)`` as ATen decomposes it (aten::reshape, CompositeImplicit): a view
        with ``shape`` itself where the strides allow one, else a contiguous copy and an
        ``_unsafe_view`` to the inferred shape."""
        val = x.meta["val"]
        if _viewable(val, shape):
            return self.call(aten.view.default, (x, shape))
        copy = self.call(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
        known = math.prod(d for d in shape if d != -1)
        return self.call(aten._unsafe_view.default, (copy, [val.numel() // known if d == -1 else d for d in shape]))

    def contiguous_reshape(self, x: fx.Node, shape: list[int]) -> fx.Node:
        """``x.contiguous().reshape(shape)``: a view of a contiguous ``x``, else a copy. What a
        member's gathered result must be: the collective it replaces returned a fresh contiguous
        tensor, and the graph after it was traced on those strides (a reshape of a column of the
        gathered grid is a strided view where each rank holds one row)."""
        if x.meta["val"].is_contiguous():
            return self.call(aten.view.default, (x, shape))
        copy = self.call(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
        return self.call(aten._unsafe_view.default, (copy, shape))

    def undo(self) -> None:
        for node in reversed(self.nodes):
            self.gm.graph.erase_node(node)


def _viewable(val: torch.Tensor, shape: list[int]) -> bool:
    """Whether ``val`` (static sizes) can be viewed as ``shape``: ATen's own stride check, on a
    meta tensor of the same layout (asking the fake tensor costs a trace and an exception)."""
    if val.is_contiguous():
        return True
    probe = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
    try:
        probe.view(shape)
    except (RuntimeError, ValueError):  # the meta kernel raises ValueError (torch._refs)
        return False
    return True


def _direct_inputs(members: list[fx.Node], group, insert_before: fx.Node) -> list[torch.Tensor] | None:
    """The fake values of the members' inputs where the direct surgery applies (NOTE: bucket
    surgery): a group named by a string, inputs before ``insert_before`` with static sizes and
    the collectives' dtype and device. None otherwise."""
    inputs = [m.args[0] for m in members]
    if _sort_region is None or not isinstance(group, str):
        return None
    if not all(isinstance(i, fx.Node) and i < insert_before for i in inputs):
        return None
    vals = [i.meta["val"] for i in inputs]
    dtype, device = members[0].meta["val"].dtype, vals[0].device
    static = all(isinstance(d, int) for v in vals for d in (*v.shape, *v.stride()))
    if not static or any(v.dtype != dtype or v.device != device for v in vals):
        return None
    return vals


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and a.stride() == b.stride()


def _finish(
    gm: fx.GraphModule, members: list[fx.Node], inputs: list[fx.Node], build: _Builder, outs: list[fx.Node]
) -> list[fx.Node] | None:
    """Replace each member's wait by its output in ``outs``, erase the members and put the
    users of the outputs after them, as torch's surgery does; None (and nothing changed) when
    an output's layout differs from the wait's (its users' fake values would go stale: torch's
    path re-runs them)."""
    waits = [wait_of(m) for m in members]
    if not all(_same_layout(o.meta["val"], w.meta["val"]) for o, w in zip(outs, waits)):
        build.undo()
        return None
    for key, default in _INHERITED:
        value = members[0].meta.get(key, default)
        for node in build.nodes:
            node.meta[key] = value
    for member, wait, out in zip(members, waits, outs):
        wait.replace_all_uses_with(out)
        gm.graph.erase_node(wait)
        gm.graph.erase_node(member)
    _sort_region(gm.graph, build.nodes, inputs)
    return build.nodes


def _merge_gathers(
    gm: fx.GraphModule, members: list[fx.Node], role: str, *, insert_before: fx.Node, wait_before: fx.Node
) -> list[fx.Node] | None:
    """One all-gather for ``members`` (NOTE: bucket surgery): a flat buffer of every rank's
    rows, this rank's rows copied in, gathered, each member's result copied out of it. Issued
    just before ``insert_before``, waited just before ``wait_before``. Returns the new nodes;
    None, with the graph unchanged, where torch's surgery must do it."""
    _, world, group = members[0].args
    inputs = [m.args[0] for m in members]
    vals = _direct_inputs(members, group, insert_before)
    if vals is None or any(has_mergeable_all_gather_convert_dtype(m) for m in members):
        return None
    dtype, device = vals[0].dtype, vals[0].device
    numels = [v.numel() for v in vals]
    total = sum(numels)
    rank = dist.get_rank(_resolve_process_group(group))
    build = _Builder(gm, role)
    with gm.graph.inserting_before(insert_before):
        out = build.call(
            aten.empty.memory_format, ([total * world],), {"dtype": dtype, "device": device, "pin_memory": False}
        )
        rows = build.call(aten.slice.Tensor, (out, 0, total * rank, total * rank + total))
        flat = [build.reshape(i, [-1]) for i in inputs]
        cat = build.call(aten.cat.default, (flat,))
        mine = build.call(aten.copy_.default, (rows, cat))
        gathered = build.call(ALL_GATHER_OUT, (mine, world, group), {"out": out})
    with gm.graph.inserting_before(wait_before):
        wait = build.call(WAIT, (gathered,))
        grid = build.reshape(wait, [world, -1])
        split = build.call(aten.split_with_sizes.default, (grid, numels, 1))
        parts = [build.call(operator.getitem, (split, k)) for k in range(len(members))]
        outs = [build.contiguous_reshape(p, [v.shape[0] * world, *v.shape[1:]]) for p, v in zip(parts, vals)]
    return _finish(gm, members, inputs, build, outs)


def _merge_reduce_scatters(
    gm: fx.GraphModule, members: list[fx.Node], role: str, *, insert_before: fx.Node
) -> list[fx.Node] | None:
    """One reduce-scatter for ``members`` (NOTE: bucket surgery): every member's gradient as
    ``[world, -1]`` rows, concatenated along the rows (rank ``r``'s chunk of every member is
    row ``r``), reduced and scattered, each member's shard split out of the result. Inserted
    just before ``insert_before``. None, with the graph unchanged, where torch's surgery must do
    it."""
    _, op, world, group = members[0].args
    inputs = [m.args[0] for m in members]
    vals = _direct_inputs(members, group, insert_before)
    if vals is None:
        return None
    shapes = [[v.shape[0] // world, *v.shape[1:]] for v in vals]
    numels = [v.numel() // world for v in vals]
    build = _Builder(gm, role)
    with gm.graph.inserting_before(insert_before):
        rows = [build.reshape(i, [world, -1]) for i in inputs]
        cat = build.call(aten.cat.default, (rows, 1))
        whole = build.reshape(cat, [cat.meta["val"].numel()])
        scattered = build.call(REDUCE_SCATTER, (whole, op, world, group))
        wait = build.call(WAIT, (scattered,))
        split = build.call(aten.split_with_sizes.default, (wait, numels))
        parts = [build.call(operator.getitem, (split, k)) for k in range(len(members))]
        outs = [build.reshape(p, shape) for p, shape in zip(parts, shapes)]
    return _finish(gm, members, inputs, build, outs)


def _segments(members: list[fx.Node], world: int) -> list[int] | None:
    """Each member's values in one rank's row of the merged collective (its input's, over the
    ``world`` rows a reduce-scatter cuts it into), for the quantize pass (BUCKET_SEGMENTS); None
    where a size is symbolic, and such members stay apart when that direction is quantized."""
    numels = [m.args[0].meta["val"].numel() for m in members]
    if not all(isinstance(n, int) for n in numels) or not isinstance(world, int):
        return None
    return [n // world for n in numels]


def resolve_bucket_bytes(ctx: PassContext) -> tuple[int, bool, int | None]:
    """(size cap, whether one block's collectives may merge past it, ceiling on any bucket)."""
    setting = ctx.options.comm.bucket_bytes
    if setting != "auto":
        return int(setting), False, None
    host_cap = ctx.options.memory.host_memory_cap
    ceiling = host_cap // 16 if host_cap else None
    cap = ctx.cost.comm.saturating_bytes
    return (cap if ceiling is None else min(cap, ceiling)), True, ceiling


def bucket_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Pay collective latency once per bucket instead of once per parameter."""
    cap, by_block, ceiling = resolve_bucket_bytes(ctx)
    if cap <= 0:
        return gm
    merged = {"all_gather": 0, "reduce_scatter": 0}
    for members in choose_buckets(gm, ALL_GATHER, cap, by_block=by_block, ceiling=ceiling):
        first = members[0]
        # later members' inputs (views/pads of shards) must exist where the bucket is issued
        if not all(hoist_before(m.args[0], first) for m in members[1:]):
            continue
        segments = _segments(members, 1)
        if segments is None and ctx.options.comm.quantize_weights:
            continue  # ZeRO++ would cut its blocks across members it cannot tell apart: one each
        anchor = min(first_user(wait_of(m)) for m in members)  # fx nodes compare by graph order
        roles = {m.meta.get(ROLE) for m in members}
        # hpZ's inner re-gathers stay exact (passes/quantize.py skips them)
        role = "secondary_gather" if roles == {"secondary_gather"} else "gather"
        new_nodes = _merge_gathers(gm, members, role, insert_before=first, wait_before=anchor)
        if new_nodes is None:
            new_nodes, _ = merge_all_gather_bucket(
                gm.graph, members, "default", insert_before=first, wait_insertion_point=anchor
            )
        for node in new_nodes:
            node.meta[ROLE] = role
            if node.target in (ALL_GATHER, ALL_GATHER_OUT) and segments:
                node.meta[BUCKET_SEGMENTS] = segments
        merged["all_gather"] += len(members)
    for members in choose_buckets(gm, REDUCE_SCATTER, cap, by_block=by_block, ceiling=ceiling):
        last_input = max(m.args[0] for m in members)
        segments = _segments(members, members[0].args[2])
        if segments is None and ctx.options.comm.quantize_grads:
            continue
        new_nodes = _merge_reduce_scatters(gm, members, "reduce", insert_before=last_input.next)
        if new_nodes is None:
            new_nodes, _ = merge_reduce_scatter_bucket(gm.graph, members, "default", insert_before=last_input.next)
        for node in new_nodes:
            node.meta[ROLE] = "reduce"
            if node.target is REDUCE_SCATTER and segments:
                node.meta[BUCKET_SEGMENTS] = segments
        merged["reduce_scatter"] += len(members)
    gm.graph.eliminate_dead_code()
    if any(merged.values()):
        ctx.report(
            f"bucket {'target' if by_block else 'cap'} {cap} B{' (whole blocks)' if by_block else ''}"
            f"{f', ceiling {ceiling} B' if ceiling else ''}: merged {merged['all_gather']} all-gathers and "
            f"{merged['reduce_scatter']} reduce-scatters into buckets"
        )
    return gm


PASS = Pass(
    "bucket", bucket_pass, kinds=("forward", "backward", "inference"), reads=(ROLE,), writes=(BUCKET_SEGMENTS, ROLE)
)
