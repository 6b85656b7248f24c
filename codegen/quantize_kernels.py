"""Triton kernels for block quantization: ``zerofx::quantize_blockwise`` and
``zerofx::dequantize_blockwise`` (zerofx/ir/quantize.py) on the "triton" executor.

The ATen implementations in zerofx/ir/quantize.py are the reference and what the "aten"
executor (the default, and CPUs) runs; these produce the same bytes and values (tests run them
in Triton's interpreter, ``TRITON_INTERPRET=1``, and compare bit for bit). One program per
(row, block): it loads the block, takes its absolute maximum, and writes the fp32 scale and the
payload into the packed row (NOTE: packed rows); int4 programs read even and odd elements
separately and pack them into one byte. A block holding NaN gets a NaN scale and a NaN or inf
value a 0 payload, as in ATen (``tl.max`` and ``tl.maximum`` would drop the NaN). On a GPU the
compiler may contract ``x * inv + 0.5`` into one FMA, which can move a value sitting exactly on
a rounding tie by one step: still within the error bound, but not bit-identical to ATen there.

``use_quantize_kernels(gm)`` points a graph's int8/int4 quantize/dequantize nodes at these
kernels (fp8 nodes stay on ATen); the Triton code generator calls it on every graph it compiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import fx

from zerofx.codegen.multi_tensor import jit
from zerofx.ir.quantize import (
    DEQUANTIZE,
    QUANTIZE,
    QuantFormat,
    gather_pieces,
    packed_row_bytes,
    pieces,
    row_numel,
    spread_pieces,
)

__all__ = ["quantize_triton", "dequantize_triton", "use_quantize_kernels"]


def _quantize_kernel(x_ptr, packed_ptr, scale_ptr, numel, nb, row_bytes, QMAX: tl.constexpr, BLOCK: tl.constexpr,
                     HALF: tl.constexpr, BITS: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    row = pid // nb
    blk = pid % nb
    src = x_ptr + row.to(tl.int64) * numel
    dst = packed_ptr + row.to(tl.int64) * row_bytes + 4 * nb
    offs = tl.arange(0, HALF)
    if BITS == 8:
        col = blk * BLOCK + offs
        mask = (offs < BLOCK) & (col < numel)
        x = tl.load(src + col, mask=mask, other=0.0).to(tl.float32)
        # NaN-aware absmax: tl.max drops NaN, ATen's amax keeps it (a NaN scale makes the block NaN)
        absmax = tl.max(tl.abs(x), axis=0)
        absmax = tl.where(tl.max((x != x).to(tl.int32), axis=0) > 0, float("nan"), absmax)
        inv = QMAX / tl.where(absmax > 0, absmax, 1.0)
        inv = tl.where((absmax > 0) & (inv <= 3.4028234663852886e38), inv, 0.0)  # as zerofx/ir/quantize.py
        q = tl.floor(x * inv + 0.5)  # NaN for a NaN or inf value (times inv = 0): 0, as ATen writes
        q = tl.where(q != q, 0.0, tl.minimum(tl.maximum(q, -QMAX), QMAX))
        tl.store(dst + col, q.to(tl.int8).to(tl.uint8, bitcast=True), mask=mask)
    else:  # HALF values per parity: element 2i goes to the low nibble of byte i
        even = blk * BLOCK + 2 * offs
        m_even = (2 * offs < BLOCK) & (even < numel)
        m_odd = (2 * offs + 1 < BLOCK) & (even + 1 < numel)
        xe = tl.load(src + even, mask=m_even, other=0.0).to(tl.float32)
        xo = tl.load(src + even + 1, mask=m_odd, other=0.0).to(tl.float32)
        absmax = tl.maximum(tl.max(tl.abs(xe), axis=0), tl.max(tl.abs(xo), axis=0))
        nans = tl.max((xe != xe).to(tl.int32), axis=0) + tl.max((xo != xo).to(tl.int32), axis=0)
        absmax = tl.where(nans > 0, float("nan"), absmax)  # as the int8 branch
        inv = QMAX / tl.where(absmax > 0, absmax, 1.0)
        inv = tl.where((absmax > 0) & (inv <= 3.4028234663852886e38), inv, 0.0)  # as zerofx/ir/quantize.py
        qe = tl.floor(xe * inv + 0.5)
        qo = tl.floor(xo * inv + 0.5)
        qe = tl.where(qe != qe, 0.0, tl.minimum(tl.maximum(qe, -QMAX), QMAX)).to(tl.int32)
        qo = tl.where(qo != qo, 0.0, tl.minimum(tl.maximum(qo, -QMAX), QMAX)).to(tl.int32)
        byte = (qe & 0xF) | ((qo & 0xF) << 4)
        tl.store(dst + blk * (BLOCK // 2) + offs, byte.to(tl.uint8), mask=m_even)
    tl.store(scale_ptr + row.to(tl.int64) * (row_bytes // 4) + blk, absmax / QMAX)


def _dequantize_kernel(packed_ptr, scale_ptr, out_ptr, numel, nb, row_bytes, BLOCK: tl.constexpr,
                       HALF: tl.constexpr, BITS: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    row = pid // nb
    blk = pid % nb
    src = packed_ptr + row.to(tl.int64) * row_bytes + 4 * nb
    dst = out_ptr + row.to(tl.int64) * numel
    scale = tl.load(scale_ptr + row.to(tl.int64) * (row_bytes // 4) + blk)
    offs = tl.arange(0, HALF)
    if BITS == 8:
        col = blk * BLOCK + offs
        mask = (offs < BLOCK) & (col < numel)
        q = tl.load(src + col, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        tl.store(dst + col, (q * scale).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        even = blk * BLOCK + 2 * offs
        m_even = (2 * offs < BLOCK) & (even < numel)
        m_odd = (2 * offs + 1 < BLOCK) & (even + 1 < numel)
        byte = tl.load(src + blk * (BLOCK // 2) + offs, mask=m_even, other=0).to(tl.int32)
        lo = byte & 0xF
        hi = (byte >> 4) & 0xF
        lo = tl.where(lo >= 8, lo - 16, lo).to(tl.float32)
        hi = tl.where(hi >= 8, hi - 16, hi).to(tl.float32)
        tl.store(dst + even, (lo * scale).to(out_ptr.dtype.element_ty), mask=m_even)
        tl.store(dst + even + 1, (hi * scale).to(out_ptr.dtype.element_ty), mask=m_odd)


def _lanes(fmt: QuantFormat) -> int:
    """Values each program handles per load: the block (int8), or its even half (int4)."""
    return triton.next_power_of_2(fmt.block if fmt.bits == 8 else fmt.block // 2)


def _payload_at(fmt: QuantFormat, padded: int) -> int:
    """Where the payload starts in a packed row of ``padded`` values: after its scales."""
    return 4 * fmt.blocks(padded)


def quantize_triton(
    x: torch.Tensor, rows: int, block: int, bits: int, floating: bool = False, segments: list[int] | None = None
) -> torch.Tensor:
    """``zerofx::quantize_blockwise`` (int8, int4) as one Triton launch; a row of ``segments``
    is spread over the block-padded row first, and each piece's payload moved to its place on
    the wire after (zerofx/ir/quantize.py, NOTE: segments)."""
    if floating:
        raise NotImplementedError("fp8 block quantization has no Triton kernel: the node stays on ATen")
    fmt = QuantFormat(bits, block)
    x = x.contiguous()
    numel = row_numel(x, rows)  # the same error as ATen's for values that do not split into rows
    layout = pieces(numel, segments, fmt)
    if layout is not None:
        padded = quantize_triton(spread_pieces(x.view(rows, numel), layout), rows, block, bits)
        packed = torch.zeros((rows, packed_row_bytes(fmt, numel, segments)), dtype=torch.uint8, device=x.device)
        at = _payload_at(fmt, layout.padded)
        packed[:, :at].copy_(padded[:, :at])
        for pad, wire, nbytes in layout.payload_moves(fmt):
            packed[:, at + wire : at + wire + nbytes].copy_(padded[:, at + pad : at + pad + nbytes])
        return packed
    packed = torch.zeros((rows, fmt.row_bytes(numel)), dtype=torch.uint8, device=x.device)
    nb = fmt.blocks(numel)
    if rows * nb:
        jit(_quantize_kernel)[(rows * nb,)](
            x, packed, packed.view(torch.float32), numel, nb, packed.shape[1], fmt.qmax, block, _lanes(fmt), bits
        )
    return packed


def dequantize_triton(
    packed: torch.Tensor,
    numel: int,
    block: int,
    bits: int,
    dtype: torch.dtype,
    floating: bool = False,
    segments: list[int] | None = None,
) -> torch.Tensor:
    """``zerofx::dequantize_blockwise`` (int8, int4) as one Triton launch; rows of ``segments``
    are first put back in the block-padded layout, and their pieces gathered after (NOTE:
    segments)."""
    if floating:
        raise NotImplementedError("fp8 block dequantization has no Triton kernel: the node stays on ATen")
    fmt = QuantFormat(bits, block)
    layout = pieces(numel, segments, fmt)
    if layout is not None:
        rows, at = packed.shape[0], _payload_at(fmt, layout.padded)
        padded = torch.zeros((rows, fmt.row_bytes(layout.padded)), dtype=torch.uint8, device=packed.device)
        padded[:, :at].copy_(packed[:, :at])
        for pad, wire, nbytes in layout.payload_moves(fmt):
            padded[:, at + pad : at + pad + nbytes].copy_(packed[:, at + wire : at + wire + nbytes])
        values = dequantize_triton(padded, layout.padded, block, bits, dtype)
        del padded
        return gather_pieces(values, layout, values.new_empty((rows, numel)))
    packed = packed.contiguous()
    rows = packed.shape[0]
    out = torch.empty((rows, numel), dtype=dtype, device=packed.device)
    nb = fmt.blocks(numel)
    if rows * nb:
        jit(_dequantize_kernel)[(rows * nb,)](
            packed, packed.view(torch.float32), out, numel, nb, packed.shape[1], block, _lanes(fmt), bits
        )
    return out


_KERNELS = {QUANTIZE: quantize_triton, DEQUANTIZE: dequantize_triton}


def _floating(node: fx.Node) -> bool:
    """Whether a quantize / dequantize node moves fp8 (its ``floating`` argument)."""
    at = 4 if node.target is QUANTIZE else 5
    return bool(node.args[at]) if len(node.args) > at else bool(node.kwargs.get("floating", False))


def use_quantize_kernels(gm: fx.GraphModule) -> int:
    """Point ``gm``'s quantize/dequantize nodes at the Triton kernels; returns how many."""
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _KERNELS and not _floating(node):  # fp8: ATen only
            node.target = _KERNELS[node.target]
            count += 1
    if count:
        gm.recompile()
    return count
