"""fusion: group the graph's fusible ATen ops into regions that each become one Triton kernel.

A group is a set of nodes that run as one kernel over one iteration shape ``S``. Every member's
value is either *full* (shape ``S``) or *per-row* (one value per row of ``S``: shape
``S[:-1] + (1,)`` or ``S[:-1]``), which is what lets a group hold a whole LayerNorm or softmax:

    x ─ var_mean ─ add(eps) ─ rsqrt ┐          full:    x, sub, mul, mul_1, add_1
        └──────── sub ─────────── mul ─ mul_1(w) ─ add_1(b)      per-row: var_mean, add, rsqrt

Rules a group keeps (checked every time it grows):

* data dependencies: the group runs as one unit, so no path may leave it and come back
  (that would need a value the kernel has not produced yet);
* shapes: full and per-row values only, internal operands line up with their consumer, and
  reductions are over the last dim of a full value;
* collectives: a group never spans a collective or a ``wait_tensor`` (nor a zerofx marker,
  whose eager form runs collectives). The graph is cut into segments at every such node and a
  group lives in one segment, so the kernel runs between the same collectives its ops ran
  between: the overlap the schedule chose is kept;
* size: at most ``MAX_MEMBERS`` nodes, so compile time stays bounded.

Groups are grown greedily in graph order: a node joins its producers' groups (all of them if
that is legal, else the largest one that accepts it), else a group that reads one of its inputs
(a sibling: the input is loaded once for both), or starts its own. A group left with a
single op is dropped: one ATen op is already one kernel.
"""

from __future__ import annotations

import heapq
import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from zerofx.codegen.triton_emit import row_shapes
from zerofx.codegen.triton_ops import can_lower, kind_of, reduction_keepdim
from zerofx.ir.collectives import COLLECTIVE_OPS, WAIT
from zerofx.ir.meta import KERNEL
from zerofx.passes.graph import positions

MAX_MEMBERS = 96
_COMM_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d", "zerofx")
_VIEW_IDENTITIES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)  # views, not copies


@dataclass
class Group:
    shape: tuple[int, ...]
    members: list[fx.Node]
    segment: int
    classes: dict[fx.Node, str] = field(default_factory=dict)

    @property
    def compute_ops(self) -> int:
        return sum(1 for n in self.members if kind_of(n) in ("pointwise", "reduction"))


def is_comm(node: fx.Node) -> bool:
    """Collectives, their waits and zerofx's markers: the fixed points of the schedule."""
    if node.op != "call_function":
        return False
    if node.target in COLLECTIVE_OPS or node.target is WAIT:
        return True
    namespace = getattr(node.target, "namespace", None)
    return namespace in _COMM_NAMESPACES


def _shape(node: fx.Node) -> tuple[int, ...]:
    val = node.meta["val"]
    if isinstance(val, (tuple, list)):
        val = val[0]
    return tuple(val.shape)


def _natural_shape(node: fx.Node) -> tuple[int, ...]:
    """The iteration shape a group started by ``node`` gets: a reduction iterates its input."""
    if kind_of(node) == "reduction":
        return tuple(node.args[0].meta["val"].shape)
    return _shape(node)


def classify(members: list[fx.Node], shape: tuple[int, ...]) -> dict[fx.Node, str] | None:
    """Each member's class ("full" or "row") under iteration ``shape``, or None if illegal."""
    inside = set(members)
    rows = row_shapes(shape)
    classes: dict[fx.Node, str] = {}
    for n in members:
        s = _shape(n)
        if s == shape:
            cls = "full"
        elif s in rows:
            cls = "row"
        else:
            return None
        kind = kind_of(n)
        internal = [a for a in n.all_input_nodes if a in inside]
        if kind == "getitem":
            if n.args[0] not in inside:
                return None
        elif kind == "reduction":
            if cls != "row" or tuple(n.args[0].meta["val"].shape) != shape:
                return None
            if isinstance(n.meta["val"], (tuple, list)) and any(u not in inside for u in n.users):
                return None  # var_mean's tuple never leaves the kernel, only its items do
            keepdim = reduction_keepdim(n)
            if s != (rows[0] if keepdim else rows[1]):
                return None
        elif kind in ("expand",) or n.target in _VIEW_IDENTITIES:
            if not internal:
                return None  # a view of an outside tensor costs nothing as ATen
            if any(u.op == "output" for u in n.users):
                return None  # graph outputs that are views must stay views
        if kind != "reduction":
            for a in internal:
                if kind == "getitem":
                    continue
                sa = _shape(a)
                ok = sa == s or (cls == "full" and rows and sa == rows[0])
                if kind == "expand":
                    ok = ok and (sa == s or classes.get(a) == "row")
                if not ok:
                    return None
        classes[n] = cls
    return classes


def _acyclic(members: set[fx.Node], order: dict[fx.Node, int]) -> bool:
    """No path leaves ``members`` and re-enters them (so they can run as one kernel)."""
    last = max(order[n] for n in members)
    stack = [u for m in members for u in m.users if u not in members and order[u] < last]
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for u in node.users:
            if u in members:
                return False
            if order[u] < last:
                stack.append(u)
    return True


