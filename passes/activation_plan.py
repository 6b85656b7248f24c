"""Which forward values the backward gets saved, recomputed or reloaded from an offload tier.

``plan_activations`` decides, for one joint forward+backward graph, the cheapest way to give the
backward every forward value it reads while keeping the bytes resident between forward and
backward under a budget. The checkpoint pass turns the plan into the partitioner's tags
(MUST_SAVE / MUST_RECOMPUTE) and offload marks; the partitioner then cuts exactly there.

# NOTE: one min-cut prices memory, recompute and offload together
The graph is torch's rematerialization network (``min_cut_rematerialization_partition``): every
forward node ``v`` becomes an edge ``v_in -> v_out``; data edges and "the backward needs this"
edges have infinite capacity; a finite cut is a valid partition whose cut edges are the saved
values. torch weights each cut edge by bytes and bans expensive ops from recompute by
heuristics; here the objective is explicit, with one price ``λ`` (bytes per FLOP):

    source -> v_in    capacity λ·flops(v)     paid when v lands on the backward side (recomputed)
    v_in -> v_out     capacity bytes(v)       paid when v is saved and stays resident
                      or λ·offload_cost(v)    ... when saved but parked in host memory / on disk
                                              (the cheaper of the two is what the cut pays)

so a minimum cut minimizes ``resident bytes + λ·(recompute FLOPs + exposed transfer time)``.
Large ``λ`` recomputes nothing that costs FLOPs (the unconstrained plan, 100%); ``λ -> 0`` keeps
the fewest bytes any schedule can (the minimum feasible budget). Resident bytes fall as ``λ``
falls (a Lagrangian property), so a budget is met by bisecting ``λ`` for the largest price
whose plan fits. The result is optimal among plans on the lower convex hull of the
(bytes, cost) trade-off; a plan strictly inside the hull could be cheaper for a budget that
falls between two hull points, which is why the budget test compares against torch's own
knapsack-based solver (benchmarks/checkpoint_vs_torch.py).

Values that cannot be recomputed (graph inputs, random ops, collectives that are not part of a
parameter's gather chain, mutations, ops reading an input the forward overwrites, unknown
custom ops, values a policy marks MUST_SAVE) are
attached to the source; values that cannot be saved (views: their base is saved instead; tuples;
symbolic floats) have an infinite save edge. Gathered parameters carry MUST_RECOMPUTE from the
regather pass, so the plan always re-gathers them.

# NOTE: offload cost
Offloading ``v`` copies it out after its last forward use and back before its first backward
use. The cost model prices the part of each copy that cannot hide behind compute:
``max(0, t - window)`` per direction, with ``t = latency + bytes / tier bandwidth`` and the window
the compute (FLOPs / device rate) between the last forward use and the end of the forward, or
between the start of the backward and the first backward use, in the joint graph's order. A
copy that hides completely still costs one FLOP-equivalent, so nothing is offloaded without a
reason: under a budget, ``λ`` decides; without one, every saved value whose copies hide
completely is offloaded ("free" memory).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Iterable

import networkx as nx
import torch
from networkx.algorithms.flow import boykov_kolmogorov
from torch import fx
from torch._functorch.partitioners import NodeInfo, _must_be_in_forward, classify_nodes, is_sym_node
from torch._library.fake_class_registry import FakeScriptObject
from torch.fx.experimental._backward_state import BackwardState
from torch.utils.checkpoint import CheckpointPolicy

from zerofx.errors import ZeroFXError
from zerofx.ir.collectives import WAIT
from zerofx.ir.meta import RECOMPUTE
from zerofx.passes.cost_model import DeviceModel, is_alias, node_bytes, node_flops, storage_bytes, storage_key
from zerofx.passes.graph import positions

__all__ = ["ActivationPlan", "PlanProblem", "plan_activations", "cannot_recompute"]


def cannot_recompute(node: fx.Node) -> str | None:
    """Why the backward may not recompute ``node`` (None: it may)."""
    if node.op == "placeholder":
        return "graph input"
    if node.op == "get_attr":
        return None  # a module attribute (a torch.cond branch's graph): the backward reads it again
    if node.op != "call_function":
        return f"{node.op} node"
    if node.meta.get(RECOMPUTE) == CheckpointPolicy.MUST_SAVE and not is_alias(node):
        return "marked MUST_SAVE"  # a view cannot be saved itself: its base is (see _policy_constraints)
    target = node.target
    if target is operator.getitem:  # one output of a multi-output op: recomputable where the op is
        parent = node.args[0] if node.args else None
        why = cannot_recompute(parent) if isinstance(parent, fx.Node) and parent.op == "call_function" else None
        return f"{why}: output of {parent.name}" if why is not None else None
    if is_sym_node(node):
        return None
    if not isinstance(target, torch._ops.OpOverload):
        return "higher-order or Python op"
    if torch.Tag.nondeterministic_seeded in target.tags and not _dropout_free(node):
        return "random op (recomputing would draw new numbers)"
    if target._schema.is_mutable or _must_be_in_forward(node):
        return "mutates its input"
    if target.namespace in ("_c10d_functional", "c10d_functional"):
        return "collective"
    overwritten = _overwritten_input(node)
    if overwritten is not None:
        return f"reads graph input {overwritten.name}, which the forward overwrites"
    if target.namespace not in ("aten", "prims") and node.meta.get(RECOMPUTE) != CheckpointPolicy.MUST_RECOMPUTE:
        return f"custom op {target.namespace}::{target._schema.name.split('::')[-1]}"
    return None


def _overwritten_input(node: fx.Node) -> fx.Node | None:
    """The graph input ``node`` reads (directly or through views) that the forward writes in
    place (an input mutation: AOTAutograd keeps it as ``copy_(primal, new)`` in the graph), if
    any. The backward runs after that write, so an op recomputed there would read the new value
    (``x.mul_(s)`` then a matmul of x: recomputing the product scaled x twice); its output is
    saved instead."""
    for arg in node.all_input_nodes:
        if _only_updated(node, arg):
            continue
        while arg.op == "call_function" and is_alias(arg) and arg.args and isinstance(arg.args[0], fx.Node):
            arg = arg.args[0]
        if arg.op == "placeholder" and any(_writes_first_arg(user, arg) for user in arg.users):
            return arg
    return None


def _only_updated(node: fx.Node, arg: fx.Node) -> bool:
    """Whether ``arg`` feeds only outputs of ``node`` that the backward never reads: batch norm in
    training reads its running statistics only to return their update (outputs 3 and 4, which
    the forward copies into the buffers); its normalized output and batch statistics do not
    depend on them, so a recompute from overwritten buffers is still exact."""
    if node.target is not torch.ops.aten._native_batch_norm_legit_functional.default:
        return False
    training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training")
    return bool(training) and arg in node.args[3:5] and arg not in node.args[:3]


def _writes_first_arg(user: fx.Node, target: fx.Node) -> bool:
    op = user.target
    return (
        user.op == "call_function"
        and isinstance(op, torch._ops.OpOverload)
        and op._schema.is_mutable
        and bool(user.args)
        and user.args[0] is target
        and bool(op._schema.arguments)
        and op._schema.arguments[0].is_write
    )


def _static_shape(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and all(isinstance(d, int) for d in (*val.shape, *val.stride()))


def _dropout_free(node: fx.Node) -> bool:
    """Ops tagged random only for an optional dropout (attention) are deterministic at p = 0."""
    schema = node.target._schema
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p":
            value = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", arg.default_value)
            return value == 0.0
    return False


def _cannot_save(node: fx.Node) -> str | None:
    if is_sym_node(node):
        return None if isinstance(node.meta.get("val"), torch.SymInt) else "symbolic float/bool"
    if is_alias(node) and node.target is not WAIT:
        # a collective's wait (a tensor-parallel plan's, traced from DTensor) is the memory model's
        # alias of the collective's buffer, but the value the backward can be handed: neither the
        # wait nor the collective may be recomputed, so a region's reader of a gathered
        # activation needs the wait's output saved
        return "view (its base is saved instead)"
    val = node.meta.get("val")
    if isinstance(val, (FakeScriptObject, torch.ScriptObject, BackwardState)):
        return None  # opaque objects (e.g. a process group) are handed over as they are, for free
    if not isinstance(val, torch.Tensor):
        return "not a tensor"
    return None


@dataclass
class ActivationPlan:
    """What the backward of one joint graph gets, and what that costs (bytes at size hints)."""

    saved: list[fx.Node]  # kept resident between forward and backward
    offloaded: dict[fx.Node, str]  # saved, parked in a tier ("host" / "disk") meanwhile
    recomputed: list[fx.Node]  # forward nodes the backward runs again
    resident_bytes: int
    offloaded_bytes: int
    recompute_flops: int
    price: float  # λ of the plan (bytes per FLOP)
    backward_side: frozenset = frozenset()  # the cut's backward side (what the plan would recompute)

    def names(self) -> dict[str, list[str]]:
        """Node names per decision; saved sizes (SymInts) and opaque objects are listed apart."""
        tensor = lambda n: isinstance(n.meta.get("val"), torch.Tensor)  # noqa: E731
        return {
            "saved": [n.name for n in self.saved if tensor(n)],
            "offloaded": [n.name for n in self.offloaded],
            "recomputed": [n.name for n in self.recomputed],
            "saved_other": [n.name for n in self.saved if not tensor(n)],
        }


class PlanProblem:
    """One joint graph, its constraints and its costs: ``solve(λ)`` returns the plan at price λ.

    ``info``: torch's ``classify_nodes(joint, [], num_fwd_outputs)``, where the caller has it
    already (it walks the whole joint graph)."""

    def __init__(
        self,
        joint: fx.GraphModule,
        num_fwd_outputs: int,
        *,
        must_recompute: Iterable[fx.Node] = (),
        must_save: Iterable[fx.Node] = (),
        offload_tier: str | None = None,
        device: DeviceModel | None = None,
        info: NodeInfo | None = None,
    ):
        self.joint = joint
        self.info = info if info is not None else classify_nodes(joint, [], num_fwd_outputs)
        self.must_recompute = set(must_recompute)
        reasons = must_save if isinstance(must_save, dict) else {}
        self.must_save = {n: reasons.get(n, "policy: always saved") for n in must_save if n not in self.must_recompute}
        self.offload_tier = offload_tier
        self.device = device or DeviceModel()
        self.nodes = [n for n in joint.graph.nodes if n.op != "output"]
        self.order = positions(joint.graph)
        self.input_keys = {storage_key(n) for n in self.nodes if n.op == "placeholder"}
        self.flops = {n: node_flops(n) for n in self.nodes}
        self.bytes = {n: node_bytes(n) for n in self.nodes}
        self.ban = {}
        for n in self.nodes:
            reason = self.must_save[n] if n in self.must_save else cannot_recompute(n)
            if n in self.must_recompute:
                reason = None
            if reason is not None:
                self.ban[n] = reason
        self.no_save = {n: r for n in self.nodes if (r := _cannot_save(n)) is not None}
        self.keys = {n: storage_key(n) for n in self.nodes}
        self._save_bytes = {n: self._compute_save_bytes(n) for n in self.nodes}
        self.inputs = {n: n.all_input_nodes for n in self.nodes}
        # the forward values the backward reads directly (walks in _account start here)
        closure = self.info.tangents_closure
        reads = {a: None for n in self.nodes if n in closure for a in n.all_input_nodes if a not in closure}
        reads.update((n, None) for n in self.nodes if n in self.info.required_bw_nodes and n not in closure)
        self.backward_reads = list(reads)
        self.offload_cost = self._offload_costs() if offload_tier else {}

    def why_kept(self, node: fx.Node) -> str | None:
        """Why ``node`` cannot be recomputed (a getitem answers for the op it unpacks), or None."""
        if node in self.ban:
            return self.ban[node]
        parent = node.args[0] if node.target is operator.getitem and node.args else None
        if isinstance(parent, fx.Node) and parent in self.ban:
            return f"{self.ban[parent]}: output of {parent.name}"
        return None

    # -- costs ---------------------------------------------------------------------------------
    def save_bytes(self, node: fx.Node) -> int:
        """Resident bytes of saving ``node``: nothing when it lives in an input's buffer."""
        return self._save_bytes[node]

    def _compute_save_bytes(self, node: fx.Node) -> int:
        if node.op == "placeholder" or self.keys[node] in self.input_keys:
            return 0
        if is_sym_node(node):
            return 8
        return storage_bytes(node)

    def is_backward(self, node: fx.Node) -> bool:
        return node in self.info.tangents_closure

    def _offload_costs(self) -> dict[fx.Node, float]:
        """FLOP-equivalents of the transfer time that cannot hide (see NOTE: offload cost)."""
        fw = [n for n in self.nodes if self.info.is_required_fw(n)]
        bw = [n for n in self.nodes if self.is_backward(n)]
        fw_after, acc = {}, 0
        for n in reversed(fw):  # compute that runs after n in the forward
            fw_after[n] = acc
            acc += self.flops[n]
        bw_before, acc = {}, 0
        for n in bw:  # compute that runs before n in the backward
            bw_before[n] = acc
            acc += self.flops[n]
        device, tier = self.device, self.offload_tier
        costs = {}
        for n in fw:
            if n in self.no_save or self.save_bytes(n) == 0 or is_sym_node(n) or not _static_shape(n):
                continue  # the reload needs static sizes: values with symbolic shapes stay resident
            fw_users = [u for u in n.users if u in fw_after]
            bw_users = [u for u in n.users if u in bw_before]
            window_out = device.compute_s(min((fw_after[u] for u in fw_users), default=fw_after[n]))
            window_in = device.compute_s(min((bw_before[u] for u in bw_users), default=0))
            t = device.transfer_s(self.bytes[n], tier)
            exposed = max(0.0, t - window_out) + max(0.0, t - window_in)
            costs[n] = 1.0 + exposed * device.flops_per_s
        return costs

    # -- the cut -------------------------------------------------------------------------------
    def _network(self, price: float) -> nx.DiGraph:
        g = nx.DiGraph()
        info = self.info
        for n in self.nodes:
            i, o = n.name + "_in", n.name + "_out"
            if n in info.required_bw_nodes:
                if n not in info.tangents_closure:
                    g.add_edge(o, "sink", capacity=math.inf)
                else:
                    g.add_edge(i, "sink", capacity=math.inf)
                    continue
            if n in self.must_recompute:
                g.add_edge(i, "sink", capacity=math.inf)
                continue
            if n in self.ban:
                g.add_edge("source", i, capacity=math.inf)
            elif self.flops[n] > 0:
                g.add_edge("source", i, capacity=price * self.flops[n])
            if n in self.no_save:
                cap = math.inf
            else:
                cap = self.save_bytes(n)
                if n in self.offload_cost:
                    cap = min(cap, price * self.offload_cost[n])
            g.add_edge(i, o, capacity=cap)
            for u in n.users:
                if u.op != "output":
                    g.add_edge(o, u.name + "_in", capacity=math.inf)
        return g

    def solve(self, price: float) -> ActivationPlan:
        g = self._network(price)
        try:
            _, (_, sink_side) = nx.minimum_cut(g, "source", "sink", flow_func=boykov_kolmogorov)
        except nx.NetworkXUnbounded as e:
            raise ZeroFXError(
                "no partition satisfies the checkpoint constraints: a value the backward "
                "needs can neither be saved nor recomputed (e.g. a policy forces "
                "recomputing a random op's consumer); please report this graph"
            ) from e
        on_backward_side = {n for n in self.nodes if n.name + "_in" in sink_side}
        return self._account(on_backward_side, price)

    def _account(
        self, on_backward_side: set[fx.Node], price: float, offload: set[fx.Node] | None = None
    ) -> ActivationPlan:
        """Exactly what a partition recomputing ``on_backward_side`` saves and recomputes.

        The backward graph is the backward nodes plus every forward node they need that is not
        saved: walk from the backward's inputs; a node on the backward side is recomputed (and
        its inputs needed in turn), any other is saved. Saved values are offloaded where the
        price makes it pay, or, when ``offload`` is given, exactly those in it."""
        recomputed, saved = [], []
        seen: set[fx.Node] = set()
        stack = list(self.backward_reads)
        inputs = self.inputs
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op != "placeholder" and n in on_backward_side:
                recomputed.append(n)
                stack.extend(inputs[n])
            else:
                saved.append(n)
        saved.sort(key=self.order.__getitem__)
        recomputed.sort(key=self.order.__getitem__)
        offloaded: dict[fx.Node, str] = {}
        resident = off_bytes = 0
        keys: set = set()
        for n in saved:
            key = self.keys[n]
            if key in keys:
                continue
            keys.add(key)
            nbytes = self.save_bytes(n)
            cost = self.offload_cost.get(n)
            if (n in offload) if offload is not None else (cost is not None and price * cost < nbytes):
                offloaded[n] = self.offload_tier
                off_bytes += nbytes
            else:
                resident += nbytes
        flops = sum(self.flops[n] for n in recomputed)
        return ActivationPlan(
            [n for n in saved if n not in offloaded],
            offloaded,
            recomputed,
            resident,
            off_bytes,
            flops,
            price,
            frozenset(on_backward_side),
        )

    # -- prices --------------------------------------------------------------------------------
    def price_bounds(self) -> tuple[float, float]:
        """λ above which nothing with FLOPs is recomputed, and below which memory alone decides."""
        total_bytes = sum(self.bytes.values()) + 1
        total_flops = sum(self.flops.values()) + sum(self.offload_cost.values()) + 1
        return 0.5 / total_flops, float(total_bytes)


