"""Moving nodes in an FX graph without breaking data dependencies (bucket and schedule use it)."""

from __future__ import annotations

from torch import fx


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def hoist_before(node: fx.Node, anchor: fx.Node) -> bool:
    """Move ``node`` and those of its ancestors that sit after ``anchor`` to just before it.

    Returns False (and moves nothing) when an ancestor cannot move: a placeholder, or the
    anchor itself. Relative order of the moved nodes is kept.
    """
    order = positions(node.graph)
    limit = order[anchor]
    if order[node] < limit:
        return True
    to_move: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in to_move or order[n] < limit:
            continue
        if n.op != "call_function" or n is anchor:
            return False
        to_move.add(n)
        stack.extend(n.all_input_nodes)
    for n in sorted(to_move, key=order.__getitem__):
        anchor.prepend(n)
    return True


def sink_before(node: fx.Node, anchor: fx.Node) -> None:
    """Move ``node`` (which must have no users before ``anchor``) to just before ``anchor``."""
    anchor.prepend(node)
