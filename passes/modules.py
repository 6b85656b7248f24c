"""Which model module a graph node came from: dynamo's module-stack records, read as module paths
and transformer blocks (the checkpoint and bucket passes group by block)."""

from __future__ import annotations

import re

from torch import fx


def module_path(stack_entry: str) -> str:
    """``"L['fn'].__self__.blocks.0.attn"`` (dynamo's spelling) -> ``"blocks.0.attn"``; a
    graph input's source (``L['self']._modules['fc']._parameters['weight']``) -> ``"fc.weight"``;
    a guard's name (``fn.__self__._modules['fc']...``, dynamo's local without ``L[...]``) too;
    a model reached through a closure (``L['fn'].__closure__[0].cell_contents.blocks.0``: a
    function calling the model was compiled) the same."""
    s = re.sub(r"^(?:L\['[^']*'\]|\w+(?=\.__self__))", "", stack_entry)
    s = re.sub(r"\.__closure__\[\d+\]\.cell_contents", "", s)
    s = s.replace(".__self__", "")
    s = re.sub(r"\._(?:modules|parameters|buffers)\['([^']*)'\]", r".\1", s)
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
