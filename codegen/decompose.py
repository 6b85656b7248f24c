"""decompose: open composite ATen ops (layer norm, softmax, GELU, their backwards) into the
pointwise ops and last-dim reductions the Triton emitter understands, in place, one node at a time.

Why one node at a time and not a re-trace of the whole graph: a re-trace renames every node and
drops the metadata earlier passes left on them (roles, recompute tags), and the order of the
graph is the schedule those passes chose. Here each composite node is replaced by its
decomposition right where it stood, so nothing else in the graph moves.

A node is only opened when every op of its decomposition is one the emitter can lower
(``can_lower``), or a sum ATen runs as well as the native op would (the weight and bias
gradients of a norm); otherwise the native ATen kernel, which is faster than a chain of small
ATen ops, stays. The opened ops keep the original node's output metadata (shape, dtype and strides),
so consumers see exactly the tensor layout they saw before.

    y, mean, rstd = native_layer_norm(x, [C], w, b, eps)
      ->
    var, mean = var_mean(x, [-1], correction=0, keepdim=True)
    rstd = rsqrt(var + eps); y = (x - mean) * rstd * w + b
"""

from __future__ import annotations

import logging
import operator
from typing import Callable

import torch
from torch import fx
from torch._decomp import get_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from zerofx.codegen.triton_ops import reduced_dim
from zerofx.passes.graph import fake_mode_of

log = logging.getLogger(__name__)
aten = torch.ops.aten

# Composite ops worth opening: each becomes a short chain that fuses with its neighbours.
COMPOSITES = (
    aten.native_layer_norm.default,
    aten.native_layer_norm_backward.default,
    aten._softmax.default,
    aten._softmax_backward_data.default,
    aten._log_softmax.default,
    aten._log_softmax_backward_data.default,
    aten.gelu.default,
    aten.gelu_backward.default,
    aten.silu.default,
    aten.silu_backward.default,
    aten.sigmoid_backward.default,
    aten.tanh_backward.default,
    aten.threshold_backward.default,
    aten.addcmul.default,
    aten.addcdiv.default,
    aten.lerp.Scalar,
)

_TABLE = get_decompositions(list(COMPOSITES))

# Ops a decomposition may leave to ATen without losing to the native kernel: the column sums
# of a norm's weight and bias gradients (a reduction over rows, which ATen does well).
_ATEN_LEFTOVERS = (aten.sum.dim_IntList,)


def _aten_leftover(node: fx.Node) -> bool:
    """A column sum (not over the last dim). A last-dim sum left to ATen is a row too long for
    a kernel (a vocab-sized log_softmax): opening the composite would only turn one native op
    into several unfused ATen ops, so it stays whole."""
    if node.target not in _ATEN_LEFTOVERS:
        return False
    ndim = node.args[0].meta["val"].dim()
    return ndim > 0 and reduced_dim(node) != ndim - 1


def _trace(node: fx.Node, gm: fx.GraphModule) -> fx.GraphModule | None:
    """The decomposition of ``node`` as a small graph whose placeholders are its tensor args."""
    fn = _TABLE.get(node.target)
    if fn is None:
        return None
    tensor_args = [a for a in node.all_input_nodes]
    if not all(isinstance(a.meta.get("val"), torch.Tensor) for a in tensor_args):
        return None

    def call(*tensors: torch.Tensor):
        env = dict(zip(tensor_args, tensors))
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
        return node.target(*args, **kwargs)

    fakes = [a.meta["val"] for a in tensor_args]
    try:
        with fake_mode_of(gm):
            return make_fx(call, decomposition_table=_TABLE)(*fakes)
    except Exception as e:  # a decomposition that cannot trace here just stays native
        log.debug("zerofx codegen: not decomposing %s (%s): %s", node.name, node.target, e)
        return None


def _inline(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule) -> None:
    """Copy ``sub``'s ops in front of ``node`` and route ``node``'s users to their results."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env: dict[fx.Node, fx.Node] = dict(zip(placeholders, node.all_input_nodes))
    with gm.graph.inserting_before(node):
        for sub_node in sub.graph.nodes:
            if sub_node.op in ("placeholder", "output"):
                continue
            new = gm.graph.node_copy(sub_node, lambda n: env[n])
            new.meta = {"val": sub_node.meta["val"], "zerofx_decomposed_from": node.name}
            env[sub_node] = new
    (result,) = [n.args[0] for n in sub.graph.nodes if n.op == "output"]
    results = result if isinstance(result, (tuple, list)) else None
    if results is None:
        out = env[result]
        out.meta["val"] = node.meta["val"]  # keep the layout consumers were traced with
        node.replace_all_uses_with(out)
    else:
        for user in list(node.users):
            assert user.target is operator.getitem, user
            out = env[results[user.args[1]]]
            out.meta["val"] = user.meta["val"]
            user.replace_all_uses_with(out)
            gm.graph.erase_node(user)
    gm.graph.erase_node(node)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype


def _outputs_match(node: fx.Node, sub: fx.GraphModule) -> bool:
    (result,) = [n.args[0] for n in sub.graph.nodes if n.op == "output"]
    if isinstance(result, (tuple, list)):
        for user in node.users:
            if user.target is not operator.getitem:
                return False
            r = result[user.args[1]]
            if not isinstance(r, fx.Node) or not _same_layout(r.meta["val"], user.meta["val"]):
                return False
        return True
    return isinstance(result, fx.Node) and _same_layout(result.meta["val"], node.meta["val"])


def decompose_for_codegen(gm: fx.GraphModule, can_lower: Callable[[fx.Node], bool]) -> list[str]:
    """Open every composite node whose whole decomposition ``can_lower`` accepts; returns their names."""
    opened = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _TABLE:
            continue
        sub = _trace(node, gm)
        if sub is None:
            continue
        ops = [n for n in sub.graph.nodes if n.op not in ("placeholder", "output")]
        if any(n.op != "call_function" for n in ops) or not _outputs_match(node, sub):
            continue
        refused = [n for n in ops if n.target is not operator.getitem and not can_lower(n) and not _aten_leftover(n)]
        if refused:
            log.debug(
                "zerofx codegen: keeping %s native: %s cannot be lowered",
                node.name,
                ", ".join(str(n.target) for n in refused),
            )
            continue
        _inline(gm, node, sub)
        opened.append(node.name)
    gm.graph.lint()
    gm.recompile()
    return opened
