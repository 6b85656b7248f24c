"""Block quantization (ZeRO++ qwZ / qgZ): the ops, their Triton kernels, the options' errors.

The error bound of a value is ``absmax / qmax / 2`` of its block (round to nearest), checked
with a relative slack of 1e-6 for the fp32 products ``x · (qmax / absmax)`` and ``q · scale``
(each rounds once, by at most 2^-24 of the block's scale). ATen and the Triton interpreter
must write the same bytes and the same fp32 values; bf16 outputs within one bf16 ulp (the
interpreter truncates where ATen rounds to nearest, as in tests/test_codegen_collectives.py).
Multi-rank behaviour (bytes on the wire, training) is in tests/test_zeropp.py.
"""

from __future__ import annotations

import pytest
import torch

import zerofx  # noqa: F401  (registers the zerofx:: ops)
from zerofx.errors import ZeroFXError
from zerofx.ir.quantize import QuantFormat
from zerofx.options import Options

ops = torch.ops.zerofx
# (rows, values per row, block): full blocks, a partial last block, blocks wider than the row,
# odd rows, a block that is not a power of two
SHAPES = [(3, 1000, 256), (2, 7, 4), (1, 513, 64), (2, 1, 2), (2, 37, 6)]


def _blocks(t: torch.Tensor, rows: int, fmt: QuantFormat) -> torch.Tensor:
    numel = t.numel() // rows
    padded = torch.nn.functional.pad(t.reshape(rows, numel).float(), (0, fmt.blocks(numel) * fmt.block - numel))
    return padded.view(rows, -1, fmt.block)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows,numel,block", SHAPES)
def test_dequantized_values_are_within_half_a_step_of_their_block(bits, rows, numel, block):
    fmt = QuantFormat(bits, block)
    x = torch.randn(rows * numel, generator=torch.Generator().manual_seed(numel)) * 3
    x[: min(numel, block)] = 0  # an all-zero block: scale 0, values exact
    packed = ops.quantize_blockwise(x, rows, block, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, fmt.row_bytes(numel))
    y = ops.dequantize_blockwise(packed, numel, block, bits, torch.float32)
    assert y.shape == (rows, numel)
    absmax = _blocks(x, rows, fmt).abs().amax(-1)
    err = _blocks(y - x.view(rows, numel), rows, fmt).abs().amax(-1)
    assert (err <= absmax / fmt.qmax / 2 * (1 + 1e-6)).all()
    assert y.view(-1)[: min(numel, block)].eq(0).all()
    if numel > 100:  # not vacuous: the error is a real fraction of the step
        assert (err / (absmax / fmt.qmax / 2)).nan_to_num().max() > 0.9


@pytest.mark.parametrize("rows,numel,block", SHAPES)
def test_fp8_values_are_within_float8_rounding_of_their_block(rows, numel, block):
    fmt = QuantFormat(8, block, floating=True)
    x = torch.randn(rows * numel, generator=torch.Generator().manual_seed(numel)) * 3
    packed = ops.quantize_blockwise(x, rows, block, 8, True)
    assert packed.shape == (rows, fmt.row_bytes(numel)) == (rows, QuantFormat(8, block).row_bytes(numel))
    y = ops.dequantize_blockwise(packed, numel, block, 8, torch.float32, True)
    scale = _blocks(x, rows, fmt).abs().amax(-1, keepdim=True) / 448
    # e4m3: 3 mantissa bits, so half an ulp is 2^-4 of the value; below the smallest normal
    # (2^-6) the step is fixed at 2^-9; both in units of the block's scale
    v = _blocks(x, rows, fmt) / scale
    bound = torch.maximum(v.abs() * 2**-4, torch.full_like(v, 2**-10)) * scale * (1 + 1e-5)
    err = _blocks(y - x.view(rows, numel), rows, fmt).abs()
    assert (err <= bound).all()
    if numel > 100:  # not vacuous, and not int8: values are floats, error relative to each value
        assert (err / bound).nan_to_num().max() > 0.5
        assert not torch.equal(
            y, ops.dequantize_blockwise(ops.quantize_blockwise(x, rows, block, 8), numel, block, 8, torch.float32)
        )


