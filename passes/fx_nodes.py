"""Building and recognising FX nodes in ATen graphs, with fake-tensor metadata kept valid.

Every pass that inserts nodes goes through ``insert_call`` so that ``node.meta["val"]`` is
always a fake tensor of the right shape, dtype and strides: later passes, the dump's byte
counts and the partitioner all read it.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.node import map_arg

_F = torch.ops._c10d_functional
ALL_GATHER = _F.all_gather_into_tensor.default
REDUCE_SCATTER = _F.reduce_scatter_tensor.default
ALL_REDUCE = _F.all_reduce.default
WAIT = _F.wait_tensor.default
CONVERT = torch.ops.prims.convert_element_type.default

from zerofx.metrics import COLLECTIVE_OPS  # noqa: E402  (one table of collectives for all of zerofx)


def fake_mode_of(gm: fx.GraphModule) -> FakeTensorMode:
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode


def insert_call(gm: fx.GraphModule, target: Any, args: tuple, kwargs: dict | None = None,
                *, role: str | None = None) -> fx.Node:
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
        node.meta["zerofx_role"] = role
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


def first_user(node: fx.Node) -> fx.Node:
    """The user of ``node`` that comes first in graph order."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return min(node.users, key=order.__getitem__)


def module_path(stack_entry: str) -> str:
    """``"L['fn'].__self__.blocks.0.attn"`` (dynamo's spelling) -> ``"blocks.0.attn"``."""
    s = re.sub(r"^L\['[^']*'\]", "", stack_entry)
    s = s.replace(".__self__", "")
    s = re.sub(r"\._modules\['([^']*)'\]", r".\1", s)
    s = re.sub(r"\[(\d+)\]", r".\1", s)
    s = re.sub(r"\['([^']*)'\]", r".\1", s)
    return s.strip(".")


def block_of(path: str) -> str:
    """The transformer layer (outermost indexed module: ``blocks.0``) a module path lies in, or
    its top-level module when it lies in none (``wte``, ``ln_f``)."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def module_block(node: fx.Node, depth: int = 8) -> str | None:
    """The block (see ``block_of``) whose code produced ``node``, from the module stack dynamo
    records on forward nodes (``nn_module_stack``) and AOT autograd copies onto the backward
    nodes derived from them (``fwd_nn_module_stack``); nodes zerofx inserted carry neither, so
    the search walks up their inputs (breadth first, ``depth`` levels). None when nothing says."""
    frontier, seen = [node], set()
    for _ in range(depth):
        nxt = []
        for n in frontier:
            stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack")
            if stack:
                path = module_path(list(stack.values())[-1][0])
                if path:
                    return block_of(path)
            for i in n.all_input_nodes:
                if i not in seen:
                    seen.add(i)
                    nxt.append(i)
        frontier = nxt
    return None
