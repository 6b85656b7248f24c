"""How each ATen op is written in Triton: the emitter's vocabulary, and the test of what it can claim.

Values live in registers as fp32 (any float dtype) or int1 (bool); loads upcast and stores
downcast, as Inductor does. So a chain of bf16 ops is rounded once, at the store, instead of
after every op as in eager: results are closer to fp32 than eager's. An explicit cast to a
lower precision in the graph (a decomposition's ``_to_copy(x, bf16)``) is emulated with a round
trip through that dtype, because the graph asked for the rounding.

Three kinds of op:

    pointwise  one expression per element                       add, exp, where, casts, ...
    reduction  over the last dim only, whole row in one tile      sum, mean, amax, amin, var_mean
    identity   no arithmetic: the value passes through            clone, detach, alias, expand

``can_lower(node)`` says whether a node may join a fused kernel at all: a known op, static
shapes, float or bool tensors. Anything else stays an ATen call; that is never an error.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx

aten = torch.ops.aten
prims = torch.ops.prims

MAX_ROW = 16384  # longest row a row kernel keeps in one tile; longer reductions stay ATen
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
VALUE_DTYPES = FLOAT_DTYPES + (torch.bool,)
TL_DTYPES = {
    torch.float32: "tl.float32",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.bool: "tl.int1",
}


def literal(x: Any) -> str:
    """A Python scalar as Triton source (infinities and NaN spelled out)."""
    if isinstance(x, bool):
        return "1" if x else "0"
    if isinstance(x, int):
        return f"{float(x)!r}"
    if isinstance(x, float):
        if math.isinf(x):
            return 'float("inf")' if x > 0 else 'float("-inf")'
        if math.isnan(x):
            return 'float("nan")'
        return repr(x)
    raise TypeError(f"not a scalar: {x!r}")


@dataclass(frozen=True)
class Pointwise:
    """``emit(node, operand)``: ``operand(arg)`` turns a node argument into an expression."""

    emit: Callable[[fx.Node, Callable[[Any], str]], str]


def _args(fmt: str) -> Callable[[fx.Node, Callable[[Any], str]], str]:
    """Positional operands into a format string: ``_args("{0} * {1}")``."""
    return lambda n, x: fmt.format(*(x(a) for a in n.args))


def _with_alpha(fmt: str, scaled: int = 1) -> Callable[[fx.Node, Callable[[Any], str]], str]:
    """``alpha`` scales operand ``scaled``: the second for add/sub (``x + alpha * other``), the
    first for rsub (``other - alpha * x``)."""

    def emit(n: fx.Node, x: Callable[[Any], str]) -> str:
        ops = [x(n.args[0]), x(n.args[1])]
        alpha = n.args[2] if len(n.args) > 2 else n.kwargs.get("alpha", 1)  # positional in e.g. rsub.Scalar
        if alpha != 1:
            ops[scaled] = f"({ops[scaled]} * {literal(alpha)})"
        return fmt.format(*ops)

    return emit


_NAN_ALL = "propagate_nan=tl.PropagateNan.ALL"  # torch propagates NaN through max/min/relu


def _pow(n: fx.Node, x: Callable[[Any], str]) -> str:
    base, exp = x(n.args[0]), n.args[1]
    small = {
        0: "tl.where({0} != {0}, 1.0, 1.0)",  # 1 even for inf and NaN, as torch (x * 0 + 1 is NaN)
        1: "{0}",
        2: "({0} * {0})",
        3: "({0} * {0} * {0})",
        4: "({0} * {0} * ({0} * {0}))",
        0.5: "tl.sqrt({0})",
        -0.5: "tl.rsqrt({0})",
        -1: "(1.0 / {0})",
        -2: "(1.0 / ({0} * {0}))",
    }
    return small[exp].format(base)


def _pow_supported(n: fx.Node) -> bool:
    return n.args[1] in (0, 1, 2, 3, 4, 0.5, -0.5, -1, -2)


def _tanh(n: fx.Node, x: Callable[[Any], str]) -> str:
    """tanh is not in triton.language outside libdevice (which the interpreter lacks). Odd, so
    computed on ``a = |x|``: below 0.625 as ``-e / (2 + e)`` with ``e = expm1(-2a)``, and expm1 by
    Kahan's ``(u - 1) * y / log(u)`` (``u = exp(y)``), which keeps the relative error a few ulps
    near 0, where ``1 - 2 / (exp(2a) + 1)`` cancels; above, that form, within 2 ulps (Kahan's is
    within 6 there, which the ``1 - tanh^2`` of GELU's backward would magnify). Tiny |x| (u
    rounds to 1) returns x itself (tanh(x) = x there, -0.0 included)."""
    a = x(n.args[0])
    y = f"(-2.0 * tl.abs({a}))"
    u = f"tl.exp({y})"
    e = f"tl.where({u} == 0.0, -1.0, ({u} - 1.0) * {y} / tl.log({u}))"
    near = f"(-({e}) / (2.0 + {e}))"
    far = f"(1.0 - 2.0 / (tl.exp(-{y}) + 1.0))"
    r = f"tl.where(tl.abs({a}) < 0.625, {near}, {far})"
    return f"tl.where({u} == 1.0, {a}, tl.where({a} < 0, -{r}, {r}))"


def _clamp(n: fx.Node, x: Callable[[Any], str]) -> str:
    lo = n.args[1] if len(n.args) > 1 else n.kwargs.get("min")
    hi = n.args[2] if len(n.args) > 2 else n.kwargs.get("max")
    out = x(n.args[0])
    if lo is not None:
        out = f"tl.maximum({out}, {literal(lo)}, {_NAN_ALL})"
    if hi is not None:
        out = f"tl.minimum({out}, {literal(hi)}, {_NAN_ALL})"
    return out


def _cast(n: fx.Node, x: Callable[[Any], str]) -> str:
    src = n.args[0].meta["val"].dtype
    dst = n.meta["val"].dtype
    a = x(n.args[0])
    if dst == torch.bool:
        return a if src == torch.bool else f"({a} != 0)"
    if src == torch.bool:
        return f"{a}.to(tl.float32)"
    if dst == torch.float32:
        return a  # the fp32 register already holds the value exactly
    return f"{a}.to({TL_DTYPES[dst]}).to(tl.float32)"  # the graph asked for this rounding


def _compare(symbol: str) -> Callable[[fx.Node, Callable[[Any], str]], str]:
    """A comparison, computed in the dtype torch compares in. Torch compares a bf16 or fp16
    tensor with a Python scalar (or a 0-dim fp32 tensor) after rounding the scalar to the
    tensor's dtype: ``x > 0.1`` on bf16 compares with 0.10009765625. Registers hold fp32, so
    both operands are rounded to that dtype first; a comparison's output is a boolean that no
    store rounds back, and in fp32 ``bf16(0.1) > 0.1`` was True where torch says False. An
    operand that is an unrounded chain of fused ops (``a * b + c``, rounded once here where eager
    rounds after each op) can still differ in its last bit from eager's, as every fused value
    does (module docstring)."""

    def emit(n: fx.Node, x: Callable[[Any], str]) -> str:
        a, b = n.args[0], n.args[1]
        dtype = torch.result_type(*(_probe(v) for v in (a, b)))
        if dtype not in (torch.float16, torch.bfloat16):
            return f"({x(a)} {symbol} {x(b)})"
        return f"({_rounded(a, x, dtype)} {symbol} {_rounded(b, x, dtype)})"

    return emit


def _probe(v: Any) -> Any:
    """A comparison operand for ``torch.result_type``: a meta tensor of a node's shape and dtype."""
    if isinstance(v, fx.Node):
        val = v.meta["val"]
        return torch.empty(val.shape, dtype=val.dtype, device="meta")
    return v


