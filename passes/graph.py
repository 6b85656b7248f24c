"""Editing ATen FX graphs: building nodes with fake-tensor metadata kept valid, reading them,
and moving them without breaking data dependencies.

Every pass that inserts nodes goes through ``insert_call`` so that ``node.meta["val"]`` is
always a fake tensor of the right shape, dtype and strides: later passes, the dump's byte
counts and the partitioner all read it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.node import map_arg

from zerofx.ir.collectives import WAIT
from zerofx.ir.meta import ROLE

CONVERT = torch.ops.prims.convert_element_type.default


def fake_mode_of(gm: fx.GraphModule) -> FakeTensorMode:
    """The fake mode of ``gm``'s values (a new one when it has no fake values).

    Every node a pass inserts asks for it (``insert_call``): the first fake placeholder answers,
    instead of a scan of the whole graph per insert. A graph's fake values share one mode (the
    trace's); with several, this would take the first one's, where a scan would raise."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for n in placeholders:
        if isinstance(n.meta.get("val"), FakeTensor):
            return detect_fake_mode([n.meta["val"]])
    vals = [n.meta.get("val") for n in placeholders]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode


def insert_call(
    gm: fx.GraphModule, target: Any, args: tuple, kwargs: dict | None = None, *, role: str | None = None
) -> fx.Node:
    """Insert ``target(*args)`` at the graph's current insertion point, with ``meta["val"]``.

    ``role`` is recorded in ``meta["zerofx_role"]`` so later passes and checks can find the
    nodes zerofx made (e.g. every node of a parameter's gather chain).
    """
    kwargs = kwargs or {}
    node = gm.graph.call_function(target, args, kwargs)
    fake_args = map_arg(args, lambda n: n.meta["val"])
    fake_kwargs = map_arg(kwargs, lambda n: n.meta["val"])
    with fake_mode_of(gm):
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    if role is not None:
        node.meta[ROLE] = role
    return node


def is_view(node: fx.Node) -> bool:
    """True for ATen view ops (outputs alias their first input, no data is computed)."""
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.is_view


def full_args(node: fx.Node) -> tuple:
    """``node``'s arguments in schema order, defaults filled in, and stored back positionally.

    Marker ops have trailing optional arguments (dtypes) that tracing may leave out or pass by
    keyword; passes read and compare markers by position, so they normalize them first."""
    schema = node.target._schema
    args = []
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            args.append(node.args[i])
        elif arg.name in node.kwargs:
            args.append(node.kwargs[arg.name])
        else:
            args.append(arg.default_value)
    node.args, node.kwargs = tuple(args), {}
    return node.args


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A structural copy of ``gm`` (nodes and meta; the module's attributes shared), cheap enough
    to take before every pass."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def wait_of(collective: fx.Node) -> fx.Node | None:
    """The one ``wait_tensor`` of a collective node; None when it has none, or several."""
    waits = [u for u in collective.users if u.target is WAIT]
    return waits[0] if len(waits) == 1 else None


def first_user(node: fx.Node) -> fx.Node:
    """The user of ``node`` that comes first in graph order (fx nodes compare by their place in
    the graph, which torch keeps up to date as nodes move: no index of the whole graph)."""
    return min(node.users)


# -- moving nodes (bucket and schedule) ----------------------------------------------------------


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's index in graph order."""
    return {n: i for i, n in enumerate(graph.nodes)}


def hoist_before(node: fx.Node, anchor: fx.Node) -> bool:
    """Move ``node`` and those of its ancestors that sit after ``anchor`` to just before it.

    Returns False (and moves nothing) when an ancestor cannot move: a placeholder, or the
    anchor itself. Relative order of the moved nodes is kept.
    """
    if node < anchor:  # fx nodes compare by graph order (see first_user)
        return True
    to_move: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in to_move or n < anchor:
            continue
        if n.op != "call_function" or n is anchor:
            return False
        to_move.add(n)
        stack.extend(n.all_input_nodes)
    for n in sorted(to_move):
        anchor.prepend(n)
    return True


def sink_before(node: fx.Node, anchor: fx.Node) -> None:
    """Move ``node`` (which must have no users before ``anchor``) to just before ``anchor``."""
    anchor.prepend(node)
