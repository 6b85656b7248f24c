"""Gradient accumulation without a reduction per micro-batch: ``zerofx.no_sync(model)``.

    for i, micro_batch in enumerate(micro_batches):
        with zerofx.no_sync(model) if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (model(*micro_batch) / len(micro_batches)).backward()
    optimizer.step()

Inside ``no_sync`` the parameters' forward goes through ``local_grad`` (``zerofx.runtime.params`` NOTE:
markers per stage): each backward adds its whole, unreduced gradient to a per-parameter buffer
and communicates nothing. The first backward outside ``no_sync`` adds its own gradient there
too and then reduces every buffer once (NOTE: the accumulation boundary), so a whole cycle of
micro-batches costs one reduction per parameter, as one big batch would. The price, as with
DDP's and FSDP's ``no_sync``, is one whole gradient per parameter held across the cycle. In
stage 3 the forward still all-gathers parameters (they are not kept between micro-batches).

The mode is a Python attribute the compiled forward guards on: the first no-sync and the first
synced-after-accumulation forward each compile one more graph per frame, then run cached.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

from zerofx.errors import ZeroFXError
from zerofx.runtime.params import runtime_of

__all__ = ["no_sync"]


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside accumulate gradients locally; the next one outside reduces them."""
    runtime = runtime_of(model)
    if runtime is None:
        raise ZeroFXError("zerofx.no_sync needs a model sharded by zerofx.compile or zerofx.shard")
    previous, runtime.sync = runtime.sync, False
    try:
        yield
    finally:
        runtime.sync = previous
