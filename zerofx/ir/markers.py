"""Marker ops: the distributed semantics of a parameter, in one home.

A parameter enters the model's computation through one *forward marker*; its gradient leaves
through the forward marker's registered backward, which is itself a marker or a plain local
gradient. Dynamo and AOTAutograd trace them as opaque custom ops, so the captured graphs say
*what* must happen and the passes decide *how and when*:

    forward marker                          where the full value comes from   gradient route
    unshard(shard, ...)                     all-gather of dim-0 shards        reduce_grad: reduce-scatter
    read_full(shard, full, ...)             this rank's whole copy ``full``   reduce_grad: reduce-scatter
    sync_grad(x, ...)                       ``x`` is whole already            all_reduce_grad: all-reduce
    local_grad(x, sink)                     ``x``                             kept local in ``sink.grad``

ZeRO stages, the persistence threshold, hybrid sharding and gradient accumulation are
compositions of these markers (see ``zerofx.runtime.params`` NOTE: markers per stage): stage 3 reads
``unshard``, stage 2 ``read_full``, stage 1 and no-sync micro-batches ``local_grad``, small
parameters ``sync_grad``; a 2-D mesh wraps the shard in ``sync_grad`` over the replicate group.
``gather`` lowers the forward markers (an all-gather, or nothing at all), ``reduce`` lowers the
gradient markers into collectives, ``regather`` makes the partitioner re-run forward markers in the
backward instead of saving their results.

Every marker has a real eager implementation (functional collectives, waited at once; the
identity markers copy, as custom ops may not return their inputs). That is what makes every
pass optional and every fallback correct: eager execution, a graph break, or a disabled pass
all run these implementations and give the same numbers.

Mixed precision lives in the markers' dtype arguments, so the casts sit on the right side of
each collective: ``unshard`` casts the shard to ``compute_dtype`` *before* the all-gather (half
the bytes for bf16), gradient markers cast to ``reduce_dtype`` before reducing and to the
parameter's (master) dtype after.

The shard layout the markers assume is zerofx.ir.layout's (NOTE: shard layout).
"""

from __future__ import annotations

from typing import Optional

import torch

from zerofx.ir.collectives import all_gather, record_collectives, wire_bytes
from zerofx.ir.layout import pad_rows, padded_rows

__all__ = [
    "unshard",
    "reduce_grad",
    "read_full",
    "sync_grad",
    "all_reduce_grad",
    "local_grad",
    "FORWARD_MARKERS",
    "GRAD_MARKERS",
]

_F = torch.ops._c10d_functional


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


# --- unshard / reduce_grad: a dim-0 sharded parameter ------------------------------------------


@torch.library.custom_op("zerofx::unshard", mutates_args=())
def unshard(
    shard: torch.Tensor,
    group_size: int,
    group_name: str,
    full_rows: int,
    compute_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    secondary_size: int = 0,
    secondary_name: str = "",
) -> torch.Tensor:
    """The full parameter gathered from every rank's dim-0 shard (cast to ``compute_dtype`` first).

    ``secondary_size`` / ``secondary_name`` (hpZ, ``Options.secondary_shard``): the group (the
    inner dimension of a 2-D mesh) whose partition of the result this rank keeps for the
    backward's re-gather (passes/secondary.py). Eagerly nothing is kept: a backward outside the
    compiled graphs gathers over ``group_name`` again, as without hpZ."""
    rows = padded_rows(full_rows, group_size)
    padded = pad_rows(_cast(shard, compute_dtype), rows).contiguous()
    gathered = all_gather(padded, group_size, group_name)
    gathered = _F.wait_tensor(gathered)
    record_collectives([("all_gather", wire_bytes("all_gather", _nbytes(gathered), group_size), group_name)])
    return gathered[:full_rows]  # a view of a fresh buffer, not of an input: allowed


@unshard.register_fake
def _unshard_fake(
    shard, group_size, group_name, full_rows, compute_dtype=None, reduce_dtype=None, secondary_size=0, secondary_name=""
):
    return shard.new_empty((full_rows, *shard.shape[1:]), dtype=compute_dtype or shard.dtype)


@torch.library.custom_op("zerofx::reduce_grad", mutates_args=())
def reduce_grad(
    grad: torch.Tensor,
    group_size: int,
    group_name: str,
    shard_rows: int,
    reduce_dtype: Optional[torch.dtype] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """This rank's shard of the gradient averaged over the group, reduced in ``reduce_dtype``."""
    rows = padded_rows(grad.shape[0], group_size)
    padded = pad_rows(_cast(grad, reduce_dtype), rows * group_size).contiguous()
    reduced = _F.reduce_scatter_tensor(padded, "avg", group_size, group_name)
    reduced = _F.wait_tensor(reduced)
    record_collectives([("reduce_scatter", wire_bytes("reduce_scatter", _nbytes(padded), group_size), group_name)])
    out = reduced[:shard_rows]
    return out.to(out_dtype) if out_dtype is not None and out_dtype != out.dtype else out


@reduce_grad.register_fake
def _reduce_grad_fake(grad, group_size, group_name, shard_rows, reduce_dtype=None, out_dtype=None):
    return grad.new_empty((shard_rows, *grad.shape[1:]), dtype=out_dtype or reduce_dtype or grad.dtype)


def _unshard_setup_context(ctx, inputs, output):
    shard, group_size, group_name, _, _, reduce_dtype = inputs[:6]
    ctx.layout = (group_size, group_name, shard.shape[0], reduce_dtype, shard.dtype)


def _unshard_backward(ctx, grad):
    return torch.ops.zerofx.reduce_grad(grad, *ctx.layout), None, None, None, None, None, None, None


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)