def plan_activations(
    problem: PlanProblem, budget_bytes: int | None, free_price: float | None = None
) -> tuple[ActivationPlan, ActivationPlan]:
    """The cheapest plan whose resident bytes fit ``budget_bytes`` (None: no budget), and the
    leanest plan any price gives (its resident bytes are the minimum feasible budget). Without
    a budget, ``free_price`` (FLOPs per byte freed) is what recomputing a value the constraints
    leave free may cost (None: nothing is recomputed for free).

    Raises ZeroFXError when even the leanest plan does not fit."""
    low, high = problem.price_bounds()
    lean = problem.solve(low)
    rich = problem.solve(high if budget_bytes is not None or free_price is None else free_price)
    if budget_bytes is None:
        if problem.offload_tier:  # no budget: offload only what hides completely
            rich = _with_offloads(problem, rich, [n for n in rich.saved if problem.offload_cost.get(n) == 1.0])
        return rich, lean
    if lean.resident_bytes > budget_bytes:
        raise ZeroFXError(f"activation budget {budget_bytes} B is below what any schedule can meet")
    if rich.resident_bytes <= budget_bytes:
        return rich, lean
    feasible, infeasible = low, high
    tried = [lean, rich]
    for _ in range(64):
        if infeasible / feasible < 1.01:  # the fill below closes what is left of the gap
            break
        mid = math.sqrt(feasible * infeasible)
        plan = problem.solve(mid)
        tried.append(plan)
        if plan.resident_bytes <= budget_bytes:
            feasible = mid
        else:
            infeasible = mid
    over = min((p for p in tried if p.resident_bytes > budget_bytes), key=lambda p: p.resident_bytes)
    starts, seen = [], set()  # the feasible plans nearest the budget (ties at a breakpoint differ)
    for plan in sorted((p for p in tried if p.resident_bytes <= budget_bytes), key=lambda p: p.recompute_flops):
        if plan.backward_side not in seen and len(starts) < 2:
            seen.add(plan.backward_side)
            starts.append(plan)
    filled = []
    for start in starts:
        gap = sorted(start.backward_side - over.backward_side, key=problem.order.__getitem__)
        moves = _pieces(gap) + [
            {n}
            for n in start.recomputed
            if n not in problem.must_recompute
            and n not in problem.no_save
            and n.op == "call_function"
            and problem.flops[n] > 0
        ]
        filled += [_fill(problem, start, moves, budget_bytes, by_ratio) for by_ratio in (True, False)]
    best = min(filled, key=lambda p: (p.recompute_flops, p.resident_bytes))
    return _keep_resident(problem, best, budget_bytes), lean


