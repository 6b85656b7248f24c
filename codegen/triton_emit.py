"""Write one fused group as a readable Triton kernel (plus the few lines that launch it).

Two kernel shapes, chosen by what the group contains:

    pointwise  a 1-D range over the group's iteration shape S, BLOCK elements per program
    row        a 2-D tile of BLOCK_R rows x BLOCK_C columns, one whole row (S[-1] elements)
               per tile row, for groups that reduce over the last dim or mix per-row values
               (shape S[:-1] + (1,)) with full ones

Every value in the kernel is addressed by its logical row-major position in S, so the
generated code reads like the graph: one line per op, named after the node. Tensors crossing
the kernel boundary are addressed through their real strides (broadcast dims get stride 0), so
inputs may be views, transposes or broadcasts and outputs get exactly the strides the graph's
metadata promised. Masks cover ragged ends (``offs < N``, ``rows < R``, ``cols < C``), so sizes
need not be powers of two.

Shapes and strides are baked into the source as constants: the kernel is specialised to one
layout, and ``signature`` (the source with node names stripped) keys the compiled-kernel cache,
so identical groups — the same block in every transformer layer — compile once.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import fx

from zerofx.codegen.triton_ops import FLOAT_DTYPES, MAX_ROW, POINTWISE, REDUCTIONS, TL_DTYPES, kind_of, literal

INT32_LIMIT = 2**31 - 1


class Unsupported(Exception):
    """The emitter cannot write this group; the caller keeps its nodes as ATen calls."""


@dataclass(frozen=True)
class KernelSource:
    name: str
    source: str  # a Python module: the @triton.jit kernel and ``launch(*inputs, *outputs)``
    signature: str  # cache key: the source with graph node names removed
    kind: str  # "pointwise" or "row"
    blocks: dict  # the block sizes and num_warps it launches with


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pointwise_blocks(numel: int) -> dict:
    """1024 elements per program (4 warps) is a good default for memory-bound elementwise work."""
    block = min(1024, next_pow2(numel))
    return {"BLOCK": block, "num_warps": max(1, min(8, block // 256))}


def row_blocks(rows: int, cols: int) -> dict:
    """One tile holds whole rows; pack several short rows per program to keep ~4K elements busy."""
    block_c = next_pow2(cols)
    block_r = max(1, min(next_pow2(rows), 4096 // block_c))
    tile = block_r * block_c
    return {"BLOCK_R": block_r, "BLOCK_C": block_c, "num_warps": max(1, min(16, tile // 512))}


def row_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Shapes that hold one value per row of ``shape``: keepdim and squeezed."""
    if not shape or shape[-1] == 1:
        return ()
    return (shape[:-1] + (1,), shape[:-1])


