"""The collective glue kernels (pack, unpack, average+accumulate) against per-parameter ATen.

Two ways: in one process, with the collectives written out (concatenation for all-gather, a
sum and a slice for reduce-scatter) so three ranks with uneven and empty shards are cheap; and
on two gloo ranks around the real functional collectives, compared with the per-parameter
path zerofx's passes emit today (tests/codegen_ranks.py).

Tolerances: fp32 copies are exact; bf16 on the wire matches ``tensor.bfloat16()`` to one bf16
ulp (rtol 8e-3: the interpreter truncates where ATen rounds to nearest); averaged gradients
rtol/atol 1e-6 (``sum * (1/N)`` vs ATen's ``sum / N``).
"""

from __future__ import annotations

import pytest
import torch

from tests.parity import reference_shard
from zerofx.codegen.collective_kernels import (
    BucketLayout,
    average_into_shards,
    pack_grads,
    pack_shards,
    unpack_gathered,
)

pytestmark = pytest.mark.usefixtures("triton_interpreter")

SHAPES = [(7, 5), (4,), (3, 1, 3), (1, 2), (1100,)]
GRAD_TOL = dict(rtol=1e-6, atol=1e-6)
BF16_TOL = dict(rtol=8e-3, atol=1e-6)


def test_layout_slots_and_offsets():
    layout = BucketLayout.of(SHAPES, 3)
    assert layout.slots == (3 * 5, 2, 1 * 3, 1 * 2, 367)
    assert layout.offsets == (0, 15, 17, 20, 22)
    assert layout.segment == 389
    assert [layout.shard_numel(3, r) for r in range(3)] == [2, 0, 0]  # 1 row over 3 ranks


def test_glue_kernels_with_simulated_collectives_on_three_ranks():
    n = 3
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=gen) for s in SHAPES]
    layout = BucketLayout.of(SHAPES, n)

    segments = [pack_shards([reference_shard(t, r, n) for t in full], layout) for r in range(n)]
    for seg in segments:
        assert seg.shape == (layout.segment,)
    for got, want in zip(unpack_gathered(torch.cat(segments), layout), full):  # all-gather = concatenation
        assert torch.equal(got, want)
    views = unpack_gathered(torch.cat(segments), layout)
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1  # views of one buffer

    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(n)]
    summed = sum(pack_grads(g, layout) for g in grads)  # reduce-scatter = sum, then rank r's segment
    for r in range(n):
        reduced = summed[r * layout.segment : (r + 1) * layout.segment]
        existing = [torch.randn(layout.shard_shape(i, r), generator=gen) if i % 2 else None for i in range(len(SHAPES))]
        before = [e.clone() if e is not None else None for e in existing]
        got = average_into_shards(reduced, layout, r, existing)
        for i in range(len(SHAPES)):
            want = reference_shard(sum(g[i] for g in grads) / n, r, n)
            if before[i] is not None:
                want = want + before[i]
                assert got[i] is existing[i]
            assert got[i].shape == want.shape
            torch.testing.assert_close(got[i], want, **GRAD_TOL)


def test_glue_kernels_refuse_what_their_layout_cannot_hold():
    """The kernels mask by the layout's sizes: a tensor larger than its slot would be cut short
    silently, so it is refused; so are an empty list and dtypes the kernels cannot move."""
    layout = BucketLayout.of([(4,), (4,)], 2)
    with pytest.raises(ValueError, match="no tensors"):
        pack_shards([], layout)
    with pytest.raises(ValueError, match="tensor 0 has 5 elements, its parameter's slot holds 2"):
        pack_shards([torch.randn(5), torch.randn(2)], layout)
    with pytest.raises(ValueError, match="1 tensors for a bucket of 2"):
        pack_shards([torch.randn(2)], layout)
    with pytest.raises(ValueError, match="tensor 1 has 6 elements"):
        pack_grads([torch.randn(4), torch.randn(6)], layout)
    with pytest.raises(ValueError, match="not torch.int64"):
        pack_shards([torch.arange(2), torch.arange(2)], layout)


def test_glue_kernels_around_gloo_collectives(codegen_runs):
    for rank, result in enumerate(r["bucket"] for r in codegen_runs(2)[0]):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
        for got, want in result["gathered"]:
            assert torch.equal(got, want)
        for got, want in result["gathered_bf16"]:
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want.float(), **BF16_TOL)
        for got, want in result["grads"]:
            torch.testing.assert_close(got, want, **GRAD_TOL)
        assert result["accumulated_in_place"]