def _keep_resident(problem: PlanProblem, plan: ActivationPlan, budget: int) -> ActivationPlan:
    """Bring offloaded values back to resident while the budget allows: an offload that hides
    still costs link or disk bandwidth, so park only what the budget needs parked (the most
    exposed transfers come back first, then the smallest)."""
    if not plan.offloaded:
        return plan
    offloaded = dict(plan.offloaded)
    saved = list(plan.saved)
    resident, off_bytes = plan.resident_bytes, plan.offloaded_bytes
    for n in sorted(offloaded, key=lambda n: (-problem.offload_cost.get(n, 0.0), problem.save_bytes(n))):
        nbytes = problem.save_bytes(n)
        if resident + nbytes <= budget:
            del offloaded[n]
            saved.append(n)
            resident += nbytes
            off_bytes -= nbytes
    saved.sort(key=problem.order.__getitem__)
    return ActivationPlan(
        saved, offloaded, plan.recomputed, resident, off_bytes, plan.recompute_flops, plan.price, plan.backward_side
    )


def _fill(problem: PlanProblem, start: ActivationPlan, moves: list[set], budget: int, by_ratio: bool) -> ActivationPlan:
    """Close the Lagrangian gap: spend the budget ``start`` leaves (see NOTE: one min-cut ...).

    Between the last price that fits and the first that does not, plans jump: values with
    the same FLOPs-per-byte ratio (every projection of a transformer costs 2·K FLOPs per output
    element; every GELU one) switch from saved to recomputed together, so the best plan for a
    budget in between is no price's plan: it is a knapsack over the values that switch. Each
    move saves one more value (or a connected piece of the switch) instead of recomputing it;
    moves are evaluated exactly against the current plan (their effects overlap: keeping the
    log-softmax makes recomputing the logits unnecessary too) and taken greedily while the
    plan fits, either by FLOPs saved per byte added or by FLOPs saved alone (ties in ratio
    make the first blind to which moves fit together; the caller keeps the better result)."""
    import heapq

    current = start

    def evaluate(piece: set) -> tuple[float, ActivationPlan | None]:
        side = set(current.backward_side)
        if not piece & side:
            return 0.0, None
        candidate = problem._account(side - piece, current.price)
        saved = current.recompute_flops - candidate.recompute_flops
        if candidate.resident_bytes > budget or saved <= 0:
            return 0.0, None
        key = saved / max(1, candidate.resident_bytes - current.resident_bytes) if by_ratio else float(saved)
        return key, candidate

    heap = [(-k, i) for i, piece in enumerate(moves) if (k := evaluate(piece)[0]) > 0]
    heapq.heapify(heap)
    while heap:  # lazy greedy: re-check the best move against the current plan before taking it
        _, i = heapq.heappop(heap)
        key, candidate = evaluate(moves[i])
        if candidate is None:
            continue
        if heap and key < -heap[0][0]:
            heapq.heappush(heap, (-key, i))
            continue
        current = candidate
    return current


