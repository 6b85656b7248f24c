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

# NOTE: segments
A bucketed collective's row is several parameters' pieces end to end (a gather's row: each
member's shard; a reduce-scatter's: each member's chunk for one destination). Blocks cut across
those pieces would scale a LayerNorm weight (values near 1) with its neighbour's matmul values
a hundred times smaller, or a bias's gradient with a much larger embedding gradient, and round
the small one to zero. So both ops take the pieces' sizes (``segments``, summing to the row's
values; the bucket pass records them, zerofx/ir/meta.py ``BUCKET_SEGMENTS``) and cut each piece
into blocks of its own: ``nb`` is the sum of every piece's ``ceil(n / block)``, and each block
holds values of one piece only, scaled by its own largest value. The payload keeps the pieces
end to end (int4: each piece but the last padded to an even count, so that no byte holds two
pieces), so a piece costs at most one more scale (4 bytes) and half a byte. Inside, the ops work
on the block-padded row (each piece starting a block: ``Pieces.padded`` values), which is
exactly the plain format's blocks, and move each piece's payload between its padded and its
wire offset; the Triton kernels run on that padded row too. A row without segments (one
parameter per collective), or whose pieces but the last fill whole blocks, is the plain format.

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
    "Pieces",
    "pieces",
    "packed_row_bytes",
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


