"""schedule: hide communication behind compute, within a memory budget.

* all-gathers are issued early (prefetch): each moves up, past compute, until the cost model
  says the compute between its issue and its wait covers its transfer time, or until the next
  step would cross another collective, a node it depends on, or the memory budget;
* reduce-scatter waits move down, past compute, until the transfer is covered or the result
  is needed.

Only the collectives zerofx inserted move (role ``gather`` / ``reduce``); any other (a
tensor-parallel plan's, traced from DTensor) is a fixed point, like every collective, for the
moves: collectives never cross each other, so every rank issues them in the same order whatever
its estimates (uneven shards give ranks slightly different graphs); only the compute between
them moves. The budget (``Options.prefetch_bytes``) bounds the growth of the graph's estimated
peak memory (cost_model.estimate_memory) that the moves may cause; "auto" allows one largest
gathered bucket: one block prefetched, as FSDP2 does (why one: docs/measurements.md, schedule).
"""

from __future__ import annotations

from torch import fx

from zerofx.ir.collectives import COLLECTIVE_OPS, WAIT
from zerofx.ir.meta import ROLE
from zerofx.passes.contract import Pass, PassContext
from zerofx.passes.cost_model import CostModel, DeviceModel, NodeFacts, PeakProbe, estimate_memory, tensor_bytes
from zerofx.passes.graph import first_user, hoist_before, wait_of

_GATHERS = {op for op, spec in COLLECTIVE_OPS.items() if spec.kind == "all_gather"}
_OWN = ("gather", "secondary_gather", "reduce")  # roles of the collectives zerofx inserted


def _own(node: fx.Node) -> bool:
    return node.meta.get(ROLE) in _OWN


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def resolve_budget(ctx: PassContext, gm: fx.GraphModule) -> int:
    setting = ctx.options.comm.prefetch_bytes
    if setting != "auto":
        return int(setting)
    gathered = [tensor_bytes(n.meta["val"]) for n in gm.graph.nodes if n.target in _GATHERS and _own(n)]
    return max(gathered, default=0)


def _compute_between(start: fx.Node, stop: fx.Node, device: DeviceModel) -> float:
    total, n = 0.0, start.next
    while n is not stop and n.op != "output":
        total += device.node_time(n)
        n = n.next
    return total


def _prefetch(
    gm: fx.GraphModule, cost: CostModel, device: DeviceModel, budget: int, base_peak: int, facts: NodeFacts
) -> int:
    moved = 0
    for coll in [n for n in gm.graph.nodes if n.target in _GATHERS and _own(n)]:
        wait = wait_of(coll)
        if wait is None:
            continue
        needed = cost.comm.node_time(coll)
        hidden = _compute_between(coll, wait, device)
        deps = _ancestors(coll)
        candidates: list[fx.Node] = []  # successively earlier issue points
        node = coll.prev
        while hidden < needed and node.op != "root":
            if node.op == "placeholder" or node.target in COLLECTIVE_OPS or node.target is WAIT:
                break
            if node not in deps:
                hidden += device.node_time(node)
                candidates.append(node)
            node = node.prev
        # the furthest point that keeps the estimated peak within budget (binary search)
        lo, hi, best = 0, len(candidates) - 1, None
        original_next = coll.next
        # every try permutes nodes between the furthest point tried yet and the collective
        # only: the probe simulates that stretch, not the whole graph (cost_model.PeakProbe)
        probe = PeakProbe(gm, facts) if candidates else None
        first = probe.index[coll] if probe else 0
        while lo <= hi:
            mid = (lo + hi) // 2
            if not hoist_before(coll, candidates[mid]):
                hi = mid - 1
                continue
            first = min(first, probe.index[candidates[mid]])
            ok = probe.peak_bytes(first, probe.index[coll] - first + 1) - base_peak <= budget
            original_next.prepend(coll)  # undo (inputs hoisted with it stay early: harmless)
            if ok:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        if best is not None and hoist_before(coll, candidates[best]):
            moved += 1
    return moved


def _defer_waits(
    gm: fx.GraphModule, cost: CostModel, device: DeviceModel, budget: int, base_peak: int, facts: NodeFacts
) -> int:
    moved = 0
    for coll in [n for n in gm.graph.nodes if n.target in COLLECTIVE_OPS and n.target not in _GATHERS and _own(n)]:
        wait = wait_of(coll)
        if wait is None:
            continue
        first_use = first_user(wait)
        needed = cost.comm.node_time(coll) - _compute_between(coll, wait, device)
        target, hidden, node = None, 0.0, wait.next
        while node is not first_use and node.op != "output" and hidden < needed:
            hidden += device.node_time(node)
            node = node.next
            target = node
        if target is None:
            continue
        original_next = wait.next
        target.prepend(wait)
        if estimate_memory(gm, facts=facts).peak_bytes - base_peak > budget:
            original_next.prepend(wait)
        else:
            moved += 1
    return moved


def schedule_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Overlap collectives with compute, as far as the cost model says it helps and memory allows."""
    if not any(n.target in COLLECTIVE_OPS for n in gm.graph.nodes):
        return gm
    cost = ctx.cost
    budget = resolve_budget(ctx, gm)
    facts = NodeFacts.of(gm)  # the moves below reorder nodes, never change them
    before = estimate_memory(gm, facts=facts)
    device = cost.device_for(gm)
    prefetched = _prefetch(gm, cost, device, budget, before.peak_bytes, facts)
    deferred = _defer_waits(gm, cost, device, budget, before.peak_bytes, facts)
    after = estimate_memory(gm, facts=facts)
    ctx.report(
        f"prefetched {prefetched} all-gathers, deferred {deferred} reduce-scatter waits; "
        f"estimated peak {before.peak_bytes} -> {after.peak_bytes} B (budget +{budget} B)"
    )
    return gm


PASS = Pass("schedule", schedule_pass, kinds=("forward", "backward", "inference"), reads=(ROLE,), writes=())
