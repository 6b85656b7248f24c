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
from torch.utils._pytree import tree_flatten, tree_map_only

from zerofx.ir.collectives import ALL_GATHER, REDUCE_SCATTER, WAIT
from zerofx.ir.meta import ROLE

try:  # torch's own step between its fake mode and an op's meta kernel (NOTE: fake values of inserts)
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager
except ImportError:  # pragma: no cover - a torch without it takes the fake mode's path
    in_kernel_invocation_manager = None

CONVERT = torch.ops.prims.convert_element_type.default


def fake_mode_of(gm: fx.GraphModule) -> FakeTensorMode:
    """The fake mode of ``gm``'s values (a new one when it has no fake values).

    Every node a pass inserts asks for it (``insert_call``): a fake placeholder answers,
    instead of a scan of the whole graph per insert (and of sorting the placeholders). A graph's
    fake values share one mode (the trace's); with several, this would take one of them, where a
    scan would raise."""
    placeholders = gm.graph.find_nodes(op="placeholder", sort=False)
    for n in placeholders:
        val = n.meta.get("val")
        if isinstance(val, FakeTensor):
            return val.fake_mode
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
    mode = fake_mode_of(gm)
    val = _meta_kernel_value(mode, target, fake_args, fake_kwargs) if target in META_ONLY else None
    if val is None:
        with mode:
            val = target(*fake_args, **fake_kwargs)
    node.meta["val"] = val
    if role is not None:
        node.meta[ROLE] = role
    return node


def size_args(gm: fx.GraphModule, source: fx.Node, dims: Any, role: str | None = None) -> list[Any]:
    """``source``'s sizes at ``dims`` as arguments of an inserted node: an int where static; a
    symbolic size (a graph traced with dynamic shapes) read from ``source`` in the graph with
    ``aten.sym_size.int``, inserted at the current point. A SymInt in a node's arguments would be
    printed as its symbol's name, which the generated code never binds (NameError at the first
    call)."""
    shape = source.meta["val"].shape
    return [
        shape[d] if isinstance(shape[d], int) else insert_call(gm, torch.ops.aten.sym_size.int, (source, d), role=role)
        for d in dims
    ]


def rows_arg(gm: fx.GraphModule, source: fx.Node, parts: int, role: str | None = None) -> Any:
    """``source``'s dim 0 divided into ``parts``, as an argument (see ``size_args``)."""
    rows = source.meta["val"].shape[0]
    if isinstance(rows, int):
        return rows // parts
    import operator

    total = insert_call(gm, torch.ops.aten.sym_size.int, (source, 0), role=role)
    return insert_call(gm, operator.floordiv, (total, parts), role=role)


# NOTE: fake values of inserts
# A pass inserts thousands of nodes on a deep model (a bucket's copies in and out, every
# parameter's gather and wait), and each needs its fake value. Under the fake mode, most of an
# insert's time is the mode's own work around the kernel: it hashes the arguments for its
# cache, checks and converts them, then calls the op's meta kernel and wraps what it returns.
# For the ops below, whose outputs are new tensors (or views) computed from their inputs'
# metadata alone, insert_call calls the meta kernel itself, inside the mode's own
# kernel-invocation context, and wraps the outputs as the mode does (its converter, on the
# inputs' device): the same value for a fraction of the time (docs/measurements.md, "compile
# time: the schedule's probe, ..."). It does so only when every tensor argument is one of the
# mode's fake tensors with static sizes and no constant, all on one device, and takes the
# mode's path otherwise (or if the kernel raises).
# tests/test_passes.py::test_insert_call_meta_kernel_values_match_the_fake_modes compares the
# two paths on every such node of planned graphs.
aten = torch.ops.aten
META_ONLY = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.slice.Tensor,
        aten.select.int,
        aten.clone.default,
        aten.cat.default,
        aten.split_with_sizes.default,
        ALL_GATHER,
        REDUCE_SCATTER,
        WAIT,
    }
)


def _meta_kernel_value(mode: FakeTensorMode, target: Any, args: tuple, kwargs: dict) -> Any:
    """``target(*args, **kwargs)``'s fake value through its meta kernel (NOTE: fake values of
    inserts), or None where the fake mode must compute it."""
    if in_kernel_invocation_manager is None:
        return None
    tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    if not tensors:
        return None
    device = None
    for t in tensors:
        if not isinstance(t, FakeTensor) or t.fake_mode is not mode or t.constant is not None:
            return None
        if t._has_symbolic_sizes_strides or (device is not None and t.fake_device != device):
            return None
        device = t.fake_device
    try:
        with in_kernel_invocation_manager(mode):
            out = target(*args, **kwargs)
    except Exception:  # let the fake mode decide, and raise, as it always did
        return None
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    if any(isinstance(o, FakeTensor) or o.device.type != "meta" for o in outs):
        return None  # an input handed back, or not a meta kernel's output: the mode knows what to do
    converter = mode.fake_tensor_converter
    return tree_map_only(torch.Tensor, lambda t: converter.from_meta_and_device(mode, t, device), out)


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