def _rounded(v: Any, x: Callable[[Any], str], dtype: torch.dtype) -> str:
    if isinstance(v, bool) or (isinstance(v, fx.Node) and v.meta["val"].dtype == torch.bool):
        return x(v)  # 0 or 1: exact in every dtype
    if isinstance(v, fx.Node):
        return f"{x(v)}.to({TL_DTYPES[dtype]}).to(tl.float32)"
    return literal(float(torch.tensor(v, dtype=dtype)))


def _cast_supported(n: fx.Node) -> bool:
    kw = dict(n.kwargs)
    kw.pop("dtype", None)
    device = kw.pop("device", None)
    kw.pop("memory_format", None)  # the output's strides come from its metadata anyway
    kw.pop("non_blocking", None)
    layout = kw.pop("layout", None)
    return (
        not kw
        and len(n.args) <= (2 if n.target is prims.convert_element_type.default else 1)
        and (device is None or device == n.args[0].meta["val"].device)
        and layout in (None, torch.strided)
    )


POINTWISE: dict[Any, Pointwise] = {
    aten.add.Tensor: Pointwise(_with_alpha("({0} + {1})")),
    aten.add.Scalar: Pointwise(_with_alpha("({0} + {1})")),
    aten.sub.Tensor: Pointwise(_with_alpha("({0} - {1})")),
    aten.sub.Scalar: Pointwise(_with_alpha("({0} - {1})")),
    aten.rsub.Scalar: Pointwise(_with_alpha("({1} - {0})", scaled=0)),
    aten.rsub.Tensor: Pointwise(_with_alpha("({1} - {0})", scaled=0)),
    aten.mul.Tensor: Pointwise(_args("({0} * {1})")),
    aten.mul.Scalar: Pointwise(_args("({0} * {1})")),
    aten.div.Tensor: Pointwise(_args("({0} / {1})")),
    aten.div.Scalar: Pointwise(_args("({0} / {1})")),
    aten.neg.default: Pointwise(_args("(-{0})")),
    aten.reciprocal.default: Pointwise(_args("(1.0 / {0})")),
    aten.abs.default: Pointwise(_args("tl.abs({0})")),
    aten.exp.default: Pointwise(_args("tl.exp({0})")),
    aten.log.default: Pointwise(_args("tl.log({0})")),
    aten.sqrt.default: Pointwise(_args("tl.sqrt({0})")),
    aten.rsqrt.default: Pointwise(_args("tl.rsqrt({0})")),
    aten.sin.default: Pointwise(_args("tl.sin({0})")),
    aten.cos.default: Pointwise(_args("tl.cos({0})")),
    aten.erf.default: Pointwise(_args("tl.erf({0})")),
    aten.sigmoid.default: Pointwise(_args("tl.sigmoid({0})")),
    aten.tanh.default: Pointwise(_tanh),
    aten.relu.default: Pointwise(lambda n, x: f"tl.maximum({x(n.args[0])}, 0.0, {_NAN_ALL})"),
    aten.pow.Tensor_Scalar: Pointwise(_pow),
    aten.maximum.default: Pointwise(lambda n, x: f"tl.maximum({x(n.args[0])}, {x(n.args[1])}, {_NAN_ALL})"),
    aten.minimum.default: Pointwise(lambda n, x: f"tl.minimum({x(n.args[0])}, {x(n.args[1])}, {_NAN_ALL})"),
    aten.clamp_min.default: Pointwise(lambda n, x: f"tl.maximum({x(n.args[0])}, {x(n.args[1])}, {_NAN_ALL})"),
    aten.clamp_max.default: Pointwise(lambda n, x: f"tl.minimum({x(n.args[0])}, {x(n.args[1])}, {_NAN_ALL})"),
    aten.clamp.default: Pointwise(_clamp),
    aten.where.self: Pointwise(_args("tl.where({0}, {1}, {2})")),
    aten.masked_fill.Scalar: Pointwise(_args("tl.where({1}, {2}, {0})")),
    aten.gt.Tensor: Pointwise(_compare(">")),
    aten.gt.Scalar: Pointwise(_compare(">")),
    aten.ge.Tensor: Pointwise(_compare(">=")),
    aten.ge.Scalar: Pointwise(_compare(">=")),
    aten.lt.Tensor: Pointwise(_compare("<")),
    aten.lt.Scalar: Pointwise(_compare("<")),
    aten.le.Tensor: Pointwise(_compare("<=")),
    aten.le.Scalar: Pointwise(_compare("<=")),
    aten.eq.Tensor: Pointwise(_compare("==")),
    aten.eq.Scalar: Pointwise(_compare("==")),
    aten.ne.Tensor: Pointwise(_compare("!=")),
    aten.ne.Scalar: Pointwise(_compare("!=")),
    aten.logical_not.default: Pointwise(_args("({0} == 0)")),
    # operands may be floats (nonzero is true): & and | are only defined on int1
    aten.logical_and.default: Pointwise(_args("(({0} != 0) & ({1} != 0))")),
    aten.logical_or.default: Pointwise(_args("(({0} != 0) | ({1} != 0))")),
    aten._to_copy.default: Pointwise(_cast),
    prims.convert_element_type.default: Pointwise(_cast),
}