def _rowmajor(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def broadcast_strides(val: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``val``'s strides when broadcast to ``shape`` (0 where it is broadcast)."""
    lead = len(shape) - val.dim()
    out = []
    for i, size in enumerate(shape):
        j = i - lead
        if j < 0 or (val.shape[j] == 1 and size != 1):
            out.append(0)
        else:
            out.append(val.stride()[j])
    return tuple(out)


def _shape(node: fx.Node) -> tuple[int, ...]:
    val = node.meta["val"]
    if isinstance(val, (tuple, list)):
        val = val[0]
    return tuple(val.shape)


def _comment(node: fx.Node) -> str:
    def show(a: Any) -> str:
        if isinstance(a, fx.Node):
            return a.name
        if isinstance(a, torch.dtype):
            return str(a).replace("torch.", "")
        return repr(a)

    args = ", ".join([show(a) for a in node.args] + [f"{k}={show(v)}" for k, v in node.kwargs.items()])
    target = str(node.target).replace("aten.", "").replace(".default", "")
    text = f"{node.name} = {target}({args})"
    return text if len(text) <= 100 else text[:97] + "..."


class _Writer:
    """Builds the kernel body line by line; loads and index math are emitted on first use."""

    def __init__(self, shape: tuple[int, ...], rows: bool, classes: dict[fx.Node, str]):
        self.shape = shape
        self.rows = rows
        self.classes = classes
        self.numel = math.prod(shape)
        self.ncols = shape[-1] if rows else 0
        self.nrows = self.numel // self.ncols if rows else 0
        self.lines: list[str] = []
        self.values: dict[Any, str] = {}
        self.scalar: set[str] = set()
        self.coords: dict[tuple, str] = {}
        self.loads: dict[tuple, str] = {}
        self.inputs: dict[fx.Node, str] = {}
        self.counter = 0

    # --- index math ---------------------------------------------------------------------
    def _fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def _index_var(self, cls: str) -> tuple[str, str]:
        if not self.rows:
            return "offs", "mask"
        return ("offs", "mask") if cls == "full" else ("rows", "row_mask")

    def _coordinate(self, var: str, shape: tuple[int, ...], dim: int) -> str:
        """The index along ``dim`` of a row-major ``shape`` at linear position ``var``."""
        if self.rows and var == "offs" and dim == len(shape) - 1:
            return "cols"
        if self.rows and var == "offs":  # leading dims of a full tile come from its row index
            var, shape = "rows", shape[:-1]
        key = (var, shape, dim)
        if key not in self.coords:
            inner = math.prod(shape[dim + 1 :])
            expr = var if inner == 1 else f"{var} // {inner}"
            if dim > 0:
                expr = f"({expr}) % {shape[dim]}" if inner != 1 else f"{expr} % {shape[dim]}"
            name = self._fresh("i")
            self.lines.append(f"{name} = {expr}")
            self.coords[key] = name
        return self.coords[key]

    def offset(self, cls: str, shape: tuple[int, ...], strides: tuple[int, ...]) -> str | None:
        """Memory offset of a tensor with ``strides`` viewed in ``shape``; None if constant 0."""
        var, _ = self._index_var(cls)
        # contiguous apart from size-1 dims: the offset is the linear position itself
        linear_ok = all(st == r for st, r, s in zip(strides, _rowmajor(shape), shape) if s != 1)
        if linear_ok and any(s != 1 for s in shape):
            return var
        if (
            self.rows
            and cls == "full"
            and strides[-1] == 0
            and any(s != 1 for s in shape[:-1])
            and all(st == r for st, r, s in zip(strides, _rowmajor(shape[:-1]), shape[:-1]) if s != 1)
        ):
            return "rows"  # a per-row tensor read by a full-row op: same offset along the row
        terms = []
        for d, (size, st) in enumerate(zip(shape, strides)):
            if size == 1 or st == 0:
                continue
            c = self._coordinate(var, shape, d)
            terms.append(c if st == 1 else f"{c} * {st}")
        return " + ".join(terms) if terms else None

    # --- values --------------------------------------------------------------------------
    def load(self, node: fx.Node, cls: str, shape: tuple[int, ...]) -> str:
        val = node.meta["val"]
        key = (node, cls, shape)
        if key in self.loads:
            return self.loads[key]
        ptr = self.inputs[node]
        off = self.offset(cls, shape, broadcast_strides(val, shape))
        name = self._fresh("x")
        _, mask = self._index_var(cls)
        if off == "rows" and mask == "mask":  # a per-row tensor inside a full-row op: an (R, 1) load
            mask = "row_mask"
        if off is None:
            expr = f"tl.load({ptr})"
            self.scalar.add(name)
        else:
            other = "0" if val.dtype == torch.bool else "0.0"
            expr = f"tl.load({ptr} + {off}, mask={mask}, other={other})"
        if val.dtype in (torch.float16, torch.bfloat16):
            expr += ".to(tl.float32)"
        dims = "x".join(map(str, val.shape)) or "scalar"
        self.lines.append(f"{name} = {expr}  # {node.name}: {dims} {str(val.dtype).replace('torch.', '')}")
        self.loads[key] = name
        return name

    def operand(self, consumer: fx.Node, arg: Any, cls: str, shape: tuple[int, ...]) -> str:
        if isinstance(arg, fx.Node):
            if arg in self.values:
                return self.values[arg]
            return self.load(arg, cls, shape)
        if isinstance(arg, (bool, int, float)):
            return literal(arg)
        raise Unsupported(f"{consumer.name}: operand {arg!r}")

    def assign(self, node: fx.Node, expr: str, scalar: bool = False) -> None:
        name = self._fresh("v")  # numbered, not named after nodes: equal groups give equal source
        self.lines.append(f"{name} = {expr}  # {_comment(node)}")
        self.values[node] = name
        if scalar:
            self.scalar.add(name)

    def member(self, node: fx.Node) -> None:
        kind = kind_of(node)
        cls = self.classes[node]
        shape = _shape(node)
        if kind == "getitem":
            self.values[node] = self.values[(node.args[0], node.args[1])]
            return
        if kind == "reduction":
            self._reduction(node)
            return
        if kind in ("identity", "expand"):
            src = node.args[0]
            inner = self.operand(node, src, cls, shape)
            if kind == "expand" and self.rows and cls == "full" and self.classes.get(src) == "row":
                self.assign(node, f"tl.broadcast_to({inner}, [BLOCK_R, BLOCK_C])")
            else:
                self.values[node] = inner
            return
        names: dict[int, str] = {}

        def x(arg: Any) -> str:
            if isinstance(arg, fx.Node):
                names[id(arg)] = self.operand(node, arg, cls, shape)
                return names[id(arg)]
            return self.operand(node, arg, cls, shape)

        expr = POINTWISE[node.target].emit(node, x)
        scalar = all(v in self.scalar for v in names.values()) and bool(names)
        self.assign(node, expr, scalar)

    def _reduction(self, node: fx.Node) -> None:
        how = REDUCTIONS[node.target]
        src = self.operand(node, node.args[0], "full", self.shape)
        n = self.ncols
        total = f"tl.sum(tl.where(mask, {src}, 0.0), axis=1, keep_dims=True)"
        if how == "sum":
            self.assign(node, total)
        elif how == "mean":
            self.assign(node, f"{total} / {n}.0")
        elif how in ("max", "min"):
            fill = 'float("-inf")' if how == "max" else 'float("inf")'
            best = f"tl.{how}(tl.where(mask, {src}, {fill}), axis=1, keep_dims=True)"
            # tl.max / tl.min drop NaN; torch's amax / amin return NaN for a row holding one
            nan = f"tl.max((mask & ({src} != {src})).to(tl.int32), axis=1, keep_dims=True) > 0"
            self.assign(node, f'tl.where({nan}, float("nan"), {best})')
        elif how == "var_mean":
            correction = node.kwargs.get("correction")
            correction = 1 if correction is None else correction  # ATen's default: unbiased
            mean, var, dev = self._fresh("mean"), self._fresh("var"), self._fresh("dev")
            self.lines.append(f"{mean} = {total} / {n}.0  # {_comment(node)}")
            self.lines.append(f"{dev} = tl.where(mask, {src} - {mean}, 0.0)")
            # ATen divides by max(n - correction, 0): a correction past the row's length gives inf
            # (or NaN), never a negative variance
            divisor = float(max(n - correction, 0))
            self.lines.append(f"{var} = tl.sum({dev} * {dev}, axis=1, keep_dims=True) / {divisor!r}")
            self.values[(node, 0)] = var
            self.values[(node, 1)] = mean
        else:  # pragma: no cover - REDUCTIONS and this switch are kept in step
            raise Unsupported(how)

    def store(self, node: fx.Node, ptr: str) -> None:
        val = node.meta["val"]
        cls = self.classes[node]
        shape = tuple(val.shape)
        off = self.offset(cls, shape, tuple(val.stride()))
        value = self.values[node]
        _, mask = self._index_var(cls)
        if value in self.scalar or off is None:
            tile = "[BLOCK]" if not self.rows else ("[BLOCK_R, BLOCK_C]" if cls == "full" else "[BLOCK_R, 1]")
            value = f"tl.broadcast_to({value}, {tile})"
        if val.dtype in (torch.float16, torch.bfloat16):
            value = f"{value}.to({TL_DTYPES[val.dtype]})"
        if off == "rows" and mask == "mask":  # a full tile into a stride-0 row (an expand): same value per row
            off = "rows + 0 * cols"
        target = f"{ptr} + {off}" if off is not None else f"{ptr} + 0 * {self._index_var(cls)[0]}"
        self.lines.append(f"tl.store({target}, {value}, mask={mask})  # {node.name}")


def _check_sizes(group_shape: tuple[int, ...], tensors: Sequence[torch.Tensor]) -> None:
    if math.prod(group_shape) == 0:
        raise Unsupported("empty tensor")
    for t in tensors:
        extent = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride())) + 1
        if extent > INT32_LIMIT or t.numel() > INT32_LIMIT:
            raise Unsupported("more than 2**31 elements: int32 indexing would overflow")
        if t.dtype not in FLOAT_DTYPES + (torch.bool,):
            raise Unsupported(f"dtype {t.dtype}")


