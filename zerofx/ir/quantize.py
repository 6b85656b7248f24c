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

import torch

__all__ = [
    "QUANT_BITS",
    "quant_format",
    "QuantFormat",
    "quantize_blockwise",
    "dequantize_blockwise",
    "QUANTIZE",
    "DEQUANTIZE",
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


def _quantize_aten(x: torch.Tensor, rows: int, fmt: QuantFormat) -> torch.Tensor:
    numel = row_numel(x, rows)
    nb, block = fmt.blocks(numel), fmt.block
    values = x.reshape(rows, numel).float()
    values = torch.nn.functional.pad(values, (0, nb * block - numel)).view(rows, nb, block)
    absmax = values.abs().amax(-1)
    scale = absmax / fmt.qmax
    inv = fmt.qmax / absmax
    # an all-zero block, and one whose largest value is so small that qmax / absmax overflows
    # (below ~1e-36): every value quantizes to 0 (then 0 · inf would be NaN); a NaN or inf
    # absmax keeps its scale, so the dequantized block is NaN and a loss scaler sees the overflow
    inv = torch.where((absmax > 0) & (inv <= _FLOAT32_MAX), inv, torch.zeros_like(absmax))
    if fmt.floating:
        q = (values * inv.unsqueeze(-1)).clamp_(-fmt.qmax, fmt.qmax).to(torch.float8_e4m3fn)
    else:
        q = torch.floor(values * inv.unsqueeze(-1) + 0.5).clamp_(-fmt.qmax, fmt.qmax)
        # a NaN or inf value (times inv = 0) is NaN here: write 0, not what a NaN to int8 cast
        # happens to give (the NaN scale already makes the block NaN; the Triton kernel does the same)
        q = q.nan_to_num_(0.0).to(torch.int8)
    q = q.view(rows, nb * block).view(torch.uint8)
    if fmt.bits == 4:  # two's complement nibbles, element 2i low
        q = (q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)
    payload = q[:, : fmt.payload_bytes(numel)]
    packed = x.new_zeros((rows, fmt.row_bytes(numel)), dtype=torch.uint8)
    packed[:, : 4 * nb] = scale.view(torch.uint8)
    packed[:, 4 * nb : 4 * nb + payload.shape[1]] = payload
    return packed


def _dequantize_aten(packed: torch.Tensor, numel: int, fmt: QuantFormat, dtype: torch.dtype) -> torch.Tensor:
    rows = packed.shape[0]
    nb, block = fmt.blocks(numel), fmt.block
    if nb == 0:  # empty rows: no scales to view as fp32 (a zero-width uint8 slice cannot be)
        return torch.empty((rows, 0), dtype=dtype, device=packed.device)
    scale = packed[:, : 4 * nb].contiguous().view(torch.float32)
    payload = packed[:, 4 * nb : 4 * nb + fmt.payload_bytes(numel)]
    if fmt.floating:
        q = payload.contiguous().view(torch.float8_e4m3fn).float()
    elif fmt.bits == 8:
        q = payload.view(torch.int8).float()
    else:
        nibbles = torch.stack((payload & 0xF, payload >> 4), dim=-1).view(rows, -1).float()
        q = nibbles - 16 * (nibbles >= 8).float()
    q = torch.nn.functional.pad(q, (0, nb * block - q.shape[1])).view(rows, nb, block)
    return (q * scale.unsqueeze(-1)).view(rows, nb * block)[:, :numel].to(dtype).contiguous()


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