# --- read_full: a sharded parameter whose whole copy this rank keeps (stages 1 and 2) ----------


@torch.library.custom_op("zerofx::read_full", mutates_args=())
def read_full(
    shard: torch.Tensor,
    full: torch.Tensor,
    group_size: int,
    group_name: str,
    reduce_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``full``, this rank's up-to-date whole copy of the parameter whose shard is ``shard``.

    No communication in forward: the copy is refreshed after each optimizer step. The gradient
    goes to ``shard`` (reduce-scattered), never to ``full``."""
    return full.clone()


@read_full.register_fake
def _read_full_fake(shard, full, group_size, group_name, reduce_dtype=None):
    return torch.empty_like(full)


def _read_full_setup_context(ctx, inputs, output):
    shard, _, group_size, group_name, reduce_dtype = inputs
    ctx.layout = (group_size, group_name, shard.shape[0], reduce_dtype, shard.dtype)


def _read_full_backward(ctx, grad):
    return torch.ops.zerofx.reduce_grad(grad, *ctx.layout), None, None, None, None


read_full.register_autograd(_read_full_backward, setup_context=_read_full_setup_context)


# --- sync_grad / all_reduce_grad: a parameter replicated over a group --------------------------


@torch.library.custom_op("zerofx::sync_grad", mutates_args=())
def sync_grad(
    x: torch.Tensor,
    group_size: int,
    group_name: str,
    compute_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``x`` (cast to ``compute_dtype``), whose gradient is averaged over the group.

    For parameters every rank of the group holds whole: small parameters kept whole by the
    persistence threshold, and shards on the replicate dimension of a 2-D (hybrid) mesh."""
    return x.to(compute_dtype) if compute_dtype is not None and compute_dtype != x.dtype else x.clone()


@sync_grad.register_fake
def _sync_grad_fake(x, group_size, group_name, compute_dtype=None, reduce_dtype=None):
    return torch.empty_like(x, dtype=compute_dtype or x.dtype)


@torch.library.custom_op("zerofx::all_reduce_grad", mutates_args=())
def all_reduce_grad(
    grad: torch.Tensor,
    group_size: int,
    group_name: str,
    reduce_dtype: Optional[torch.dtype] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """The gradient averaged over the group, reduced in ``reduce_dtype``."""
    src = _cast(grad, reduce_dtype).contiguous()
    reduced = _F.wait_tensor(_F.all_reduce(src, "avg", group_name))
    record_collectives([("all_reduce", wire_bytes("all_reduce", _nbytes(src), group_size), group_name)])
    return reduced.to(out_dtype) if out_dtype is not None and out_dtype != reduced.dtype else reduced


@all_reduce_grad.register_fake
def _all_reduce_grad_fake(grad, group_size, group_name, reduce_dtype=None, out_dtype=None):
    return torch.empty_like(grad, dtype=out_dtype or reduce_dtype or grad.dtype)


def _sync_grad_setup_context(ctx, inputs, output):
    x, group_size, group_name, _, reduce_dtype = inputs
    ctx.layout = (group_size, group_name, reduce_dtype, x.dtype)


def _sync_grad_backward(ctx, grad):
    return torch.ops.zerofx.all_reduce_grad(grad, *ctx.layout), None, None, None, None


sync_grad.register_autograd(_sync_grad_backward, setup_context=_sync_grad_setup_context)


# --- local_grad: no communication; the gradient accumulates in sink.grad -----------------------


@torch.library.custom_op("zerofx::local_grad", mutates_args=())
def local_grad(x: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """``x``, whose gradient is not reduced now but accumulated, unreduced, in ``sink.grad``.

    ``sink`` is a full-shape leaf that requires grad (its values are never read: zerofx makes
    it a stride-0 view of one element); autograd's own gradient accumulation sums every
    micro-batch's local gradient into ``sink.grad``, in ``sink``'s dtype. ``zerofx.runtime.params``
    reduces that sum once, at the accumulation boundary (ZeRO-1, and ``zerofx.no_sync``)."""
    return x.clone()


@local_grad.register_fake
def _local_grad_fake(x, sink):
    return torch.empty_like(x)


def _local_grad_setup_context(ctx, inputs, output):
    ctx.sink_dtype = inputs[1].dtype


def _local_grad_backward(ctx, grad):
    return None, grad.to(ctx.sink_dtype)


local_grad.register_autograd(_local_grad_backward, setup_context=_local_grad_setup_context)


UNSHARD = torch.ops.zerofx.unshard.default
REDUCE_GRAD = torch.ops.zerofx.reduce_grad.default
READ_FULL = torch.ops.zerofx.read_full.default
SYNC_GRAD = torch.ops.zerofx.sync_grad.default
ALL_REDUCE_GRAD = torch.ops.zerofx.all_reduce_grad.default
LOCAL_GRAD = torch.ops.zerofx.local_grad.default

FORWARD_MARKERS = (UNSHARD, READ_FULL, SYNC_GRAD, LOCAL_GRAD)
GRAD_MARKERS = (REDUCE_GRAD, ALL_REDUCE_GRAD)