@dataclass(frozen=True)
class Pieces:
    """Where a row's pieces are (NOTE: segments), each as (offset in the row, offset in the
    block-padded row, offset among the payload's values, values)."""

    moves: tuple[tuple[int, int, int, int], ...]
    padded: int  # values of the block-padded row
    wire: int  # values the payload holds (the pieces end to end, int4: but the last even)

    def payload_moves(self, fmt: QuantFormat) -> list[tuple[int, int, int]]:
        """Each piece's payload bytes: (byte offset in the padded row's payload, in the wire
        payload, bytes)."""
        if fmt.bits == 8:
            return [(pad, wire, n) for _, pad, wire, n in self.moves]
        return [(pad // 2, wire // 2, -(-n // 2)) for _, pad, wire, n in self.moves]


def pieces(numel: int, segments: list[int] | None, fmt: QuantFormat) -> Pieces | None:
    """The layout of a row of ``numel`` values made of ``segments`` (NOTE: segments); None where
    it is the plain format's (no segments, one, or every piece but the last whole blocks)."""
    if not segments or len(segments) == 1:
        return None
    if any(n < 0 for n in segments) or sum(segments) != numel:
        raise ValueError(f"quantize_blockwise: segments {list(segments)} do not add up to a row of {numel} values")
    if all(n % fmt.block == 0 for n in segments[:-1]):
        return None
    moves, src, pad, wire = [], 0, 0, 0
    for n in segments:
        moves.append((src, pad, wire, n))
        src, pad, wire = src + n, pad + -(-n // fmt.block) * fmt.block, wire + (n + n % 2 if fmt.bits == 4 else n)
    _, pad, wire, n = moves[-1]
    return Pieces(tuple(moves), pad + n, wire + n)


def packed_row_bytes(fmt: QuantFormat, numel: int, segments: list[int] | None = None) -> int:
    """Bytes one quantized row of ``numel`` values (made of ``segments``) takes on the wire."""
    layout = pieces(numel, segments, fmt)
    if layout is None:
        return fmt.row_bytes(numel)
    return -(-(4 * fmt.blocks(layout.padded) + fmt.payload_bytes(layout.wire)) // 4) * 4


def spread_pieces(x: torch.Tensor, layout: Pieces) -> torch.Tensor:
    """``[rows, numel]`` values as the block-padded ``[rows, padded]``, zeros between the pieces."""
    out = x.new_zeros((x.shape[0], layout.padded))
    for src, pad, _, n in layout.moves:
        out[:, pad : pad + n].copy_(x[:, src : src + n])
    return out


def gather_pieces(v: torch.Tensor, layout: Pieces, out: torch.Tensor) -> torch.Tensor:
    """The pieces of block-padded rows ``v`` copied, end to end, into ``out`` (``[rows, numel]``)."""
    for src, pad, _, n in layout.moves:
        out[:, src : src + n].copy_(v[:, pad : pad + n])
    return out


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
# (codegen/quantize_kernels.py) allocate only their outputs on plain rows (not on a row of
# pieces: passes/cost_model.py, NOTE: op workspace); the cost model prices this path.


def _ceil_div(a: Any, b: int) -> Any:
    return -(-a // b)


# 0-dim tensors torch wraps Python scalars in while the in-place ops run (``add_(0.5)``, the
# shifts: 9-12 bytes measured, torch 2.x), counted as this many so the estimate is never short
SCALAR_TEMPS = 16


def quantize_workspace_bytes(numel: Any, rows: int, fmt: QuantFormat, segments: list[int] | None = None) -> Any:
    """Bytes ``_quantize_aten`` holds above its output while it quantizes ``numel`` values (all
    rows together) read as ``rows`` rows, each made of ``segments`` (NOTE: quantize workspace;
    NOTE: segments): exact for ints but for at most ``SCALAR_TEMPS`` bytes over; for a sympy
    ``numel`` (symbolic sizes) a polynomial upper bound (the partial block counted whole, the
    phases summed), which a symbolic peak can be solved with."""
    symbolic = not isinstance(numel, int)
    row = numel / rows if symbolic else numel // rows
    layout = None if symbolic else pieces(row, segments, fmt)
    padded = row if layout is None else layout.padded
    nb = (row + fmt.block - 1) / fmt.block if symbolic else _ceil_div(padded, fmt.block)
    buffer = 4 * rows * nb * fmt.block  # fp32, the block-padded rows
    per_block = 4 * rows * nb  # one fp32 value per block: maxima, scales, inverses
    if symbolic:  # scales, payload, up to 3 bytes of padding
        output = rows * (4 * nb + (row if fmt.bits == 8 else (row + 1) / 2) + 3)
    else:
        output = rows * packed_row_bytes(fmt, row, segments)
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


def dequantize_workspace_bytes(
    rows: int, numel: Any, fmt: QuantFormat, dtype: torch.dtype, segments: list[int] | None = None
) -> Any:
    """Bytes ``_dequantize_aten`` holds above its output while it dequantizes ``rows`` packed
    rows of ``numel`` values each (made of ``segments``) into ``dtype`` (NOTE: quantize
    workspace; NOTE: segments): exact for ints but for at most ``SCALAR_TEMPS`` bytes over; a
    polynomial upper bound for a sympy ``numel``."""
    symbolic = not isinstance(numel, int)
    layout = None if symbolic else pieces(numel, segments, fmt)
    if symbolic:
        nb = (numel + fmt.block - 1) / fmt.block
        separate = True  # whether the rows are padded is not known: the output is a copy
    else:
        nb = _ceil_div(numel if layout is None else layout.padded, fmt.block)
        if nb == 0:
            return 0
        separate = layout is not None or dtype != torch.float32 or nb * fmt.block != numel
    scales = 4 * rows * nb if rows > 1 else 0  # copied out of the packed rows (one row: a view)
    buffer = 4 * rows * nb * fmt.block  # fp32, the padded rows
    # int4: one temporary of a piece's payload at a time while its nibbles are sign-extended
    if symbolic:
        payload = rows * (numel + 1) / 2
    elif layout is None:
        payload = rows * fmt.payload_bytes(numel)
    else:
        payload = rows * max(n for _, _, n in layout.payload_moves(fmt))
    fill = payload + SCALAR_TEMPS if fmt.bits == 4 else 0
    if not separate:  # the buffer is the output
        return scales + fill
    out = rows * numel * torch.empty((), dtype=dtype).element_size()
    if symbolic:
        return scales + buffer + fill
    return scales + buffer + max(fill - out, 0)


def _quantize_aten(x: torch.Tensor, rows: int, fmt: QuantFormat, segments: list[int] | None = None) -> torch.Tensor:
    numel = row_numel(x, rows)
    layout = pieces(numel, segments, fmt)  # (NOTE: segments)
    x = x.reshape(rows, numel)
    padded = numel if layout is None else layout.padded
    nb, block = fmt.blocks(padded), fmt.block
    # one fp32 buffer of the padded rows, worked on in place (NOTE: quantize workspace)
    values = torch.empty((rows, nb * block), dtype=torch.float32, device=x.device)
    if layout is None:
        values[:, :numel].copy_(x)
        values[:, numel:].zero_()
    else:
        values.zero_()
        for src, pad, _, n in layout.moves:
            values[:, pad : pad + n].copy_(x[:, src : src + n])
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
    wire = numel if layout is None else layout.wire
    packed = torch.zeros((rows, packed_row_bytes(fmt, numel, segments)), dtype=torch.uint8, device=x.device)
    packed[:, : 4 * nb] = scale.view(torch.uint8)
    payload = packed[:, 4 * nb : 4 * nb + fmt.payload_bytes(wire)]
    # each piece from its offset in the padded rows to its offset on the wire (one move: plain rows)
    moves = [(0, 0, 0, numel)] if layout is None else layout.moves
    if fmt.bits == 8:
        kind = torch.float8_e4m3fn if fmt.floating else torch.int8
        for _, pad, at, n in moves:
            payload[:, at : at + n].view(kind).copy_(values[:, pad : pad + n])
        return packed
    # int4: two's complement nibbles, element 2i low
    q = values.to(torch.int8).view(torch.uint8)
    del values, blocks
    q.bitwise_and_(0xF)
    q[:, 1::2].bitwise_left_shift_(4)
    for _, pad, at, n in moves:
        width = 2 * -(-n // 2)  # a piece's odd count takes the zero after it (a pad, or the block's)
        torch.bitwise_or(
            q[:, pad : pad + width : 2], q[:, pad + 1 : pad + width : 2], out=payload[:, at // 2 : (at + width) // 2]
        )
    return packed


def _dequantize_aten(
    packed: torch.Tensor, numel: int, fmt: QuantFormat, dtype: torch.dtype, segments: list[int] | None = None
) -> torch.Tensor:
    rows = packed.shape[0]
    layout = pieces(numel, segments, fmt)  # (NOTE: segments)
    padded, wire = (numel, numel) if layout is None else (layout.padded, layout.wire)
    nb, block = fmt.blocks(padded), fmt.block
    if nb == 0:  # empty rows: no scales to view as fp32 (a zero-width uint8 slice cannot be)
        return torch.empty((rows, 0), dtype=dtype, device=packed.device)
    scale = packed[:, : 4 * nb].contiguous().view(torch.float32)
    payload = packed[:, 4 * nb : 4 * nb + fmt.payload_bytes(wire)]
    # one fp32 buffer of the padded rows, scaled in place (NOTE: quantize workspace)
    values = torch.empty((rows, nb * block), dtype=torch.float32, device=packed.device)
    if layout is None:
        values[:, numel:].zero_()
    else:
        values.zero_()
    moves = [(0, 0, 0, numel)] if layout is None else layout.moves
    for _, pad, at, n in moves:
        if fmt.bits == 8:
            values[:, pad : pad + n].copy_(
                payload[:, at : at + n].view(torch.float8_e4m3fn if fmt.floating else torch.int8)
            )
            continue
        # sign-extended nibbles: element 2i from the low one, 2i+1 from the high one
        nibbles = payload[:, at // 2 : at // 2 + -(-n // 2)]
        pairs = values[:, pad : pad + 2 * nibbles.shape[1]].view(rows, -1, 2)
        pairs[..., 0].copy_(torch.bitwise_left_shift(nibbles, 4).view(torch.int8).bitwise_right_shift_(4))
        pairs[..., 1].copy_(nibbles.view(torch.int8) >> 4)
    values.view(rows, nb, block).mul_(scale.unsqueeze(-1))
    if layout is None and dtype == torch.float32 and nb * block == numel:
        return values
    out = torch.empty((rows, numel), dtype=dtype, device=packed.device)
    if layout is not None:
        return gather_pieces(values, layout, out)
    out.copy_(values[:, :numel])
    return out


@torch.library.custom_op("zerofx::quantize_blockwise", mutates_args=())
def quantize_blockwise(
    x: torch.Tensor, rows: int, block: int, bits: int, floating: bool = False, segments: list[int] | None = None
) -> torch.Tensor:
    """``x`` read as ``rows`` equal rows, each block-quantized: uint8 ``[rows, row_bytes]``
    (NOTE: packed rows). Each row is quantized on its own (a row is what one rank sends), each
    of its ``segments`` in blocks of its own (NOTE: segments)."""
    return _quantize_aten(x, rows, QuantFormat(bits, block, floating), segments)


@quantize_blockwise.register_fake
def _quantize_fake(x, rows, block, bits, floating=False, segments=None):
    row_bytes = packed_row_bytes(QuantFormat(bits, block, floating), x.numel() // rows, segments)
    return x.new_empty((rows, row_bytes), dtype=torch.uint8)


@torch.library.custom_op("zerofx::dequantize_blockwise", mutates_args=())
def dequantize_blockwise(
    packed: torch.Tensor,
    numel: int,
    block: int,
    bits: int,
    dtype: torch.dtype,
    floating: bool = False,
    segments: list[int] | None = None,
) -> torch.Tensor:
    """The ``[rows, numel]`` values (in ``dtype``) of ``rows`` packed rows (quantized with these
    ``segments``)."""
    return _dequantize_aten(packed, numel, QuantFormat(bits, block, floating), dtype, segments)


@dequantize_blockwise.register_fake
def _dequantize_fake(packed, numel, block, bits, dtype, floating=False, segments=None):
    return packed.new_empty((packed.shape[0], numel), dtype=dtype)


QUANTIZE = torch.ops.zerofx.quantize_blockwise.default
DEQUANTIZE = torch.ops.zerofx.dequantize_blockwise.default
