"""Dynamic loss scaling for fp16, through torch's own sharded gradient scaler.

With fp16 gradients, small values underflow to zero unless the loss is scaled up before the
backward; too large a scale overflows to inf. Dynamic scaling (DeepSpeed's and torch.amp's)
skips the optimizer step and halves the scale when any gradient is inf/nan, and doubles it
after ``loss_scale_window`` good steps. Under ZeRO a rank only sees its gradient *shards*, so
"any gradient is inf" must be agreed across ranks: torch's
``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` all-reduces that flag, works on
DTensor gradients and on CPU, so zerofx configures one from the options instead of writing its
own. Use it as any GradScaler::

    scaler = zerofx.loss_scaler(model)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # optional
    scaler.step(optimizer)      # skipped when a gradient is inf/nan anywhere
    scaler.update()             # back off or grow the scale

Its state (the scale and the good-step count) is saved by ``zerofx.checkpoint``.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from zerofx.errors import ZeroFXError
from zerofx.options import Options
from zerofx.runtime.params import runtime_of

__all__ = ["make_loss_scaler", "loss_scaler"]


def make_loss_scaler(opts: Options, mesh: DeviceMesh):
    """The scaler ``opts`` ask for, or None. The inf/nan flag is all-reduced over the default
    process group, which spans every rank of the mesh (1-D or 2-D)."""
    if opts.loss_scale != "dynamic":
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(
        device=mesh.device_type, init_scale=opts.initial_loss_scale, growth_interval=opts.loss_scale_window
    )


def loss_scaler(model: nn.Module):
    """The dynamic loss scaler of a model compiled with ``loss_scale="dynamic"``."""
    runtime = runtime_of(model)
    if runtime is None or runtime.scaler is None:
        raise ZeroFXError(
            "option loss_scale: this model has no loss scaler; compile it with "
            "zerofx.compile(model, mesh, loss_scale='dynamic')"
        )
    return runtime.scaler
