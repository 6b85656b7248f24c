"""Shard layout: which rows of a dim-0 sharded tensor each rank holds.

# NOTE: shard layout
Parameters are split along dim 0 with ``torch.chunk`` semantics (the layout of DTensor's
``Shard(0)``): with ``rows = ceil(full_rows / group_size)``, rank r holds rows
``[r*rows, min((r+1)*rows, full_rows))``, possibly none. Padding every shard to ``rows`` rows
makes all-gather inputs equal-sized, and the gathered buffer's first ``full_rows`` rows are then
exactly the full tensor (padding only ever sits after the last real row).
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.nn.functional as F

T = TypeVar("T")

__all__ = ["padded_rows", "local_rows", "row_offset", "pad_rows", "pack_consecutive"]


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
