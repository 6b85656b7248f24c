"""Optimizer steps over whole tensors, for optimizers whose update of an element reads others.

# NOTE: whole-tensor steps
Adafactor's factored second moment takes the mean of every row and of every column of a
gradient, and scales the update by the root mean square of the whole parameter; Muon
orthogonalizes each gradient matrix with matmuls over all of it. None of that is a function of
this rank's rows alone. Through DTensor, torch's Adafactor fails (powers of partial sums in
place), transformers' mixes plain state tensors with DTensor gradients and fails, and Muon's
Newton-Schulz iteration runs with a collective per matmul and rounds its partial sums in bf16
where the unsharded step rounds once, so its updates differ from the unsharded run's.

So zerofx steps these optimizers as an unsharded run would, one window of parameters at a time:
every rank all-gathers each parameter of the window, its gradient and its parameter-shaped
state (flat buckets, ``eager_buckets.gather_whole``; at stages 1-2 a parameter is copied from
the whole copy forward reads, when that is in the parameter's dtype and current), runs the
optimizer's own step function on those whole tensors (a stand-in optimizer object sharing
everything with the real one but its ``param_groups`` and ``state``), and writes back its own
rows of the parameter. What the step leaves in the state is
stored as the DTensor path would hold it: a tensor shaped like the parameter is sharded like it
(so Muon's momentum stays 1/N per rank), anything else (Adafactor's row and column factors, a
step count) is kept whole, the same on every rank, as DCP saves a replicated tensor. Every rank
runs the same arithmetic on the same values, so the parameters are bit for bit the unsharded
step's.

What it costs: per step, an all-gather of every parameter and gradient (and of Muon's
momentum), the step's arithmetic on whole tensors on every rank, and at most one window of
whole tensors at a time above the shards (``WINDOW_BYTES``); docs/measurements.md, "whole_step",
has the numbers. The optimizer's step pre-hooks see the shards, as for any other optimizer
(they run first: zerofx/runtime/local_step.py, NOTE: the last pre-hook); its step function sees
the window's whole tensors.

Which optimizers: ``whole_step_class`` (torch's Adafactor and Muon, transformers' Adafactor, and
their subclasses: the step runs their own code, whatever it adds). Optimizers that call the
closure more than once in a step (LBFGS) cannot: the closure's forward would read parameters
the step has not written back yet.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from zerofx.errors import ZeroFXError
from zerofx.ir.layout import pack_consecutive
from zerofx.runtime.eager_buckets import gather_whole

__all__ = ["WINDOW_BYTES", "check_steppable", "stand_in", "step_whole", "whole_step_class"]

WINDOW_BYTES = 64 << 20  # whole parameters, gradients and parameter-shaped state gathered at once

# torch's classes stepped over whole tensors (Muon is newer than some torch zerofx admits), and
# others by (module, qualified name), so that transformers is never imported for the check
_WHOLE_TORCH = tuple(c for c in (getattr(torch.optim, n, None) for n in ("Adafactor", "Muon")) if c is not None)
_WHOLE_NAMED = {("transformers.optimization", "Adafactor")}


def whole_step_class(optimizer: torch.optim.Optimizer) -> type | None:
    """The class in ``optimizer``'s MRO that makes it step over whole tensors (NOTE above), or None."""
    for cls in type(optimizer).__mro__:
        if cls in _WHOLE_TORCH or (cls.__module__, cls.__qualname__) in _WHOLE_NAMED:
            return cls
    return None


def stand_in(optimizer: torch.optim.Optimizer, groups: list[dict], state: Any) -> torch.optim.Optimizer:
    """An object of ``optimizer``'s class sharing every attribute with it but ``param_groups``
    and ``state``: what the class's step function runs on, so that the real optimizer never
    holds anything but its own parameters (a step that raises leaves it as it was)."""
    other = object.__new__(type(optimizer))  # no __init__ / __setstate__: nothing is re-checked or changed
    other.__dict__.update(optimizer.__dict__)
    other.param_groups = groups
    other.state = state
    other._zerofx_stand_in = True  # zerofx's step hooks leave it alone (zerofx/runtime/local_step.py)
    return other