def emit_group(
    members: Sequence[fx.Node],
    shape: tuple[int, ...],
    classes: dict[fx.Node, str],
    inputs: Sequence[fx.Node],
    outputs: Sequence[fx.Node],
    *,
    autotune: bool = False,
) -> KernelSource:
    """The Triton source of one group (see ``zerofx.codegen.fusion`` for how groups are made)."""
    rows = any(c == "row" for c in classes.values()) or any(kind_of(n) == "reduction" for n in members)
    tensors = [n.meta["val"] for n in (*inputs, *outputs)]
    _check_sizes(shape, tensors)
    w = _Writer(shape, rows, classes)
    if rows and w.ncols > MAX_ROW:
        raise Unsupported(f"row of {w.ncols} elements is longer than {MAX_ROW}")
    w.inputs = {n: f"in{i}" for i, n in enumerate(inputs)}
    for n in members:
        w.member(n)
    for i, n in enumerate(outputs):
        w.store(n, f"out{i}")

    params = [f"in{i}" for i in range(len(inputs))] + [f"out{i}" for i in range(len(outputs))]
    if rows:
        blocks = row_blocks(w.nrows, w.ncols)
        head = [
            f"# {w.nrows} rows x {w.ncols} columns (iteration shape {shape})",
            "rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]",
            "cols = tl.arange(0, BLOCK_C)[None, :]",
            f"row_mask = rows < {w.nrows}",
            f"mask = row_mask & (cols < {w.ncols})",
            f"offs = rows * {w.ncols} + cols",
        ]
        constexprs = ["BLOCK_R: tl.constexpr", "BLOCK_C: tl.constexpr"]
        grid = f"triton.cdiv({w.nrows}, meta['BLOCK_R'])"
        kind = "row"
    else:
        blocks = pointwise_blocks(w.numel)
        head = [
            f"# {w.numel} elements (iteration shape {shape})",
            "offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)",
            f"mask = offs < {w.numel}",
        ]
        constexprs = ["BLOCK: tl.constexpr"]
        grid = f"triton.cdiv({w.numel}, meta['BLOCK'])"
        kind = "pointwise"

    body = "\n".join("    " + line for line in head + w.lines)
    from zerofx.codegen.triton_runtime import interpreting  # (triton_runtime imports this module)

    tuned = autotune and not interpreting()  # the interpreter cannot time kernels
    block_kw = ", ".join(f"{k}={v}" for k, v in blocks.items() if k != "num_warps")
    if tuned:
        decorator = _autotune_decorator(kind, blocks)
        launch_kw = ""
    else:
        decorator = ""
        launch_kw = f", {block_kw}, num_warps={blocks['num_warps']}"

    def module(name: str, with_comments: bool) -> str:
        doc_rows = [f"    in{i}  {n.name}: {_describe(n)}" for i, n in enumerate(inputs)]
        doc_rows += [f"    out{i} {n.name}: {_describe(n)}" for i, n in enumerate(outputs)]
        ops = [f"    {_comment(n)}" for n in members if kind_of(n) != "getitem"]
        text = (
            f'"""{name}: {len(members)} ATen ops fused by zerofx.codegen ({kind} kernel).\n\n'
            + "\n".join(ops)
            + "\n\n"
            + "\n".join(doc_rows)
            + '\n"""\n'
            "import triton\nimport triton.language as tl\n\n\n"
            f"{decorator}@triton.jit\ndef {name}({', '.join(params + constexprs)}):\n{body}\n\n\n"
            f"def launch({', '.join(params)}):\n"
            f"    grid = lambda meta: ({grid},)\n"
            f"    {name}[grid]({', '.join(params)}{launch_kw})\n"
        )
        if not with_comments:
            text = re.sub(r"  # .*", "", text.split('"""', 2)[2])
        return text

    signature = hashlib.sha256(module("KERNEL", with_comments=False).encode()).hexdigest()[:12]
    name = f"zfx_{kind}_{signature}"
    return KernelSource(name, module(name, with_comments=True), signature, kind, blocks)


def _describe(node: fx.Node) -> str:
    val = node.meta["val"]
    return f"{tuple(val.shape)} {str(val.dtype).replace('torch.', '')} strides {tuple(val.stride())}"


def _autotune_decorator(kind: str, blocks: dict) -> str:
    """GPU only: let Triton time a few block shapes around the heuristic's choice, once per layout."""
    if kind == "pointwise":
        configs = [
            f"triton.Config({{'BLOCK': {b}}}, num_warps={max(1, min(8, b // 256))})" for b in (256, 512, 1024, 2048)
        ]
    else:
        bc = blocks["BLOCK_C"]
        configs = [
            f"triton.Config({{'BLOCK_R': {br}, 'BLOCK_C': {bc}}}, num_warps={nw})"
            for br in sorted({1, max(1, blocks["BLOCK_R"] // 2), blocks["BLOCK_R"]})
            for nw in (4, 8)
        ]
    return "@triton.autotune(configs=[\n    " + ",\n    ".join(configs) + "\n], key=[])\n"