# The ops whose output may be bool. Arithmetic on bools means something else in torch (add is
# logical or, mul logical and, sub an error) than on int1 registers, so it stays ATen.
BOOL_RESULTS = {
    *(getattr(aten, op).Tensor for op in ("gt", "ge", "lt", "le", "eq", "ne")),
    *(getattr(aten, op).Scalar for op in ("gt", "ge", "lt", "le", "eq", "ne")),
    aten.logical_not.default,
    aten.logical_and.default,
    aten.logical_or.default,
    aten.where.self,
    aten.masked_fill.Scalar,
    aten._to_copy.default,
    prims.convert_element_type.default,
}

IDENTITY = (aten.clone.default, aten.alias.default, aten.detach.default)
EXPAND = aten.expand.default

# reduction op -> (combine, neutral element); mean and var_mean are built from sums
REDUCTIONS = {
    aten.sum.dim_IntList: "sum",
    aten.mean.dim: "mean",
    aten.amax.default: "max",
    aten.amin.default: "min",
    aten.var_mean.correction: "var_mean",
}

_EXTRA_CHECKS: dict[Any, Callable[[fx.Node], bool]] = {
    aten.pow.Tensor_Scalar: _pow_supported,
    aten._to_copy.default: _cast_supported,
    prims.convert_element_type.default: _cast_supported,
    aten.clone.default: lambda n: set(n.kwargs) <= {"memory_format"},
}


