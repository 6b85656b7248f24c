"""One Triton launch over many tensors: pointer tables and block tables.

Eager ZeRO pays one small kernel per parameter around every collective (pad, cast, copy,
scale, optimizer update). Here one launch covers a whole bucket: program ``b`` looks up which
tensor it works on (``block_tensor[b]``) and where in it (``block_start[b]``), then loads that
tensor's address from a pointer table and casts it to a typed pointer. The same kernel thus
serves any number of tensors of any sizes, without one kernel argument per tensor.

The kernels are plain functions decorated on first use (``jit``), because Triton decides at
decoration time whether a kernel runs on the GPU or in its CPU interpreter
(``TRITON_INTERPRET=1``), and tests switch that per module.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.distributed.tensor import DTensor

from zerofx.codegen.triton_runtime import interpreting

BLOCK = 1024

_jitted: dict[tuple[Callable, bool], Callable] = {}
_blocks: dict[tuple, "Blocks"] = {}
_lock = threading.Lock()


def jit(fn: Callable) -> Callable:
    """``triton.jit(fn)`` for the current mode (GPU or interpreter), decorated once per mode."""
    key = (fn, interpreting())
    with _lock:
        if key not in _jitted:
            import triton

            _jitted[key] = triton.jit(fn)
        return _jitted[key]


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory a kernel touches: a DTensor's local shard, else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def in_storage_order(like: torch.Tensor, *others: torch.Tensor) -> list[torch.Tensor]:
    """``like`` and ``others`` each permuted by the order that sorts ``like``'s strides (largest
    first): a dense tensor stored in another order than its shape's (a parameter split along a
    dim other than 0, zerofx/ir/layout.py NOTE: the sharded dim) becomes contiguous, and the
    same permutation keeps every tensor's elements paired with ``like``'s. An elementwise kernel
    then walks their memory as flat buffers; ``addresses`` refuses any that is still not
    contiguous (a gradient or state laid out otherwise than its parameter)."""
    if like.dim() < 2 or like.is_contiguous():
        return [like, *others]
    order = sorted(range(like.dim()), key=lambda d: -like.stride(d))
    return [t.permute(order) for t in (like, *others)]


def tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    types = {
        torch.float32: tl.float32,
        torch.float16: tl.float16,
        torch.bfloat16: tl.bfloat16,
        torch.float64: tl.float64,
    }
    if dtype not in types:
        raise ValueError(f"multi-tensor kernels move floating-point tensors (fp32, fp16, bf16, fp64), not {dtype}")
    return types[dtype]


@dataclass(frozen=True)
class Blocks:
    """Which tensor (``tensor``) and element offset (``start``) each program of a launch handles."""

    tensor: torch.Tensor  # int32 [count]
    start: torch.Tensor  # int64 [count]
    count: int


def blocks_for(numels: Sequence[int], device: torch.device, block: int = BLOCK) -> Blocks:
    """Block tables covering ``numels[i]`` elements of tensor ``i`` (cached: layouts repeat every step)."""
    key = (tuple(numels), str(device), block)
    with _lock:
        cached = _blocks.get(key)
    if cached is not None:
        return cached
    which, start = [], []
    for i, n in enumerate(numels):
        for s in range(0, n, block):
            which.append(i)
            start.append(s)
    result = Blocks(
        torch.tensor(which, dtype=torch.int32, device=device),
        torch.tensor(start, dtype=torch.int64, device=device),
        len(which),
    )
    with _lock:
        _blocks[key] = result
    return result


def addresses(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 table of the tensors' data pointers (every tensor must be contiguous)."""
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("multi-tensor kernels need contiguous tensors")
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


def int_table(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=device)