def _pieces(nodes: list[fx.Node]) -> list[set]:
    """Connected pieces of ``nodes`` under data edges (a tuple-valued op and its getitems stay
    together, so moving a piece never leaves a tuple to be saved)."""
    graph = nx.Graph()
    graph.add_nodes_from(nodes)  # in graph order (checkpoint.py, NOTE: ranks agree)
    members = set(nodes)
    for n in nodes:
        graph.add_edges_from((n, u) for u in n.users if u in members)
    return [set(c) for c in nx.connected_components(graph)]


def _with_offloads(problem: PlanProblem, plan: ActivationPlan, nodes: list[fx.Node]) -> ActivationPlan:
    """``plan`` with the saved values ``nodes`` moved to the offload tier as well."""
    if not nodes:
        return plan
    moved = {n: problem.offload_tier for n in nodes}
    saved = [n for n in plan.saved if n not in moved]
    keys = {storage_key(n) for n in saved}
    moved_bytes = sum(problem.save_bytes(n) for n in moved if storage_key(n) not in keys)
    return ActivationPlan(
        saved,
        {**plan.offloaded, **moved},
        plan.recomputed,
        plan.resident_bytes - moved_bytes,
        plan.offloaded_bytes + moved_bytes,
        plan.recompute_flops,
        plan.price,
    )
