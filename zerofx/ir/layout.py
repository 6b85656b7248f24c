"""Shard layout: which rows of a dim-0 sharded tensor each rank holds.

# NOTE: shard layout
Parameters are split along dim 0 with ``torch.chunk`` semantics (the layout of DTensor's
``Shard(0)``): with ``rows = ceil(full_rows / group_size)``, rank r holds rows
``[r*rows, min((r+1)*rows, full_rows))``, possibly none. Padding every shard to ``rows`` rows
makes all-gather inputs equal-sized, and the gathered buffer's first ``full_rows`` rows are then
exactly the full tensor (padding only ever sits after the last real row).

# NOTE: the sharded dim
A parameter with fewer rows than its shard group has ranks (a mixture of experts' stacked
[experts, ffn, d] weights over more ranks than experts) would leave most ranks empty and the
first ones a whole row each: ranks/rows times an even share, every gather and reduce-scatter
moving padded rows. Such a parameter is split along another dim instead (``shard_dim``: the one
whose split pads least; DTensor's ``Shard(k)``, FSDP2's ``shard_placement_fn``). Everything that
splits rows (the markers, the passes, the buckets, the whole-tensor steps) sees the parameter
with that dim moved first (``rows_first``), and its local shard is stored that way round: the
shard is contiguous in that order, so the moved view is a plain contiguous tensor of rows, and
the DTensor's local tensor is its permuted view (``rows_back``). A gathered whole value is
likewise contiguous with the sharded dim first and reaches compute as a permuted view, which
matmuls read with a leading stride; gradients take the one copy into the reduce-scatter's
buffer that every gradient takes.
"""

from __future__ import annotations

import math
from typing import Callable, TypeVar

import torch
import torch.nn.functional as F

T = TypeVar("T")

__all__ = [
    "padded_rows",
    "local_rows",
    "row_offset",
    "pad_rows",
    "pack_consecutive",
    "shard_dim",
    "rows_first",
    "rows_back",
]


def padded_rows(full_rows: int, group_size: int) -> int:
    """Rows of every rank's padded shard."""
    return -(-full_rows // group_size)


def local_rows(full_rows: int, group_size: int, rank: int) -> int:
    """Real (unpadded) rows of ``rank``'s shard under torch.chunk semantics."""
    rows = padded_rows(full_rows, group_size)
    return max(0, min(rows, full_rows - rank * rows))


def row_offset(full_rows: int, group_size: int, rank: int) -> int:
    """First row of ``rank``'s shard (``full_rows`` for a rank holding none)."""
    return min(full_rows, padded_rows(full_rows, group_size) * rank)


def shard_dim(shape: torch.Size, group_size: int) -> int:
    """The dim a parameter of ``shape`` is split along over ``group_size`` ranks (NOTE: the
    sharded dim): 0 when it has at least ``group_size`` rows, else the dim whose torch.chunk
    split pads least (the first such)."""
    if len(shape) < 2 or shape[0] >= group_size:
        return 0
    padded = [padded_rows(size, group_size) * group_size * (math.prod(shape) // max(size, 1)) for size in shape]
    return min(range(len(shape)), key=lambda d: (padded[d], d))


def rows_first(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with its sharded ``dim`` moved first (a view; ``t`` itself when ``dim`` is 0)."""
    return t if dim == 0 else t.movedim(dim, 0)


def rows_back(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``rows_first``'s inverse: the rows dim moved back to ``dim`` (a view)."""
    return t if dim == 0 else t.movedim(0, dim)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero-pad ``t`` along dim 0 up to ``rows`` rows (no copy when already that size)."""
    missing = rows - t.shape[0]
    if missing == 0:
        return t
    return F.pad(t, [0, 0] * (t.dim() - 1) + [0, missing])


def pack_consecutive(items: list[T], nbytes: Callable[[T], int], limit: int) -> list[list[T]]:
    """``items`` in order, cut into runs of at most ``limit`` bytes; an item larger than
    ``limit`` is a run of its own (optimizer windows, export files)."""
    runs: list[list[T]] = []
    used = 0
    for item in items:
        size = nbytes(item)
        if runs and used + size <= limit:
            runs[-1].append(item)
            used += size
        else:
            runs.append([item])
            used = size
    return runs
