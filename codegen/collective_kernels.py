"""Collective glue: the copies around a bucketed all-gather and reduce-scatter, one launch each.

A bucket is a list of parameters whose collectives run as one. On every rank its flat buffer
holds one *slot* per parameter, slots in parameter order; a slot holds that rank's dim-0 shard
padded to ``ceil(rows / N)`` rows (the layout of ``zerofx.ir.layout``, NOTE: shard layout)::

    rank k's segment:   [ p0 shard k | pad ][ p1 shard k | pad ] ...     (``segment`` elements)
    all-gather output:  [ segment of rank 0 ][ segment of rank 1 ] ...  (N * segment)

Four kernels move data in and out of that layout, each one launch for the whole bucket:

    pack_shards          shards -> this rank's segment, cast to the wire dtype, pads zeroed
    unpack_gathered      all-gather output -> every full parameter, as views of one buffer
    pack_grads           full gradients -> reduce-scatter input (rank-major segments)
    average_into_shards  reduce-scatter output -> each shard's gradient, scaled by 1/N
                         (the "avg" of a sum reduce-scatter), cast, optionally accumulated

The graphs do not call them yet: the ``bucket`` pass (passes/bucket.py) copies in and out of its
buckets with the ATen ops of torch's bucketing surgery, which these one-launch kernels could
replace on a GPU, where a bucket's per-parameter copies are many small launches (docs/codegen.md).
Tests check them against per-parameter ATen collectives on real gloo ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import triton.language as tl

from zerofx.codegen.multi_tensor import BLOCK, addresses, blocks_for, int_table, jit, local, tl_dtype
from zerofx.ir.layout import local_rows, padded_rows


@dataclass(frozen=True)
class BucketLayout:
    """Where every parameter of a bucket sits in the flat collective buffers."""

    shapes: tuple[tuple[int, ...], ...]  # full (unsharded) parameter shapes
    group_size: int

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]], group_size: int) -> BucketLayout:
        return cls(tuple(tuple(s) for s in shapes), group_size)

    def row_numel(self, i: int) -> int:
        return math.prod(self.shapes[i][1:])

    def numel(self, i: int) -> int:
        return math.prod(self.shapes[i])

    @property
    def slots(self) -> tuple[int, ...]:
        """Elements of each parameter's padded shard."""
        return tuple(padded_rows(s[0], self.group_size) * self.row_numel(i) for i, s in enumerate(self.shapes))

    @property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for slot in self.slots:
            out.append(acc)
            acc += slot
        return tuple(out)

    @property
    def segment(self) -> int:
        return sum(self.slots)

    def shard_numel(self, i: int, rank: int) -> int:
        return local_rows(self.shapes[i][0], self.group_size, rank) * self.row_numel(i)

    def shard_shape(self, i: int, rank: int) -> tuple[int, ...]:
        return (local_rows(self.shapes[i][0], self.group_size, rank), *self.shapes[i][1:])


def _pack_shards_kernel(
    dst, src_ptrs, numels, slots, offsets, block_tensor, block_start, SRC: tl.constexpr, BLOCK: tl.constexpr
):
    b = tl.program_id(0)
    t = tl.load(block_tensor + b)
    e = tl.load(block_start + b) + tl.arange(0, BLOCK)
    src = tl.load(src_ptrs + t).to(tl.pointer_type(SRC))
    x = tl.load(src + e, mask=e < tl.load(numels + t), other=0.0)  # rows past the shard: padding
    tl.store(dst + tl.load(offsets + t) + e, x.to(dst.dtype.element_ty), mask=e < tl.load(slots + t))


def _unpack_kernel(
    out, gathered, numels, slots, src_offsets, dst_offsets, block_tensor, block_start, segment, BLOCK: tl.constexpr
):
    b = tl.program_id(0)
    t = tl.load(block_tensor + b)
    e = tl.load(block_start + b) + tl.arange(0, BLOCK)
    mask = e < tl.load(numels + t)
    slot = tl.load(slots + t)
    rank = e // slot  # element e of the full parameter came from this rank's segment
    x = tl.load(gathered + rank * segment + tl.load(src_offsets + t) + e % slot, mask=mask)
    tl.store(out + tl.load(dst_offsets + t) + e, x.to(out.dtype.element_ty), mask=mask)


