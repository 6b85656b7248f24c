"""Model-state bytes per rank: parameters, gradients and optimizer state, counted by storage."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

__all__ = ["ModelStateBytes", "model_state_bytes", "model_state_addresses", "local_nbytes"]


def local_nbytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for ``t`` (its local shard when ``t`` is a DTensor)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model state held by this rank (ZeRO's "model states")."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _storages(tensors: list[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    """The distinct storages behind ``tensors`` (local shards for DTensors), by identity (fake
    tensors' storages too: ``zerofx.plan`` counts a fake step with this function).

    Counting storages, not numel, is what memory really holds: a stage-1/2 shard that is a view
    of its rows of the whole copy costs nothing extra, and a gradient that is a view of a larger
    (padded or whole) buffer keeps all of that buffer alive."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if t.numel() == 0 or 0 in t.stride():  # empty shards; stride-0 gradient sinks hold one element
            continue
        storage = t.untyped_storage()
        seen[storage._cdata] = storage
    return seen


def _model_state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
    params = list(model.parameters())
    states = [getattr(p, "_zerofx_state", None) for p in params]
    param_tensors = params + [s.full for s in states if s is not None and s.full is not None]
    grad_tensors = [p.grad for p in params if p.grad is not None]
    grad_tensors += [s.sink.grad for s in states if s is not None and s.sink.grad is not None]
    opt_tensors = []
    if optimizer is not None:
        for state in optimizer.state.values():
            opt_tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return param_tensors, grad_tensors, opt_tensors


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> ModelStateBytes:
    """Local bytes of parameters, gradients and per-element optimizer state, by storage.

    Parameters include the whole copies stages 1 and 2 keep; gradients include the whole,
    unreduced gradients pending reduction (stage 1 and ``zerofx.no_sync``). Scalar optimizer
    state (e.g. Adam's ``step``) is not per-element state and is left out.
    """
    params, grads, opt = _model_state_tensors(model, optimizer)
    return ModelStateBytes(*(sum(int(st.nbytes()) for st in _storages(ts).values()) for ts in (params, grads, opt)))


def model_state_addresses(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> set[int]:
    """Addresses of the storages :func:`model_state_bytes` counts (for ``AllocationTrace.step_peak``)."""
    return {st.data_ptr() for ts in _model_state_tensors(model, optimizer) for st in _storages(ts).values()}