@pytest.mark.parametrize("bits,floating", [(8, False), (4, False), (8, True)])
def test_blocks_of_tiny_zero_and_nonfinite_values(bits, floating):
    """A block whose largest magnitude is below ~1e-36 (qmax / absmax overflows fp32) comes back
    as zeros, never NaN or values pushed to +-absmax; an exact zero stays zero; a block holding
    inf or NaN comes back NaN (a loss scaler's overflow check must see it), its neighbours not."""
    blocks = [[1e-38, -1e-42, 0.0, 5e-39], [0.0, 0.0, 0.0, 0.0], [1.0, float("inf"), 0.0, -2.0]]
    blocks += [[float("nan"), 1.0, 0.0, 3.0], [3.0, -1.5, 0.0, 0.25]]
    x = torch.tensor(blocks).view(-1)
    y = ops.dequantize_blockwise(
        ops.quantize_blockwise(x, 1, 4, bits, floating), x.numel(), 4, bits, torch.float32, floating
    )
    y = y.view(len(blocks), 4)
    assert torch.equal(y[0], torch.zeros(4)) and torch.equal(y[1], torch.zeros(4))
    assert y[2].isnan().all() and y[3].isnan().all()
    assert y[4].isfinite().all() and y[4][2] == 0 and (y[4] - x.view(-1, 4)[4]).abs().max() <= 3.0 / 7 / 2 * (1 + 1e-6)


def test_packed_rows_hold_scales_then_payload():
    fmt = QuantFormat(8, 4)
    x = torch.tensor([1.0, -2.0, 0.5, 0.0, 127.0, 1.0])
    packed = ops.quantize_blockwise(x, 1, 4, 8)
    assert fmt.row_bytes(6) == packed.shape[1] == 4 * 2 + 6 + 2  # 2 scales, 6 values, aligned to 4
    scales = packed[0, :8].view(torch.float32)
    assert scales.tolist() == torch.tensor([2.0 / 127, 1.0]).tolist()
    assert packed[0, 8:14].view(torch.int8).tolist() == [64, -127, 32, 0, 127, 1]  # 63.5 rounds up
    assert packed[0, 14:].tolist() == [0, 0]
    int4 = ops.quantize_blockwise(torch.tensor([7.0, -7.0, 1.0]), 1, 4, 4)
    assert int4[0, 4:6].tolist() == [0x97, 0x01]  # 7 low nibble, -7 = 0x9 high; then 1 and a zero nibble


def test_row_bytes_from_numel():
    assert QuantFormat(8, 256).row_bytes(1024) == 1024 + 4 * 4  # a quarter of fp32, plus 4 scales
    assert QuantFormat(4, 256).row_bytes(1024) == 512 + 4 * 4  # an eighth
    assert QuantFormat(4, 256).row_bytes(1) == 8  # 1 byte + 1 scale, aligned


def test_fake_implementations_match_real_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(3, 37)
    real = ops.quantize_blockwise(x, 3, 8, 4)
    with FakeTensorMode() as mode:
        fake = ops.quantize_blockwise(mode.from_tensor(x), 3, 8, 4)
        back = ops.dequantize_blockwise(fake, 37, 8, 4, torch.bfloat16)
    assert fake.shape == real.shape and fake.dtype == real.dtype
    assert back.shape == (3, 37) and back.dtype == torch.bfloat16


SEGMENTS = [5, 30, 1, 17, 0, 9]  # pieces of a row (a bucket's members): odd, empty, under and over a block


def _pieces(rows: int, scale_by: float = 100.0) -> torch.Tensor:
    """Rows whose pieces differ in magnitude by ``scale_by`` from one to the next."""
    g = torch.Generator().manual_seed(3)
    return torch.cat(
        [torch.randn(rows, n, generator=g) * scale_by ** (k % 3 - 1) for k, n in enumerate(SEGMENTS)], dim=1
    )


