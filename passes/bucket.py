"""bucket: merge neighbouring all-gathers (and reduce-scatters) into one collective per bucket.

Every collective pays a fixed latency (measured on this machine's gloo: ~0.25 ms per call
whatever the size, next to ~1 ns per byte), and a transformer has many small parameters
(norm weights, biases). Merging collectives until a bucket reaches ``Options.bucket_bytes``
(default: the cost model's bandwidth-saturating size, four latencies' worth of bytes) pays the
latency once per bucket.

Buckets are consecutive collectives of one kind, group and dtype, in graph order, so every
rank builds the same buckets in the same order, and the values a parameter receives do not
change (merging only moves bytes; the reductions are the same elementwise averages).

The graph surgery (flat copy-in, one collective, split and copy-out) is PyTorch's own,
``torch._inductor.fx_passes.bucketing.merge_*_bucket``; zerofx decides which collectives form
a bucket and where the merged collective is issued and waited:

* all-gather buckets are issued where the first member was and waited where the first
  member's result was first needed (later members are gathered early: that is the cost, and
  why the cap exists);
* reduce-scatter buckets are issued when the last member's gradient exists and waited at
  once; the schedule pass moves waits later.
"""

from __future__ import annotations

import torch
from torch import fx
from torch._inductor.fx_passes.bucketing import merge_all_gather_bucket, merge_reduce_scatter_bucket

from zerofx.passes.cost_model import CostModel, tensor_bytes
from zerofx.passes.fx_nodes import ALL_GATHER, REDUCE_SCATTER, first_user
from zerofx.passes.graph_moves import hoist_before, positions
from zerofx.passes.pipeline import PassContext


def _key(node: fx.Node) -> tuple:
    val = node.meta["val"]
    if node.target is ALL_GATHER:
        return ("ag", node.args[1], node.args[2], val.dtype)
    return ("rs", node.args[1], node.args[2], node.args[3], val.dtype)


def _size(node: fx.Node) -> int:
    return tensor_bytes(node.meta["val"] if node.target is ALL_GATHER else node.args[0].meta["val"])


def choose_buckets(gm: fx.GraphModule, target, cap: int) -> list[list[fx.Node]]:
    """Greedy, in graph order: consecutive same-key collectives until ``cap`` bytes."""
    buckets: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    size = 0
    for node in gm.graph.nodes:
        if node.target is not target or len(node.users) != 1:
            continue
        if current and (_key(node) != _key(current[0]) or size + _size(node) > cap):
            buckets.append(current)
            current, size = [], 0
        current.append(node)
        size += _size(node)
    if current:
        buckets.append(current)
    return [b for b in buckets if len(b) > 1]


def _wait_of(node: fx.Node) -> fx.Node:
    return next(iter(node.users))


def resolve_bucket_bytes(ctx: PassContext) -> int:
    options = ctx.options
    setting = getattr(options, "bucket_bytes", "auto") if options is not None else "auto"
    cost = getattr(options, "cost_model", None) or CostModel()
    return cost.comm.saturating_bytes if setting == "auto" else int(setting)


def bucket_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Pay collective latency once per bucket instead of once per parameter."""
    cap = resolve_bucket_bytes(ctx)
    if cap <= 0:
        return gm
    merged = {"all_gather": 0, "reduce_scatter": 0}
    for members in choose_buckets(gm, ALL_GATHER, cap):
        first = members[0]
        # later members' inputs (views/pads of shards) must exist where the bucket is issued
        if not all(hoist_before(m.args[0], first) for m in members[1:]):
            continue
        order = positions(gm.graph)
        anchor = min((first_user(_wait_of(m)) for m in members), key=order.__getitem__)
        merge_all_gather_bucket(gm.graph, members, "default", insert_before=first, wait_insertion_point=anchor)
        merged["all_gather"] += len(members)
    for members in choose_buckets(gm, REDUCE_SCATTER, cap):
        order = positions(gm.graph)
        last_input = max((m.args[0] for m in members), key=order.__getitem__)
        merge_reduce_scatter_bucket(gm.graph, members, "default", insert_before=last_input.next)
        merged["reduce_scatter"] += len(members)
    gm.graph.eliminate_dead_code()
    if any(merged.values()):
        ctx.report(f"bucket cap {cap} B: merged {merged['all_gather']} all-gathers and "
                   f"{merged['reduce_scatter']} reduce-scatters into buckets")
    return gm
