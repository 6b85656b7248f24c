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

from torch import fx
from torch._inductor.fx_passes.bucketing import merge_all_gather_bucket, merge_reduce_scatter_bucket

from zerofx.ir.collectives import ALL_GATHER, REDUCE_SCATTER
from zerofx.ir.meta import ROLE
from zerofx.passes.contract import Pass, PassContext
from zerofx.passes.cost_model import tensor_bytes
from zerofx.passes.graph import first_user, hoist_before, wait_of
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
        anchor = min(first_user(wait_of(m)) for m in members)  # fx nodes compare by graph order
        roles = {m.meta.get(ROLE) for m in members}
        new_nodes, _ = merge_all_gather_bucket(
            gm.graph, members, "default", insert_before=first, wait_insertion_point=anchor
        )
        # hpZ's inner re-gathers stay exact (passes/quantize.py skips them)
        role = "secondary_gather" if roles == {"secondary_gather"} else "gather"
        for node in new_nodes:
            node.meta[ROLE] = role
        merged["all_gather"] += len(members)
    for members in choose_buckets(gm, REDUCE_SCATTER, cap, by_block=by_block, ceiling=ceiling):
        last_input = max(m.args[0] for m in members)
        new_nodes, _ = merge_reduce_scatter_bucket(gm.graph, members, "default", insert_before=last_input.next)
        for node in new_nodes:
            node.meta[ROLE] = "reduce"
        merged["reduce_scatter"] += len(members)
    gm.graph.eliminate_dead_code()
    if any(merged.values()):
        ctx.report(
            f"bucket {'target' if by_block else 'cap'} {cap} B{' (whole blocks)' if by_block else ''}"
            f"{f', ceiling {ceiling} B' if ceiling else ''}: merged {merged['all_gather']} all-gathers and "
            f"{merged['reduce_scatter']} reduce-scatters into buckets"
        )
    return gm


PASS = Pass("bucket", bucket_pass, kinds=("forward", "backward", "inference"), reads=(ROLE,), writes=(ROLE,))