@pytest.mark.parametrize("floating,bits", [(False, 8), (False, 4), (True, 8)])
def test_segments_are_quantized_in_blocks_of_their_own(floating, bits):
    """(NOTE: segments) A row of pieces quantizes each piece as if it were a row of its own: the
    small pieces keep their values instead of rounding to zero beside a larger neighbour."""
    rows, block = 3, 8
    x = _pieces(rows)
    numel = x.shape[1]
    packed = ops.quantize_blockwise(x.reshape(-1), rows, block, bits, floating, SEGMENTS)
    # 11 scales (each piece's own blocks of 8: 1 + 4 + 1 + 3 + 0 + 2), then the pieces end to end:
    # int8 62 bytes (108 with the scales, to 4); int4 pieces but the last even, 65 values, 33 bytes
    assert packed.shape == (rows, 108 if bits == 8 else 80)
    back = ops.dequantize_blockwise(packed, numel, block, bits, torch.float32, floating, SEGMENTS)
    one_by_one, at = [], 0
    for n in SEGMENTS:
        piece = x[:, at : at + n].contiguous()
        q = ops.quantize_blockwise(piece, rows, block, bits, floating)
        one_by_one.append(ops.dequantize_blockwise(q, n, block, bits, torch.float32, floating))
        at += n
    assert torch.equal(back, torch.cat(one_by_one, dim=1))
    across = ops.dequantize_blockwise(
        ops.quantize_blockwise(x, rows, block, bits, floating), numel, block, bits, torch.float32, floating
    )
    assert not torch.equal(across, back)  # the blocks that cross pieces scale the small ones by the large


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("bits", [8, 4])
def test_triton_kernels_write_the_bytes_aten_writes_for_segments(bits):
    from zerofx.codegen.quantize_kernels import dequantize_triton, quantize_triton

    rows, block, x = 2, 8, _pieces(2)
    packed = ops.quantize_blockwise(x, rows, block, bits, False, SEGMENTS)
    assert torch.equal(quantize_triton(x, rows, block, bits, False, SEGMENTS), packed)
    want = ops.dequantize_blockwise(packed, x.shape[1], block, bits, torch.float32, False, SEGMENTS)
    assert torch.equal(dequantize_triton(packed, x.shape[1], block, bits, torch.float32, False, SEGMENTS), want)


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows,numel,block", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_write_the_bytes_aten_writes(bits, rows, numel, block, dtype):
    from zerofx.codegen.quantize_kernels import dequantize_triton, quantize_triton

    x = (torch.randn(rows * numel, generator=torch.Generator().manual_seed(block)) * 5).to(dtype)
    x[:3] = 0
    if dtype is torch.float32:  # (the interpreter reads bf16 subnormals otherwise than ATen: scales differ)
        x[-min(block, numel) :] *= 1e-39  # a last block too small for qmax / absmax in fp32: zeros
    packed = ops.quantize_blockwise(x, rows, block, bits)
    assert torch.equal(quantize_triton(x, rows, block, bits), packed)
    want = ops.dequantize_blockwise(packed, numel, block, bits, dtype)
    got = dequantize_triton(packed, numel, block, bits, dtype)
    if dtype is torch.float32:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=8e-3, atol=0)


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("bits", [8, 4])
def test_triton_kernels_keep_nan_and_inf_blocks_as_aten_does(bits):
    """tl.max / tl.maximum drop NaN: a block holding NaN must still get a NaN scale and the
    payload ATen writes (0 for a NaN or inf value), so the dequantized block is NaN on both."""
    from zerofx.codegen.quantize_kernels import dequantize_triton, quantize_triton

    nan, inf = float("nan"), float("inf")
    blocks = [[nan, 1.0, -2.0, 0.5], [1.0, 2.0, 3.0, 4.0], [inf, 1.0, 0.0, -2.0], [-inf, 3.0, 1.0, 0.0]]
    blocks += [[1.0, nan, inf, 2.0], [0.5, -0.5, 2.0, -nan], [-1.0, 0.25, 0.0, 2.0]]
    x = torch.tensor(blocks).view(-1)
    for rows in (1, 7):
        packed = ops.quantize_blockwise(x, rows, 4, bits)
        assert torch.equal(quantize_triton(x, rows, 4, bits), packed)
        numel = x.numel() // rows
        want = ops.dequantize_blockwise(packed, numel, 4, bits, torch.float32).view(-1, 4)
        got = dequantize_triton(packed, numel, 4, bits, torch.float32).view(-1, 4)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
        assert want[[0, 2, 3, 4, 5]].isnan().all() and want[[1, 6]].isfinite().all()


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("bits", [8, 4])
def test_empty_rows_and_rows_that_do_not_split_evenly(bits):
    from zerofx.codegen.quantize_kernels import dequantize_triton, quantize_triton

    for quantize, dequantize in (
        (ops.quantize_blockwise, ops.dequantize_blockwise),
        (quantize_triton, dequantize_triton),
    ):
        packed = quantize(torch.randn(0), 2, 4, bits)
        assert packed.shape == (2, 0)
        back = dequantize(packed, 0, 4, bits, torch.bfloat16)
        assert back.shape == (2, 0) and back.dtype == torch.bfloat16
        with pytest.raises(ValueError, match="7 values do not make 2 equal rows"):
            quantize(torch.randn(7), 2, 4, bits)


# --- options: one clear error each, naming the option ---------------------------------------


@pytest.mark.parametrize(
    "options,names",
    [
        (dict(quantize_grads="int4", quantize_block=255), "quantize_block=255"),
        (dict(quantize_weights="int8", stage=2), "quantize_weights='int8'"),
        (dict(quantize_grads="int8", stage=1), "quantize_grads='int8'"),
        (dict(quantize_weights="int8", stage=1), "quantize_weights='int8'"),
        (dict(quantize_weights="fp8", stage=2), "quantize_weights='fp8'"),
        (dict(quantize_weights="int4"), "quantize_weights='int4'"),
        (dict(quantize_grads="fp16"), "quantize_grads='fp16'"),
        (dict(quantize_block=0), "quantize_block=0"),
        (dict(secondary_shard=True, stage=2), "secondary_shard=True"),
    ],
)
def test_bad_quantization_options_raise_one_error_naming_the_option(options, names):
    with pytest.raises(ZeroFXError, match="option " + names.replace("(", r"\(")) as e:
        Options.from_kwargs(**options)
    assert len(str(e.value).splitlines()) == 1


