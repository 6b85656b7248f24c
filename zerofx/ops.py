"""Marker ops: the distributed semantics of a sharded parameter, in one home.

A sharded parameter enters the model's computation through ``zerofx::unshard``; its gradient
leaves through ``zerofx::reduce_grad`` (the registered backward of ``unshard``). Dynamo and
AOTAutograd trace these as opaque custom ops, so the captured graphs say *what* must happen
("this shard is needed whole here", "this full gradient belongs to that shard") and the passes
decide *how and when*: ``gather`` lowers ``unshard`` into an asynchronous all-gather + wait,
``reduce`` lowers ``reduce_grad`` into a reduce-scatter landing in the shard, ``free`` makes the
partitioner re-run ``unshard`` in the backward instead of saving its result.

Both ops also have real eager implementations (functional collectives, waited at once). That
is what makes every pass optional and every fallback correct: eager execution, a graph break,
or a disabled pass all run these implementations and give the same numbers.

# NOTE: shard layout
Parameters are split along dim 0 with ``torch.chunk`` semantics (the layout of DTensor's
``Shard(0)``): with ``rows = ceil(full_rows / group_size)``, rank r holds rows
``[r*rows, min((r+1)*rows, full_rows))``, possibly none. Padding every shard to ``rows`` rows
makes all-gather inputs equal-sized, and the gathered buffer's first ``full_rows`` rows are then
exactly the full tensor (padding only ever sits after the last real row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zerofx.metrics import record_collectives, wire_bytes

__all__ = ["padded_rows", "local_rows", "unshard", "reduce_grad"]


def padded_rows(full_rows: int, group_size: int) -> int:
    """Rows of every rank's padded shard."""
    return -(-full_rows // group_size)


def local_rows(full_rows: int, group_size: int, rank: int) -> int:
    """Real (unpadded) rows of ``rank``'s shard under torch.chunk semantics."""
    rows = padded_rows(full_rows, group_size)
    return max(0, min(rows, full_rows - rank * rows))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero-pad ``t`` along dim 0 up to ``rows`` rows (no copy when already that size)."""
    missing = rows - t.shape[0]
    if missing == 0:
        return t
    return F.pad(t, [0, 0] * (t.dim() - 1) + [0, missing])


@torch.library.custom_op("zerofx::unshard", mutates_args=())
def unshard(shard: torch.Tensor, group_size: int, group_name: str, full_rows: int) -> torch.Tensor:
    """The full parameter gathered from every rank's dim-0 shard."""
    rows = padded_rows(full_rows, group_size)
    padded = pad_rows(shard, rows).contiguous()
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(padded, group_size, group_name)
    gathered = torch.ops._c10d_functional.wait_tensor(gathered)
    record_collectives([("all_gather", wire_bytes("all_gather", _nbytes(gathered), group_size))])
    return gathered[:full_rows]  # a view of a fresh buffer, not of an input: allowed


@unshard.register_fake
def _unshard_fake(shard, group_size, group_name, full_rows):
    return shard.new_empty((full_rows, *shard.shape[1:]))


@torch.library.custom_op("zerofx::reduce_grad", mutates_args=())
def reduce_grad(grad: torch.Tensor, group_size: int, group_name: str, shard_rows: int) -> torch.Tensor:
    """This rank's shard of the gradient averaged over the group."""
    rows = padded_rows(grad.shape[0], group_size)
    padded = pad_rows(grad, rows * group_size).contiguous()
    reduced = torch.ops._c10d_functional.reduce_scatter_tensor(padded, "avg", group_size, group_name)
    reduced = torch.ops._c10d_functional.wait_tensor(reduced)
    record_collectives([("reduce_scatter", wire_bytes("reduce_scatter", _nbytes(padded), group_size))])
    return reduced[:shard_rows]


@reduce_grad.register_fake
def _reduce_grad_fake(grad, group_size, group_name, shard_rows):
    return grad.new_empty((shard_rows, *grad.shape[1:]))


def _unshard_setup_context(ctx, inputs, output):
    shard, group_size, group_name, _ = inputs
    ctx.layout = (group_size, group_name, shard.shape[0])


def _unshard_backward(ctx, grad):
    group_size, group_name, shard_rows = ctx.layout
    return torch.ops.zerofx.reduce_grad(grad, group_size, group_name, shard_rows), None, None, None


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)

UNSHARD = torch.ops.zerofx.unshard.default
REDUCE_GRAD = torch.ops.zerofx.reduce_grad.default