def _as_held(value: Any, before: Any, param: torch.Tensor, s: Any) -> Any:
    """A state value after a whole step, as the DTensor path holds state: sharded like the
    parameter when shaped like it (this rank's rows of the whole, copied into the DTensor it
    held before, or into a new one), else as it is (whole, the same on every rank)."""
    if s is None or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    if value.dim() == 0 or value.shape != param.shape:
        return value
    mine = value if s.whole else value[s.first_row : s.first_row + s.shard_rows]
    if isinstance(before, DTensor) and before.shape == value.shape and before.dtype == value.dtype:
        if before._local_tensor.data_ptr() != mine.data_ptr():
            before._local_tensor.copy_(mine)
        return before
    return DTensor.from_local(
        mine if s.whole else mine.clone(),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def _whole_copy(p: torch.Tensor, s: Any) -> torch.Tensor | None:
    """Stages 1 and 2: a copy of the parameter's whole value from the whole copy forward reads,
    when that holds it exactly (the parameter's dtype, refreshed since the shard last changed):
    no gather needed. None otherwise (stage 3, mixed precision, a stale copy)."""
    if s.full is None or s.full.dtype != p.dtype or s.versions() != s.synced_version:
        return None
    return s.full.detach().clone()  # the step writes it: the whole copy stays as forward reads it


def check_steppable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse what a whole-tensor step cannot do, before the first step changes anything."""
    name = type(optimizer).__name__
    for g in optimizer.param_groups:
        for p in g["params"]:
            s = getattr(p, "_zerofx_state", None)
            if s is not None and s.tp is not None:
                raise ZeroFXError(
                    f"{name} steps over whole tensors (zerofx/runtime/whole_step.py, NOTE: whole-tensor "
                    f"steps), which zerofx does not yet do for tensor-parallel parameters ({s.qualname}). "
                    "Use an elementwise optimizer (AdamW, Adam, SGD, ...) with tensor parallelism"
                )
            if (
                s is not None
                and p.grad is not None
                and not (isinstance(p.grad, DTensor) and p.grad.placements == p.placements and p.grad.shape == p.shape)
            ):
                raise ZeroFXError(
                    f"{s.qualname}: its gradient is not a DTensor laid out like the parameter "
                    f"({type(p.grad).__name__}), so {name}'s whole-tensor step cannot gather it. "
                    "Set gradients of zerofx parameters as DTensors of the parameter's placements"
                )


def step_whole(optimizer: torch.optim.Optimizer, step_fn: Callable[[torch.optim.Optimizer], Any]) -> None:
    """One step of ``optimizer`` by ``step_fn`` (its class's step function, without torch's hook
    wrapper) over whole tensors, window by window (NOTE above). Every rank calls it with the same
    parameters holding gradients, in the same order: the gathers are collectives."""
    check_steppable(optimizer)
    groups = optimizer.param_groups
    stepped = [p for g in groups for p in g["params"] if p.grad is not None]

    def whole_bytes(p: torch.Tensor) -> int:
        held = sum(1 for v in optimizer.state.get(p, {}).values() if isinstance(v, DTensor))
        return p.numel() * p.element_size() * (2 + held)

    for window in pack_consecutive(stepped, whole_bytes, WINDOW_BYTES):
        members = set(window)
        sharded = [(p, p._zerofx_state) for p in window if getattr(p, "_zerofx_state", None) is not None]
        held = {p: [k for k, v in optimizer.state.get(p, {}).items() if isinstance(v, DTensor)] for p, _ in sharded}
        copies = {p: _whole_copy(p, s) for p, s in sharded}
        parts = [(p._local_tensor, s) for p, s in sharded if copies[p] is None]
        parts += [(p.grad._local_tensor, s) for p, s in sharded]
        parts += [(optimizer.state[p][k]._local_tensor, s) for p, s in sharded for k in held[p]]
        gathered = iter(gather_whole(parts))
        whole_of: dict[torch.Tensor, torch.Tensor] = {p: p for p in window}  # a plain parameter steps as is
        with torch.no_grad():
            for p, _ in sharded:  # detached: a whole parameter's is its local tensor, which must stay as it is
                w = copies[p] if copies[p] is not None else next(gathered).detach()
                whole_of[p] = w.requires_grad_(p.requires_grad)
            for p, _ in sharded:
                whole_of[p].grad = next(gathered)
        state: defaultdict = defaultdict(dict)
        for p in window:
            if p in optimizer.state:
                state[whole_of[p]] = dict(optimizer.state[p])
        for p, _ in sharded:
            for k in held[p]:
                state[whole_of[p]][k] = next(gathered)
        window_groups = [{**g, "params": [whole_of[p] for p in g["params"] if p in members]} for g in groups]
        step_fn(stand_in(optimizer, window_groups, state))
        with torch.no_grad():
            for p in window:
                s = getattr(p, "_zerofx_state", None)
                w = whole_of[p]
                if w is not p:
                    if w.data_ptr() != p._local_tensor.data_ptr():
                        p._local_tensor.copy_(w if s.whole else w[s.first_row : s.first_row + s.shard_rows])
                    w.grad = None
                if w in state:
                    before = optimizer.state.get(p, {})
                    optimizer.state[p] = {k: _as_held(v, before.get(k), p, s) for k, v in state[w].items()}
        for g, wg in zip(groups, window_groups):  # what the step set in a group (not its parameters)
            g.update({k: v for k, v in wg.items() if k != "params"})