def _pack_grads_kernel(
    dst,
    src_ptrs,
    numels,
    slots,
    offsets,
    block_tensor,
    block_start,
    segment,
    group_size,
    SRC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    t = tl.load(block_tensor + b)
    e = tl.load(block_start + b) + tl.arange(0, BLOCK)
    slot = tl.load(slots + t)
    src = tl.load(src_ptrs + t).to(tl.pointer_type(SRC))
    x = tl.load(src + e, mask=e < tl.load(numels + t), other=0.0)
    rank = e // slot  # rows [rank*r, (rank+1)*r) of the padded gradient go to that rank
    tl.store(
        dst + rank * segment + tl.load(offsets + t) + e % slot, x.to(dst.dtype.element_ty), mask=e < slot * group_size
    )


def _average_kernel(
    reduced,
    dst_ptrs,
    numels,
    offsets,
    block_tensor,
    block_start,
    scale,
    DST: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    t = tl.load(block_tensor + b)
    e = tl.load(block_start + b) + tl.arange(0, BLOCK)
    mask = e < tl.load(numels + t)
    g = tl.load(reduced + tl.load(offsets + t) + e, mask=mask, other=0.0).to(tl.float32) * scale
    dst = tl.load(dst_ptrs + t).to(tl.pointer_type(DST))
    if ACCUMULATE:
        g += tl.load(dst + e, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + e, g.to(DST), mask=mask)


def _same_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"one launch needs one dtype per tensor list, got {sorted(map(str, dtypes))}")
    return dtypes.pop()


def _check_bucket(what: str, tensors: Sequence[torch.Tensor], layout: BucketLayout, most: Sequence[int]) -> None:
    """One tensor per parameter of ``layout``, tensor ``i`` of at most ``most[i]`` elements: the
    kernels mask by the layout's sizes, so a larger tensor would be silently cut short."""
    if not tensors:
        raise ValueError(f"{what}: no tensors (a bucket holds at least one parameter)")
    if len(tensors) != len(layout.shapes):
        raise ValueError(f"{what}: {len(tensors)} tensors for a bucket of {len(layout.shapes)} parameters")
    for i, (t, n) in enumerate(zip(tensors, most)):
        if t.numel() > n:
            raise ValueError(f"{what}: tensor {i} has {t.numel()} elements, its parameter's slot holds {n}")


def pack_shards(shards: Sequence[torch.Tensor], layout: BucketLayout, dtype: torch.dtype | None = None) -> torch.Tensor:
    """This rank's all-gather input: every shard cast to ``dtype`` in its zero-padded slot."""
    shards = [local(s).contiguous() for s in shards]
    _check_bucket("pack_shards", shards, layout, layout.slots)
    src_dtype = _same_dtype(shards)
    device = shards[0].device
    out = torch.empty(layout.segment, dtype=dtype or src_dtype, device=device)
    blocks = blocks_for(layout.slots, device)
    jit(_pack_shards_kernel)[(blocks.count,)](
        out,
        addresses(shards, device),
        int_table([s.numel() for s in shards], device),
        int_table(layout.slots, device),
        int_table(layout.offsets, device),
        blocks.tensor,
        blocks.start,
        SRC=tl_dtype(src_dtype),
        BLOCK=BLOCK,
    )
    return out


def unpack_gathered(
    gathered: torch.Tensor, layout: BucketLayout, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """Every full parameter from an all-gather output, as views of one new flat buffer."""
    if gathered.numel() != layout.segment * layout.group_size:
        raise ValueError(f"gathered has {gathered.numel()} elements, layout needs {layout.segment * layout.group_size}")
    device = gathered.device
    numels = [layout.numel(i) for i in range(len(layout.shapes))]
    dst_offsets = [sum(numels[:i]) for i in range(len(numels))]
    out = torch.empty(sum(numels), dtype=dtype or gathered.dtype, device=device)
    blocks = blocks_for(numels, device)
    if blocks.count:
        jit(_unpack_kernel)[(blocks.count,)](
            out,
            gathered.contiguous(),
            int_table(numels, device),
            int_table(layout.slots, device),
            int_table(layout.offsets, device),
            int_table(dst_offsets, device),
            blocks.tensor,
            blocks.start,
            layout.segment,
            BLOCK=BLOCK,
        )
    return [out[o : o + n].view(shape) for o, n, shape in zip(dst_offsets, numels, layout.shapes)]


def pack_grads(grads: Sequence[torch.Tensor], layout: BucketLayout, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The reduce-scatter input: each full gradient padded and split into every rank's segment."""
    grads = [local(g).contiguous() for g in grads]
    _check_bucket("pack_grads", grads, layout, [layout.numel(i) for i in range(len(layout.shapes))])
    src_dtype = _same_dtype(grads)
    device = grads[0].device
    out = torch.empty(layout.segment * layout.group_size, dtype=dtype or src_dtype, device=device)
    totals = [slot * layout.group_size for slot in layout.slots]
    blocks = blocks_for(totals, device)
    jit(_pack_grads_kernel)[(blocks.count,)](
        out,
        addresses(grads, device),
        int_table([g.numel() for g in grads], device),
        int_table(layout.slots, device),
        int_table(layout.offsets, device),
        blocks.tensor,
        blocks.start,
        layout.segment,
        layout.group_size,
        SRC=tl_dtype(src_dtype),
        BLOCK=BLOCK,
    )
    return out


def average_into_shards(
    reduced: torch.Tensor,
    layout: BucketLayout,
    rank: int,
    grads: Sequence[torch.Tensor | None] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    scale: float | None = None,
) -> list[torch.Tensor]:
    """Each shard's gradient from a sum reduce-scatter output: ``grad (+)= reduced * scale``.

    ``scale`` defaults to ``1 / group_size`` (the average). Where ``grads[i]`` is a tensor the
    result is accumulated into it in place (it is returned); where it is None (or ``grads`` is
    None) a new gradient of ``dtype`` is written. Accumulating and fresh gradients take one
    launch each.
    """
    if reduced.numel() != layout.segment:
        raise ValueError(f"reduced has {reduced.numel()} elements, layout's segment is {layout.segment}")
    count = len(layout.shapes)
    grads = list(grads) if grads is not None else [None] * count
    scale = 1.0 / layout.group_size if scale is None else scale
    device = reduced.device
    results: list[torch.Tensor | None] = [None] * count
    fresh = [i for i in range(count) if grads[i] is None]
    for i in fresh:
        results[i] = torch.empty(layout.shard_shape(i, rank), dtype=dtype, device=device)
    for i in range(count):
        if grads[i] is not None:
            results[i] = grads[i]
    for indices, accumulate in ((fresh, False), ([i for i in range(count) if grads[i] is not None], True)):
        if not indices:
            continue
        targets = [local(results[i]) for i in indices]
        numels = [layout.shard_numel(i, rank) for i in indices]
        for i, t in zip(indices, targets):
            if t.numel() != layout.shard_numel(i, rank):
                raise ValueError(
                    f"gradient {i} has {t.numel()} elements, rank {rank}'s shard has {layout.shard_numel(i, rank)}"
                )
        blocks = blocks_for(numels, device)
        if not blocks.count:
            continue
        jit(_average_kernel)[(blocks.count,)](
            reduced.contiguous(),
            addresses(targets, device),
            int_table(numels, device),
            int_table([layout.offsets[i] for i in indices], device),
            blocks.tensor,
            blocks.start,
            scale,
            DST=tl_dtype(_same_dtype(targets)),
            ACCUMULATE=accumulate,
            BLOCK=BLOCK,
        )
    return results  # type: ignore[return-value]
