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

With ``loss_scale_hysteresis`` above 1 or a ``min_loss_scale`` (what a DeepSpeed config's fp16
section gives by default: hysteresis 2, floor 1), the scaler is ``HysteresisGradScaler``: the
same scaler with DeepSpeed's rule for changing the scale (NOTE: DeepSpeed's scale schedule).

Its state (the scale and the good-step count, and the hysteresis left) is saved by
``zerofx.checkpoint``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.amp.grad_scaler import OptState
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from zerofx.errors import ZeroFXError
from zerofx.options import Options
from zerofx.runtime.params import runtime_of

__all__ = ["HysteresisGradScaler", "ZeroFXGradScaler", "make_loss_scaler", "loss_scaler"]


# NOTE: DeepSpeed's scale schedule. DeepSpeed's DynamicLossScaler (deepspeed/runtime/fp16/
# loss_scaler.py, 0.19.8) differs from torch's GradScaler in three ways, all kept here so that a
# DeepSpeed config trains with DeepSpeed's scales step for step:
# - hysteresis: an overflow first uses up one of ``hysteresis`` tolerated overflows (the step is
#   still skipped, the scale kept); only an overflow with one left halves the scale. What is used
#   up is refilled when the scale grows, not by good steps in between, and not when it halves: once
#   down to one, every overflow halves until the next growth. With ``consecutive_hysteresis`` (the
#   option ``loss_scale_consecutive_hysteresis``) every good step refills it instead.
# - a floor: the scale never goes below ``min_scale``; an overflow that would take it lower when
#   it is already there ends the run (DeepSpeed raises too): no smaller scale can help.
# - growth counting: DeepSpeed counts good steps from the step after the last overflow (or the
#   first step), so its first growth comes after window + 1 good steps, later ones after window.
#   Here that is torch's growth tracker started at -1 (at the start and after every overflow)
#   instead of 0; at 0 after a growth, as torch's.
# With hysteresis 1 and no floor, torch's own schedule runs (ZeroFXGradScaler, make_loss_scaler),
# so the plain options keep it bit for bit.


def _overflowed(states: list[dict]) -> bool:
    """Whether any optimizer's recorded inf flags (a scaler's per-optimizer states) are set; reads
    them on the host."""
    return any(float(f.sum()) > 0 for state in states for f in state["found_inf_per_device"].values())


