"""Block quantization for collectives (ZeRO++'s qwZ and qgZ): the wire format and its two ops.

A quantized collective moves bytes instead of floats: each row of the value is cut into blocks
of ``block`` elements, each block is scaled by its own absolute maximum (symmetric, no zero
point) and rounded to ``bits``-bit integers. The passes (passes/quantize.py) put
``quantize_blockwise`` before a collective and ``dequantize_blockwise`` after its wait; both are
ordinary ops with an ATen implementation (here, the default, and what CPUs run) and a Triton
kernel (zerofx/codegen/quantize_kernels.py, used by the "triton" executor).

# NOTE: packed rows
One collective carries payload and scales together, so a quantized gather is still one
collective per bucket (and buckets still merge). Each row becomes ``row_bytes(numel)`` bytes::

    [ fp32 scale of block 0 | ... | scale of block nb-1 ][ payload ][ 0-3 zero bytes ]
      4·nb bytes                                          int8: numel bytes, int4: ceil(numel/2)

``nb = ceil(numel / block)``. int4 packs two values per byte, element ``2i`` in the low nibble,
``2i+1`` in the high one (two's complement nibbles); ``block`` must be even so no block shares
a byte with the next. Rows are padded to a multiple of 4 bytes so the scales of every row of a
gathered ``[N, row_bytes]`` buffer are aligned fp32s (a dtype view, no copy).

Rounding is ``floor(x · (qmax / absmax) + 0.5)`` (qmax = 127 or 7), written the same way in
ATen and Triton so both produce the same bytes; the value is then at most
``absmax / qmax / 2`` (plus fp32 rounding) from the original. An all-zero block has scale 0; a block whose largest magnitude is below about 1e-36 (where
``qmax / absmax`` overflows fp32) quantizes to zeros.
Stochastic rounding is not implemented (off, as the issue asks by default).

fp8 (``quantize_weights="fp8"``): the same packed rows with one byte per value, each
``x · (448 / absmax)`` cast to ``float8_e4m3fn`` (round to nearest even, torch's cast) and
stored as its bits; the relative error is then at most 2^-4 of the value (3 mantissa bits),
and values below the format's smallest normal lose more. ATen only: it runs wherever torch
casts to float8, the CPU included; the "triton" executor leaves these nodes on ATen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "QUANT_BITS",
    "quant_format",
    "QuantFormat",
    "quantize_blockwise",
    "dequantize_blockwise",
    "QUANTIZE",
    "DEQUANTIZE",
    "SCALAR_TEMPS",
    "quantize_workspace_bytes",
    "dequantize_workspace_bytes",
]

# what each option value puts on the wire: bits per value, and whether the values are floats (fp8)
QUANT_BITS = {"int8": (8, False), "int4": (4, False), "fp8": (8, True)}


@dataclass(frozen=True)
class QuantFormat:
    """A block-quantized wire format (NOTE: packed rows)."""

    bits: int
    block: int
    floating: bool = False  # fp8 (e4m3) values instead of integers

    def __post_init__(self) -> None:
        if self.bits not in (4, 8) or (self.floating and self.bits != 8):
            raise ValueError(f"bits={self.bits}, floating={self.floating}: int8, int4 or fp8 only")
        if self.block < 1 or (self.bits == 4 and self.block % 2):
            raise ValueError(f"block={self.block}: give a block size >= 1 (even for int4)")

    @property
    def qmax(self) -> float:
        if self.floating:
            return torch.finfo(torch.float8_e4m3fn).max  # 448
        return 127 if self.bits == 8 else 7

    @property
    def name(self) -> str:
        return "fp8" if self.floating else f"int{self.bits}"

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def payload_bytes(self, numel: int) -> int:
        return numel if self.bits == 8 else -(-numel // 2)

    def row_bytes(self, numel: int) -> int:
        """Bytes one quantized row of ``numel`` values takes on the wire (scales included)."""
        raw = 4 * self.blocks(numel) + self.payload_bytes(numel)
        return -(-raw // 4) * 4

    def describe(self) -> str:
        return f"{self.name} (blocks of {self.block}, fp32 scales)"


_FLOAT32_MAX = torch.finfo(torch.float32).max


def quant_format(option: str, block: int) -> QuantFormat:
    """The wire format an option value (``"int8"``, ``"int4"``, ``"fp8"``) names."""
    bits, floating = QUANT_BITS[option]
    return QuantFormat(bits, block, floating)


def row_numel(x: torch.Tensor, rows: int) -> int:
    """Values per row of ``x`` read as ``rows`` equal rows (ATen and the Triton kernel check alike)."""
    if rows < 1 or x.numel() % rows:
        raise ValueError(f"quantize_blockwise: {x.numel()} values do not make {rows} equal rows")
    return x.numel() // rows


# NOTE: quantize workspace
# The ATen bodies below hold one fp32 buffer of the padded rows (``rows · nb · block`` values)
# and work on it in place: the input is copied (cast) into it once; the block maxima come from
# ``vector_norm(ord=inf)`` (max |x| without a |x| temporary, the same values as ``abs().amax()``);
# the scaling, rounding and clamping run in place; the integers are cast straight into the
# packed output (int8, fp8) or, for int4, into one int8 buffer that is then packed in place.
# Dequantize is the mirror: one fp32 buffer of the padded rows, filled from the payload, scaled
# in place and cast into the output (it is the output itself when that is fp32 and unpadded).
# An earlier version chained out-of-place ops and held up to three fp32 copies of a bucket at
# once (12.6 MB to quantize 4 MiB of fp32); these write the same values and payload bytes (a
# NaN scale may carry other NaN bits: ``vector_norm`` keeps an input NaN's, ``abs().amax()``
# wrote the canonical one; tests/test_quantize.py). What is left, the bytes held above the
# op's output while it runs, is ``quantize_workspace_bytes`` /
# ``dequantize_workspace_bytes``: the cost model adds it to
# the live bytes at QUANTIZE / DEQUANTIZE nodes (passes/cost_model.py, NOTE: op workspace), and
# tests/test_quantize.py checks it equals what the allocator sees. The Triton kernels
# (codegen/quantize_kernels.py) allocate only their outputs; the cost model prices this path.


def _ceil_div(a: Any, b: int) -> Any:
    return -(-a // b)


# 0-dim tensors torch wraps Python scalars in while the in-place ops run (``add_(0.5)``, the
# shifts: 9-12 bytes measured, torch 2.x), counted as this many so the estimate is never short
SCALAR_TEMPS = 16


def quantize_workspace_bytes(numel: Any, rows: int, fmt: QuantFormat) -> Any:
    """Bytes ``_quantize_aten`` holds above its output while it quantizes ``numel`` values (all
    rows together) read as ``rows`` rows (NOTE: quantize workspace): exact for ints but for at
    most ``SCALAR_TEMPS`` bytes over; for a sympy ``numel`` (symbolic sizes) a polynomial upper
    bound (the partial block counted whole, the phases summed), which a symbolic peak can be
    solved with."""
    symbolic = not isinstance(numel, int)
    row = numel / rows if symbolic else numel // rows
    nb = (row + fmt.block - 1) / fmt.block if symbolic else _ceil_div(row, fmt.block)
    buffer = 4 * rows * nb * fmt.block  # fp32, the padded rows
    per_block = 4 * rows * nb  # one fp32 value per block: maxima, scales, inverses
    if symbolic:  # scales, payload, up to 3 bytes of padding
        output = rows * (4 * nb + (row if fmt.bits == 8 else (row + 1) / 2) + 3)
    else:
        output = rows * fmt.row_bytes(row)
    # phases: the scales (maxima, scales, inverses, two bool masks of one flag per block); the
    # in-place scaling and rounding (buffer + scales); the cast into the output, for int4 through
    # an int8 copy of the padded rows
    phases = [
        buffer + 3 * per_block + 2 * rows * nb + SCALAR_TEMPS,
        buffer + per_block + SCALAR_TEMPS,
        buffer + per_block + output + (rows * nb * fmt.block if fmt.bits == 4 else 0),
    ]
    if symbolic:
        return sum(phases)
    return max(phases) - output


def dequantize_workspace_bytes(rows: int, numel: Any, fmt: QuantFormat, dtype: torch.dtype) -> Any:
    """Bytes ``_dequantize_aten`` holds above its output while it dequantizes ``rows`` packed
    rows of ``numel`` values each into ``dtype`` (NOTE: quantize workspace): exact for ints but
    for at most ``SCALAR_TEMPS`` bytes over; a polynomial upper bound for a sympy ``numel``."""
    symbolic = not isinstance(numel, int)
    if symbolic:
        nb = (numel + fmt.block - 1) / fmt.block
        separate = True  # whether the rows are padded is not known: the output is a copy
    else:
        nb = _ceil_div(numel, fmt.block)
        if nb == 0:
            return 0
        separate = dtype != torch.float32 or nb * fmt.block != numel
    scales = 4 * rows * nb if rows > 1 else 0  # copied out of the packed rows (one row: a view)
    buffer = 4 * rows * nb * fmt.block  # fp32, the padded rows
    # int4: one payload-sized temporary at a time while the nibbles are sign-extended
    payload = rows * ((numel + 1) / 2 if symbolic else fmt.payload_bytes(numel))
    fill = payload + SCALAR_TEMPS if fmt.bits == 4 else 0
    if not separate:  # the buffer is the output
        return scales + fill
    out = rows * numel * torch.empty((), dtype=dtype).element_size()
    if symbolic:
        return scales + buffer + fill
    return scales + buffer + max(fill - out, 0)


def _quantize_aten(x: torch.Tensor, rows: int, fmt: QuantFormat) -> torch.Tensor:
    numel = row_numel(x, rows)
    nb, block = fmt.blocks(numel), fmt.block
    # one fp32 buffer of the padded rows, worked on in place (NOTE: quantize workspace)
    values = torch.empty((rows, nb * block), dtype=torch.float32, device=x.device)
    values[:, :numel].copy_(x.reshape(rows, numel))
    values[:, numel:].zero_()
    blocks = values.view(rows, nb, block)
    absmax = torch.linalg.vector_norm(blocks, float("inf"), dim=-1)  # max |x|, no |x| temporary
    scale = absmax / fmt.qmax
    inv = absmax.reciprocal().mul_(fmt.qmax)  # what qmax / absmax computes, without its temporary
    # an all-zero block, and one whose largest value is so small that qmax / absmax overflows
    # (below ~1e-36): every value quantizes to 0 (then 0 · inf would be NaN); a NaN or inf
    # absmax keeps its scale, so the dequantized block is NaN and a loss scaler sees the overflow
    keep = (absmax > 0).logical_and_(inv <= _FLOAT32_MAX)
    del absmax
    inv.masked_fill_(keep.logical_not_(), 0.0)
    del keep
    blocks.mul_(inv.unsqueeze(-1))
    del inv
    if fmt.floating:
        values.clamp_(-fmt.qmax, fmt.qmax)
    else:
        values.add_(0.5).floor_().clamp_(-fmt.qmax, fmt.qmax)
        # a NaN or inf value (times inv = 0) is NaN here: write 0, not what a NaN to int8 cast
        # happens to give (the NaN scale already makes the block NaN; the Triton kernel does the same)
        values.nan_to_num_(0.0)
    packed = torch.zeros((rows, fmt.row_bytes(numel)), dtype=torch.uint8, device=x.device)
    packed[:, : 4 * nb] = scale.view(torch.uint8)
    payload = packed[:, 4 * nb : 4 * nb + fmt.payload_bytes(numel)]
    if fmt.floating:
        payload.view(torch.float8_e4m3fn).copy_(values[:, :numel])
        return packed
    if fmt.bits == 8:
        payload.view(torch.int8).copy_(values[:, :numel])
        return packed
    # int4: two's complement nibbles, element 2i low
    q = values.to(torch.int8).view(torch.uint8)
    del values, blocks
    q.bitwise_and_(0xF)
    width = 2 * payload.shape[1]
    high = q[:, 1:width:2]
    high.bitwise_left_shift_(4)
    torch.bitwise_or(q[:, 0:width:2], high, out=payload)
    return packed


def _dequantize_aten(packed: torch.Tensor, numel: int, fmt: QuantFormat, dtype: torch.dtype) -> torch.Tensor:
    rows = packed.shape[0]
    nb, block = fmt.blocks(numel), fmt.block
    if nb == 0:  # empty rows: no scales to view as fp32 (a zero-width uint8 slice cannot be)
        return torch.empty((rows, 0), dtype=dtype, device=packed.device)
    scale = packed[:, : 4 * nb].contiguous().view(torch.float32)
    payload = packed[:, 4 * nb : 4 * nb + fmt.payload_bytes(numel)]
    # one fp32 buffer of the padded rows, scaled in place (NOTE: quantize workspace)
    values = torch.empty((rows, nb * block), dtype=torch.float32, device=packed.device)
    values[:, numel:].zero_()
    if fmt.floating:
        values[:, :numel].copy_(payload.view(torch.float8_e4m3fn))
    elif fmt.bits == 8:
        values[:, :numel].copy_(payload.view(torch.int8))
    else:  # sign-extended nibbles: element 2i from the low one, 2i+1 from the high one
        pairs = values[:, : 2 * payload.shape[1]].view(rows, -1, 2)
        pairs[..., 0].copy_(torch.bitwise_left_shift(payload, 4).view(torch.int8).bitwise_right_shift_(4))
        pairs[..., 1].copy_(payload.view(torch.int8) >> 4)
    values.view(rows, nb, block).mul_(scale.unsqueeze(-1))
    if dtype == torch.float32 and nb * block == numel:
        return values
    out = torch.empty((rows, numel), dtype=dtype, device=packed.device)
    out.copy_(values[:, :numel])
    return out


@torch.library.custom_op("zerofx::quantize_blockwise", mutates_args=())
def quantize_blockwise(x: torch.Tensor, rows: int, block: int, bits: int, floating: bool = False) -> torch.Tensor:
    """``x`` read as ``rows`` equal rows, each block-quantized: uint8 ``[rows, row_bytes]``
    (NOTE: packed rows). Each row is quantized on its own (a row is what one rank sends)."""
    return _quantize_aten(x, rows, QuantFormat(bits, block, floating))


@quantize_blockwise.register_fake
def _quantize_fake(x, rows, block, bits, floating=False):
    return x.new_empty((rows, QuantFormat(bits, block, floating).row_bytes(x.numel() // rows)), dtype=torch.uint8)


@torch.library.custom_op("zerofx::dequantize_blockwise", mutates_args=())
def dequantize_blockwise(
    packed: torch.Tensor, numel: int, block: int, bits: int, dtype: torch.dtype, floating: bool = False
) -> torch.Tensor:
    """The ``[rows, numel]`` values (in ``dtype``) of ``rows`` packed rows."""
    return _dequantize_aten(packed, numel, QuantFormat(bits, block, floating), dtype)


@dequantize_blockwise.register_fake
def _dequantize_fake(packed, numel, block, bits, dtype, floating=False):
    return packed.new_empty((packed.shape[0], numel), dtype=dtype)


QUANTIZE = torch.ops.zerofx.quantize_blockwise.default
DEQUANTIZE = torch.ops.zerofx.dequantize_blockwise.default