def test_int8_with_an_odd_block_is_fine_and_the_pass_can_be_disabled_by_name():
    from zerofx.passes.pipeline import PASS_NAMES, resolve_disabled

    Options.from_kwargs(quantize_weights="int8", quantize_grads="int8", quantize_block=255)
    assert PASS_NAMES.index("quantize") == PASS_NAMES.index("transport") - 1
    assert resolve_disabled(("quantize",)) == ("quantize",)


@pytest.mark.parametrize("rows,numel,block", [(2, 1 << 16, 256), (1, 513, 64), (3, 1000, 256), (2, 37, 6)])
@pytest.mark.parametrize("option", ["int8", "int4", "fp8"])
def test_the_workspace_estimate_is_what_the_ops_allocate_above_their_outputs(rows, numel, block, option):
    """NOTE: quantize workspace: the bytes quantize / dequantize hold above their outputs while
    they run, as the allocator sees them, are what the cost model adds at their nodes, never more
    than ``SCALAR_TEMPS`` over (0-dim tensors torch wraps scalars in). The ATen bodies once held
    three fp32 copies of the bucket (quantizing 4 MiB of fp32 peaked at 12.6 MB for a 1 MB output)."""
    from zerofx.ir.quantize import (
        SCALAR_TEMPS,
        dequantize_workspace_bytes,
        quant_format,
        quantize_workspace_bytes,
    )
    from zerofx.measure.allocations import AllocationTrace

    def above_output(fn):
        with AllocationTrace() as trace:
            t0 = trace.mark()
            out = fn()
            t1 = trace.mark()
        return trace.peak_between(t0, t1) - trace.live_at(t0) - out.numel() * out.element_size(), out

    fmt = quant_format(option, block)
    bits, floating = fmt.bits, fmt.floating
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(rows * numel, generator=torch.Generator().manual_seed(numel)) * 3).to(dtype)
        measured, packed = above_output(lambda: ops.quantize_blockwise(x, rows, block, bits, floating))
        planned = quantize_workspace_bytes(rows * numel, rows, fmt)
        assert measured <= planned <= measured + SCALAR_TEMPS, (dtype, measured, planned)
        measured, _ = above_output(lambda: ops.dequantize_blockwise(packed, numel, block, bits, dtype, floating))
        planned = dequantize_workspace_bytes(rows, numel, fmt, dtype)
        assert measured <= planned <= measured + SCALAR_TEMPS, (dtype, measured, planned)
    if numel > 1000:  # one fp32 buffer of the bucket (int4: and an int8 copy), not three
        assert quantize_workspace_bytes(rows * numel, rows, fmt) < (1.3 if bits == 4 else 1.1) * 4 * rows * numel
    if numel in (37, 1000):  # a bucket's row of pieces (NOTE: segments)
        segments = [5, 13, 0, 19] if numel == 37 else [3, 500, 1, 496]
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(rows * numel, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
            measured, packed = above_output(lambda: ops.quantize_blockwise(x, rows, block, bits, floating, segments))
            planned = quantize_workspace_bytes(rows * numel, rows, fmt, segments)
            assert measured <= planned <= measured + SCALAR_TEMPS, (dtype, measured, planned)
            measured, _ = above_output(
                lambda: ops.dequantize_blockwise(packed, numel, block, bits, dtype, floating, segments)
            )
            planned = dequantize_workspace_bytes(rows, numel, fmt, dtype, segments)
            assert measured <= planned <= measured + SCALAR_TEMPS, (dtype, measured, planned)


def test_the_workspace_of_symbolic_sizes_bounds_every_size():
    """A symbolic bucket (sizes traced as symbols) gets a polynomial that is never below the
    exact count at any size: what the planner solves the largest batch with."""
    import sympy

    from zerofx.ir.quantize import dequantize_workspace_bytes, quant_format, quantize_workspace_bytes

    s = sympy.Symbol("s0", positive=True, integer=True)
    for option in ("int8", "int4", "fp8"):
        fmt = quant_format(option, 6)
        q, d = quantize_workspace_bytes(2 * s, 2, fmt), dequantize_workspace_bytes(2, s, fmt, torch.bfloat16)
        assert sympy.Poly(q, s) and sympy.Poly(d, s)
        for n in (1, 5, 6, 7, 1000, 4099):
            assert q.subs(s, n) >= quantize_workspace_bytes(2 * n, 2, fmt)
            assert d.subs(s, n) >= dequantize_workspace_bytes(2, n, fmt, torch.bfloat16)