class ZeroFXGradScaler(ShardedGradScaler):
    """torch's ``ShardedGradScaler`` whose inf flags after ``unscale_`` have the shape torch's
    ``GradScaler`` gives them (a 0-d tensor; the sharded one makes them 1-element tensors), so that
    optimizers stepping with the scaler's flag (``fused=True`` Adam and AdamW subtract it from their
    0-d step counts) can take a step after ``unscale_``: torch 2.13's raised "output with shape []
    doesn't match the broadcast shape [1]" there, which is where the HF Trainer's default optimizer
    (fused AdamW) steps when it clips. The flags are the same values, already all-reduced."""

    _warned_fp16_loss = False

    def scale(self, outputs: Any) -> Any:
        """torch's, plus one warning the first time the loss is fp16 (a model that takes its loss
        on fp16 logits under ``param_dtype=fp16``). The backward starts from the loss's gradient,
        which is the scale itself, in the loss's dtype: 2^16 or more is inf in fp16 (its largest
        value is 65504), so every step at such a scale overflows whatever the gradients are: the
        first step at the default 2^16 and one after every growth past 2^15 are skipped (as under
        DeepSpeed, and torch's GradScaler). Not capped here, to keep DeepSpeed's schedule (NOTE:
        DeepSpeed's scale schedule); the warning says how to avoid it."""
        if (
            not self._warned_fp16_loss
            and self._enabled
            and isinstance(outputs, torch.Tensor)
            and outputs.dtype == torch.float16
        ):
            self._warned_fp16_loss = True
            warnings.warn(
                "zerofx loss scaling: the loss is fp16, and the backward starts from its gradient, the scale, in "
                "fp16: a scale of 2^16 or more is inf there, so such steps always overflow and are skipped (the "
                "first at the default initial_loss_scale 2^16, and one after each growth past 2^15). Compute the "
                "loss in fp32 (e.g. cross_entropy(logits.float(), ...), as HF models do) to use every scale",
                stacklevel=2,
            )
        return super().scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = {d: f.reshape(()) for d, f in state["found_inf_per_device"].items()}

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """As torch's, except for an optimizer stepping with the scaler's flag (``fused=True``):
        its gradients are unscaled first (``unscale_``, whose flag is all-reduced), and it is not
        called at all when a gradient is inf/nan, as any other optimizer is not: its fused step
        would change nothing then, but a caller that watches whether ``optimizer.step`` ran
        (accelerate's ``step_was_skipped``, by which the HF Trainer skips the scheduler's step, as
        DeepSpeed does on an overflow) took the skipped step for a taken one. Reads the flag on the
        host, as the unfused path does."""
        if self._enabled and getattr(optimizer, "_step_supports_amp_scaling", False):
            state = self._per_optimizer_states[id(optimizer)]
            if state["stage"] is OptState.READY:
                # the flag all-reduced over the group: torch's fused path checks each rank's own
                # gradients (agreed only through DTensor's handler, which reads the placement of
                # the first gradient: a replicated one first, and ranks disagreed)
                self.unscale_(optimizer)
            if state["stage"] is OptState.UNSCALED and _overflowed([state]):
                state["stage"] = OptState.STEPPED
                return None
        return super().step(optimizer, *args, **kwargs)

    def unscaled(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s gradients were unscaled since the last ``update``."""
        return self._enabled and self._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED


class HysteresisGradScaler(ZeroFXGradScaler):
    """torch's ``ShardedGradScaler`` changing its scale by DeepSpeed's rule: ``hysteresis``
    overflows before the scale halves, a floor ``min_scale`` (None: none), growth counted as
    DeepSpeed counts it (NOTE: DeepSpeed's scale schedule). Everything else (scaling, the
    all-reduced inf check, skipping the step) is torch's. ``update`` reads the inf flag on the
    host: one device sync per optimizer step, as DeepSpeed's own check."""

    def __init__(self, *, hysteresis: int, min_scale: float | None, consecutive: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._hysteresis = hysteresis
        self._hysteresis_left = hysteresis
        self._consecutive = consecutive
        self._min_scale = _float32(min_scale)
        self._init_growth_tracker = -1  # DeepSpeed's first growth comes one good step later

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if new_scale is not None or not self._enabled:
            super().update(new_scale)  # a scale set by hand leaves the counters alone, as torch's
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        states = list(self._per_optimizer_states.values())
        if not any(state["found_inf_per_device"] for state in states):
            super().update()  # torch's error: no inf check was recorded since the last update
            return
        overflow = _overflowed(states)
        current = float(scale)
        good = int(tracker)
        if overflow:
            good = -1
            if self._hysteresis_left > 1:
                self._hysteresis_left -= 1
            elif self._min_scale is not None and current <= self._min_scale:
                raise ZeroFXError(
                    f"option min_loss_scale: the fp16 loss scale is at its floor ({current:g}) and the gradients "
                    "still overflow (the step was skipped); DeepSpeed ends the run here too: look for inf/NaN in "
                    "the loss or the data, or lower the learning rate"
                )
            else:
                current *= self._backoff_factor
                if self._min_scale is not None:
                    current = max(current, self._min_scale)
        else:
            good += 1
            if self._consecutive:  # only overflows in a row use the hysteresis up
                self._hysteresis_left = self._hysteresis
            if good >= self._growth_interval:
                current *= self._growth_factor
                good = 0
                self._hysteresis_left = self._hysteresis
        tracker.fill_(good)
        super().update(current)  # sets the scale and clears the step's inf checks

    def state_dict(self) -> dict[str, Any]:
        """torch's entries (the growth tracker may be -1: see NOTE: DeepSpeed's scale schedule)
        and ``hysteresis``, ``min_scale`` and ``_hysteresis_left``; plain numbers, for the JSON
        file ``zerofx.checkpoint`` writes."""
        state = super().state_dict()
        if state:
            state.update(
                hysteresis=self._hysteresis,
                min_scale=self._min_scale,
                consecutive=self._consecutive,
                _hysteresis_left=self._hysteresis_left,
            )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, whose saved growth interval replaces the constructor's: the saved hysteresis
        and floor do too. A plain GradScaler's state (no hysteresis) starts with all of it left."""
        super().load_state_dict(state_dict)
        if self._enabled:
            self._hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
            self._min_scale = _float32(state_dict.get("min_scale", self._min_scale))
            self._consecutive = bool(state_dict.get("consecutive", self._consecutive))
            self._hysteresis_left = int(state_dict.get("_hysteresis_left", self._hysteresis))


def _float32(value: float | None) -> float | None:
    """``value`` as the float32 scale tensor holds it, so that a scale floored there compares
    equal to the floor (0.1 is not a float32)."""
    return None if value is None else torch.tensor(float(value), dtype=torch.float32).item()


def make_loss_scaler(opts: Options, mesh: DeviceMesh):
    """The scaler ``opts`` ask for, or None. The inf/nan flag is all-reduced over the default
    process group, which spans every rank of the mesh (1-D or 2-D)."""
    if opts.loss_scale != "dynamic":
        return None
    kwargs = {
        "device": mesh.device_type,
        "init_scale": opts.initial_loss_scale,
        "growth_interval": opts.loss_scale_window,
    }
    if opts.loss_scale_hysteresis == 1 and opts.min_loss_scale is None:
        return ZeroFXGradScaler(**kwargs)
    return HysteresisGradScaler(
        hysteresis=opts.loss_scale_hysteresis,
        min_scale=opts.min_loss_scale,
        consecutive=opts.loss_scale_consecutive_hysteresis,
        **kwargs,
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