def _try(
    groups: list[Group], node: fx.Node, extra: list[fx.Node], segment: int, order: dict[fx.Node, int]
) -> Group | None:
    """The group made of ``groups`` plus ``node`` (and ``extra``), if every rule holds."""
    members = sorted({m for g in groups for m in g.members} | {node, *extra}, key=order.__getitem__)
    if len(members) > MAX_MEMBERS:
        return None
    if any(g.segment != segment for g in groups):
        return None
    candidates = {g.shape for g in groups} | {_natural_shape(node)}
    # the iteration shape is the one the others are per-row views of
    shape = max(candidates, key=lambda s: (math.prod(s), len(s)))
    if any(c != shape and c not in row_shapes(shape) for c in candidates):
        return None
    classes = classify(members, shape)
    if classes is None or not _acyclic(set(members), order):
        return None
    return Group(shape, members, segment, classes)


def find_groups(gm: fx.GraphModule) -> list[Group]:
    """Partition the fusible nodes of ``gm`` into legal groups of two or more ops."""
    order = positions(gm.graph)
    segment_of: dict[fx.Node, int] = {}
    segment = 0
    group_of: dict[fx.Node, Group] = {}
    for node in gm.graph.nodes:
        if is_comm(node):
            segment += 1
        segment_of[node] = segment
        if node.target is operator.getitem or not can_lower(node):
            continue
        extra = (
            [u for u in node.users if u.target is operator.getitem]
            if isinstance(node.meta["val"], (tuple, list))
            else []
        )
        producers: list[Group] = []
        for a in node.all_input_nodes:
            g = group_of.get(a)
            if g is not None and all(g is not p for p in producers):
                producers.append(g)
        attempts = [producers] if len(producers) > 1 else []
        attempts += [[g] for g in sorted(producers, key=lambda g: -len(g.members))]
        # siblings: a group that reads one of the same inputs (one load serves both)
        siblings: list[Group] = []
        for a in node.all_input_nodes:
            for u in a.users:
                g = group_of.get(u)
                if g is not None and all(g is not p for p in producers + siblings):
                    siblings.append(g)
        attempts += [[g] for g in siblings]
        attempts.append([])
        for groups in attempts:
            merged = _try(groups, node, extra, segment, order)
            if merged is not None:
                for m in merged.members:
                    group_of[m] = merged
                break
    unique: dict[int, Group] = {id(g): g for g in group_of.values()}
    return [g for g in unique.values() if g.compute_ops >= 2]


def group_io(group: Group) -> tuple[list[fx.Node], list[fx.Node]]:
    """The group's external inputs (in first-use order) and the member values used outside it."""
    inside = set(group.members)
    inputs: dict[fx.Node, None] = {}
    for m in group.members:
        for a in m.all_input_nodes:
            if a not in inside:
                inputs.setdefault(a)
    outputs = [
        m
        for m in group.members
        if not isinstance(m.meta["val"], (tuple, list)) and any(u not in inside for u in m.users)
    ]
    return list(inputs), outputs


@dataclass
class Claimed:
    """A group codegen took over: ``call(*inputs)`` returns the ``outputs`` values in order."""

    group: Group
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    call: object


def replace_groups(gm: fx.GraphModule, claimed: list[Claimed]) -> fx.GraphModule:
    """A new graph where each claimed group is one call node (plus a getitem per output).

    Nodes keep their order except where a group forces otherwise: a group runs where its first
    member stood (as soon as its inputs exist), and a node that reads one of its outputs but stood
    before its last member moves after it. Since groups never span a collective, every
    collective keeps its place relative to all compute (see the module docstring).
    """
    order = positions(gm.graph)
    unit_of: dict[fx.Node, object] = {}
    for k, c in enumerate(claimed):
        for m in c.group.members:
            unit_of[m] = k
    for n in gm.graph.nodes:
        unit_of.setdefault(n, n)
    priority: dict[object, int] = {}
    deps: dict[object, set] = {}
    users: dict[object, set] = {}
    for n in gm.graph.nodes:
        u = unit_of[n]
        priority[u] = min(priority.get(u, order[n]), order[n])
        deps.setdefault(u, set())
        for a in n.all_input_nodes:
            ua = unit_of[a]
            if ua is not u:
                deps[u].add(ua)
                users.setdefault(ua, set()).add(u)
    missing = {u: len(d) for u, d in deps.items()}
    ready = [(priority[u], i, u) for i, u in enumerate(deps) if missing[u] == 0]
    heapq.heapify(ready)
    tiebreak = len(deps)

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    emitted = 0
    while ready:
        _, _, unit = heapq.heappop(ready)
        emitted += 1
        if isinstance(unit, fx.Node):
            env[unit] = graph.node_copy(unit, lambda a: env[a])
        else:
            c = claimed[unit]
            call = graph.create_node("call_function", c.call, tuple(env[a] for a in c.inputs), name=c.call.__name__)
            call.meta["val"] = tuple(o.meta["val"] for o in c.outputs)
            call.meta[KERNEL] = c.call.__name__
            trace = next((m.meta["stack_trace"] for m in c.group.members if m.meta.get("stack_trace")), None)
            if trace:
                call.meta["stack_trace"] = trace
            for j, o in enumerate(c.outputs):
                item = graph.create_node("call_function", operator.getitem, (call, j), name=o.name)
                item.meta["val"] = o.meta["val"]
                env[o] = item
        for u in users.get(unit, ()):
            missing[u] -= 1
            if missing[u] == 0:
                tiebreak += 1
                heapq.heappush(ready, (priority[u], tiebreak, u))
    if emitted != len(deps):
        raise AssertionError("replace_groups: dependency cycle through a fused group")
    out = fx.GraphModule(gm, graph)
    out.graph.lint()
    return out