def reduced_dim(node: fx.Node) -> int | None:
    """The single dim a reduction node reduces over (normalised), or None if it is not one."""
    args = list(node.args[1:]) + [None, None]
    dims = node.kwargs.get("dim", args[0])
    ndim = node.args[0].meta["val"].dim()
    if dims is None or len(dims) != 1 or ndim == 0:
        return None
    return dims[0] % ndim


def reduction_keepdim(node: fx.Node) -> bool:
    if node.target is aten.var_mean.correction:
        return bool(node.kwargs.get("keepdim", False))
    return bool(node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False))


def _static(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and all(isinstance(s, int) for s in (*val.shape, *val.stride()))


def _tensors(val: Any) -> list[torch.Tensor]:
    return list(val) if isinstance(val, (tuple, list)) else [val]


def _value_ok(val: Any) -> bool:
    if isinstance(val, (tuple, list)):
        return all(_value_ok(v) for v in val)
    return _static(val) and val.dtype in VALUE_DTYPES


def kind_of(node: fx.Node) -> str | None:
    """ "pointwise", "reduction", "identity", "expand" or "getitem"; None when not lowerable."""
    target = node.target
    if target is operator.getitem:
        return "getitem"
    if target in POINTWISE:
        return "pointwise"
    if target in REDUCTIONS:
        return "reduction"
    if target in IDENTITY:
        return "identity"
    if target is EXPAND:
        return "expand"
    return None


def can_lower(node: fx.Node) -> bool:
    """Whether ``node`` could be part of a fused kernel (its neighbours decide whether it is)."""
    if node.op != "call_function":
        return False
    kind = kind_of(node)
    if kind is None or kind == "getitem":
        return False
    if not _value_ok(node.meta.get("val")):
        return False
    inputs = node.all_input_nodes
    if not inputs or not all(_value_ok(a.meta.get("val")) for a in inputs):
        return False
    devices = {v.device for v in _tensors(node.meta["val"])} | {a.meta["val"].device for a in inputs}
    if len(devices) != 1:
        return False  # e.g. a CPU scalar tensor in a CUDA op: ATen allows it, a kernel cannot read it
    for a in (*node.args, *node.kwargs.values()):
        if not isinstance(
            a,
            (
                fx.Node,
                int,
                float,
                bool,
                type(None),
                torch.dtype,
                torch.device,
                torch.layout,
                torch.memory_format,
                list,
                tuple,
                str,
            ),
        ):
            return False
    if kind == "pointwise" and node.target not in BOOL_RESULTS and node.meta["val"].dtype == torch.bool:
        return False  # e.g. True + True is True in torch, 2 -> 0 in an int1 register
    if node.target is aten.div.Tensor or node.target is aten.div.Scalar:
        if node.kwargs.get("rounding_mode") is not None:
            return False
    if kind == "reduction":
        if reduced_dim(node) != node.args[0].meta["val"].dim() - 1:
            return False
        if node.args[0].meta["val"].dtype not in FLOAT_DTYPES:
            return False
        if node.args[0].meta["val"].shape[-1] > MAX_ROW:
            return False  # the emitter would refuse the whole group (triton_emit.emit_group)
        if node.target is aten.sum.dim_IntList and node.kwargs.get("dtype") not in (None, torch.float32):
            return False
    check = _EXTRA_CHECKS.get(node.target)
    return check is None or check(node)
