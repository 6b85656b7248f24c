"""Optimizer steps over this rank's local shards instead of through DTensor.

zerofx's parameters are ``Shard(0)`` DTensors (``Replicate()`` when kept whole), so that the
optimizer's state is sharded too and ``state_dict`` / DCP see global tensors. The price is in
the step: every op an optimizer runs on a DTensor goes through DTensor's Python dispatch
(sharding propagation, unwrapping, rewrapping the result). torch's single-tensor AdamW, the
default on CPU, runs about eight ops per parameter, each a DTensor dispatch (what that costs:
docs/measurements.md, local_step). FSDP2 pays the same. An elementwise optimizer does the same arithmetic on a shard as on the DTensor
around it, so zerofx steps the shards directly and leaves the DTensors as they were.

# NOTE: how a step runs on local shards
Nothing changes for the user: they build any ``torch.optim`` optimizer over
``model.parameters()``. The first ``step()`` of an optimizer that holds zerofx parameters runs
as usual (through DTensor); a global step pre-hook sees it and, for the elementwise optimizers
in ``ELEMENTWISE`` (exact classes: a subclass may add a norm or a matrix op), wraps the
instance's ``step``. From then on each step

1. runs the closure, if any (before anything is swapped: it runs forward and backward);
2. swaps, for the duration of the step only, every zerofx parameter in ``param_groups`` for its
   local tensor (``.grad`` set to the local tensor of the gradient) and every state tensor for
   its local tensor, so the optimizer's own code runs on plain tensors (its hooks too: they see
   the local tensors);
3. puts the DTensors back, in a ``finally``: a step that raises leaves the optimizer as it was.
   State the step updated in place is already in the DTensors (same storage); state it
   created or rebound is wrapped into a DTensor with the parameter's placements.

A step falls back to the DTensor path (numerically the same, only slower) when a gradient is
not a DTensor with its parameter's placements and shape, when the optimizer also holds
DTensors zerofx does not manage (foreach kernels cannot mix the two), when it is stepped in
windows by ``zerofx.offload_optimizer``, or when the model was compiled with
``local_optimizer_step=False``. Rprop's step fails inside DTensor, so its first step runs on the
local shards too (``_LOCAL_FROM_THE_FIRST``), as does that of SGD and Adagrad with ``fused=True``
(their fused kernels have no DTensor strategy), and where that cannot be, the first step is an
error. Optimizers whose update of an element reads others (Adafactor, Muon) step over whole
tensors (zerofx/runtime/whole_step.py); the other optimizers outside ``ELEMENTWISE`` take the
DTensor path. The steps zerofx runs itself run in its last step pre-hook (NOTE: the last
pre-hook, below).
"""

from __future__ import annotations

import contextlib
import types
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch
from torch.distributed.tensor import DTensor

from zerofx.errors import ZeroFXError, some_names
from zerofx.runtime.params import PENDING, discard_pending, optimizer_state, refuse_unreduced
from zerofx.runtime.whole_step import Windows, check_steppable, stand_in, step_whole, whole_step_class

__all__ = ["ELEMENTWISE", "install", "local_step_method", "step_over_whole_tensors", "steps_locally"]

# Optimizers whose update of an element reads only that element of the parameter, its gradient
# and its state (plus scalars): stepping a shard is stepping those rows of the whole.
ELEMENTWISE: frozenset[type] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.RMSprop,
        torch.optim.Adadelta,
        torch.optim.Rprop,
    }
)

# Elementwise optimizers whose step fails inside DTensor, so that their first step runs on the
# local shards too (the others' first step runs through DTensor: it is where zerofx adopts them).
# Rprop clears gradient entries through a boolean mask, an index_put_ DTensor cannot apply to a
# shard in place.
_LOCAL_FROM_THE_FIRST: frozenset[type] = frozenset({torch.optim.Rprop})
# and those whose fused kernel has no DTensor sharding strategy (torch 2.13: aten._fused_sgd_,
# aten._fused_adagrad_; Adam's and AdamW's have one), when a param group asks for it
FUSED_WITHOUT_DTENSOR: frozenset[type] = frozenset({torch.optim.SGD, torch.optim.Adagrad})


def fused_without_dtensor(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` asks for a fused kernel DTensor has no strategy for."""
    return type(optimizer) in FUSED_WITHOUT_DTENSOR and any(g.get("fused") for g in optimizer.param_groups)


def _local_from_the_first(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer) in _LOCAL_FROM_THE_FIRST or fused_without_dtensor(optimizer)


_PRE_HOOK = None


def install() -> None:
    """Register the global step pre-hook that adopts optimizers over zerofx parameters (once)."""
    global _PRE_HOOK
    if _PRE_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _PRE_HOOK = register_optimizer_step_pre_hook(_adopt)


def steps_locally(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s steps after the first run on local shards (NOTE above)."""
    state = optimizer_state(optimizer)
    return state is not None and state.local_step


def local_step_method(optimizer: torch.optim.Optimizer) -> Callable[..., Any] | None:
    """The bound ``step`` zerofx installed on ``optimizer`` when it adopted it (None before its
    first step, or when its steps do not run on local shards). For a wrapper that captured
    ``optimizer.step`` before that and puts it back after each step (accelerate's
    ``AcceleratedOptimizer`` under a loss scaler does): calling this one instead keeps the
    steps on the local shards."""
    state = optimizer_state(optimizer)
    return state.local_method if state is not None and state.local_step else None


def _managed(p: torch.Tensor) -> bool:
    state = getattr(p, "_zerofx_state", None)
    return state is not None and state.runtime.local_step


def _drop_pending_on_zero_grad(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad`` also drops what ``no_sync`` holds for its parameters (as DDP's
    drops an abandoned window's local gradients), from the optimizer's first step on: before
    it, ``model.zero_grad()`` does (zerofx/sharding.py)."""

    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        type(self).zero_grad(self, set_to_none)
        discard_pending(p for g in self.param_groups for p in g["params"])

    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)


def _adopt(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple | None:
    if torch.compiler.is_compiling() or _is_stand_in(optimizer):
        return
    # a no_sync window left unreduced (rare: one look at the parameters only then); a closure
    # (Lightning's automatic optimization) runs the window's last backward inside the step
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if PENDING and closure is None:
        refuse_unreduced([p for g in optimizer.param_groups for p in g["params"]])
    state = optimizer_state(optimizer)
    if state is not None:  # decided at its first step already (or zerofx.offload_optimizer took it)
        if "zero_grad" not in optimizer.__dict__:  # (offload_optimizer made the state before any step)
            _drop_pending_on_zero_grad(optimizer)
        if state.last_hook is not None:  # behind the step pre-hooks registered since (NOTE: the last pre-hook)
            optimizer._optimizer_step_pre_hooks.move_to_end(state.last_hook)
        return _refreshing_closure(optimizer, state, args, kwargs)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ours = any(hasattr(p, "_zerofx_state") for p in params)
    if ours and "zero_grad" not in optimizer.__dict__:
        _drop_pending_on_zero_grad(optimizer)
    if ours and isinstance(optimizer, torch.optim.LBFGS):
        _refuse_unflattenable(params)
    whole = ours and whole_step_class(optimizer) is not None
    adopt = type(optimizer) in ELEMENTWISE and any(_managed(p) for p in params)
    first_local = ours and _local_from_the_first(optimizer)
    # the refusals first: an optimizer refused at its first step is decided again at its next
    if whole:
        step_over_whole_tensors(optimizer)  # refuses what it cannot step before it keeps any state
        return
    if first_local and not (adopt and _swappable(params)):
        raise ZeroFXError(
            f"torch.optim.{type(optimizer).__name__}{'(fused=True)' if fused_without_dtensor(optimizer) else ''} "
            "steps zerofx's sharded parameters on their local shards only (its step fails inside DTensor): keep local_optimizer_step=True (the default), step no "
            "DTensors zerofx does not manage with it, and leave the gradients zerofx's backward made"
        )
    state = optimizer_state(optimizer, create=True)
    if first_local:
        state.first_local = True
        _run_last(optimizer, state)
    state.local_step = adopt
    if adopt:
        inner = state.inner_step = optimizer.step  # the class's step, or what wraps it

        def step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
            return _local_step(self, closure)

        # torch's LR schedulers wrap ``step`` as a bound method and mark their wrapper; keep
        # the mark of one that wrapped it already (or it warns that step was overridden)
        if getattr(inner, "_wrapped_by_lr_sched", False):
            step._wrapped_by_lr_sched = True
        optimizer.step = state.local_method = types.MethodType(step, optimizer)
    return _refreshing_closure(optimizer, state, args, kwargs)


def step_over_whole_tensors(optimizer: torch.optim.Optimizer, windows: Windows | None = None) -> None:
    """Make every step of ``optimizer`` (a ``whole_step_class`` one) run over whole tensors
    (zerofx/runtime/whole_step.py), in ``windows`` (None: the default windows): at its first
    step, or before it (``zerofx.offload_optimizer``)."""
    check_steppable(optimizer)
    state = optimizer_state(optimizer, create=True)
    state.windows = windows
    if not state.whole:
        state.whole = True
        _run_last(optimizer, state)


def _refuse_unflattenable(params: list) -> None:
    """LBFGS flattens every gradient and update into one vector (``.view(-1)``, through DTensor).
    DTensor cannot merge an unevenly split dim with the others ("Cannot flatten unevenly sharded
    tensor": a [3, 4] weight over 2 ranks; a 1-D one has nothing to merge and flattens) and
    loops forever on a size-0 tensor (torch 2.13's view propagation): both are refused at the
    first step, by name, on every rank alike."""
    bad = []
    for p in params:
        s = getattr(p, "_zerofx_state", None)
        if s is None:
            continue
        if p.numel() == 0:
            bad.append(f"{s.qualname} {list(p.shape)} (no elements)")
        elif p.dim() > 1 and not s.whole and s.full_rows % s.shard_group.size:  # (1-D: nothing to merge)
            bad.append(f"{s.qualname} {list(p.shape)} ({s.full_rows} rows over {s.shard_group.size} ranks)")
    if bad:
        raise ZeroFXError(
            f"torch.optim.LBFGS flattens every parameter into one vector through DTensor, which cannot flatten "
            f"{some_names(bad)}: give LBFGS multi-dim parameters whose sharded dim divides evenly over the ranks (and no "
            "size-0 ones), or keep them whole (persistence_threshold above their size, at stage 3)"
        )


def _refreshing_closure(optimizer: torch.optim.Optimizer, state: Any, args: tuple, kwargs: dict) -> tuple | None:
    """A step through DTensor that calls its closure after changing parameters (LBFGS: its line
    search evaluates the model between updates) would have stages 1-2 read whole copies older
    than the shards it just changed; zerofx's stale-copy check would stop the forward. So such a
    closure refreshes the stale whole copies first (a collective: every rank calls the closure
    as often, as the optimizer's own collectives through DTensor require anyway), when they are
    stale on any rank (one small all-reduce per call decides it for all). The local and
    whole-tensor steps run the closure before changing anything: left as they are."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None or state.local_step or state.whole:
        return None
    runtimes = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            s = getattr(p, "_zerofx_state", None)
            if s is not None and s.full is not None:
                runtimes[id(s.runtime)] = s.runtime
    if not runtimes:
        return None

    def refreshing() -> Any:
        for runtime in runtimes.values():
            stale = any(s.versions() != s.synced_version for s in runtime.whole_copies)
            if runtime.lockstep is not None:  # every rank refreshes, or none: a write on one rank alone
                stale = runtime.lockstep.any_everywhere(stale)  # would leave the others waiting
            if stale:
                runtime.refresh()
        return closure()

    if "closure" in kwargs:
        return args, {**kwargs, "closure": refreshing}
    return (args[0], refreshing, *args[2:]), kwargs


# NOTE: the last pre-hook
# A step that zerofx runs itself (a whole-tensor step every time, a first step on local shards)
# runs in a step pre-hook of the optimizer's own, kept behind every other pre-hook (the global
# hook that adopts optimizers moves it to the end before the optimizer's own hooks run), so that
# the user's pre-hooks still run before the step, as torch runs them. It steps the optimizer,
# then hands the class's step a stand-in holding no parameters, which does nothing; the
# post-hooks (zerofx's refresh of whole copies among them) run on the optimizer as usual.


def _run_last(optimizer: torch.optim.Optimizer, state: Any) -> None:
    state.last_hook = optimizer.register_step_pre_hook(_last_pre_hook).id


def _is_stand_in(optimizer: torch.optim.Optimizer) -> bool:
    return optimizer.__dict__.get("_zerofx_stand_in", False)


def _class_step(optimizer: torch.optim.Optimizer) -> Callable[[torch.optim.Optimizer], Any]:
    """The optimizer class's step function, without torch's hook wrappers."""
    return class_step(type(optimizer))


def class_step(cls: type) -> Callable[[torch.optim.Optimizer], Any]:
    """``cls.step`` without torch's hook wrappers (one per class that was patched: a
    subclass's wraps its parent's), so a subclass that keeps its parent's step has the same one."""
    step = cls.step
    while getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    return step


def _last_pre_hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple | None:
    state = optimizer_state(optimizer)
    if torch.compiler.is_compiling() or _is_stand_in(optimizer) or not (state.whole or state.first_local):
        return None
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    if state.whole:
        step_whole(optimizer, _class_step(optimizer), state.windows or Windows())
    else:
        with _on_local_shards(optimizer):
            _class_step(optimizer)(optimizer)
        state.first_local = False
    idle = stand_in(optimizer, [{**g, "params": []} for g in optimizer.param_groups], defaultdict(dict))
    done = None if closure is None else (lambda: loss)
    if "closure" in kwargs:
        return (idle, *args[1:]), {**kwargs, "closure": done}
    return (idle, *((done,) if len(args) > 1 else ()), *args[2:]), kwargs


def _local_step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    with _on_local_shards(self):
        optimizer_state(self).inner_step()
    return loss


def _swappable(params: list[torch.Tensor]) -> bool:
    for p in params:
        if not isinstance(p, DTensor):
            continue
        if not _managed(p):
            return False
        g = p.grad
        if g is not None and (
            not isinstance(g, DTensor)
            or g.placements != p.placements
            or g._local_tensor.shape != p._local_tensor.shape
            or g._local_tensor.dtype != p._local_tensor.dtype
        ):
            return False
    return True


def _rewrap(value: Any, before: Any, param: DTensor, local: torch.Tensor) -> Any:
    """A state value after a local step, as the DTensor-path state would hold it."""
    if isinstance(before, DTensor) and before._local_tensor is value:
        return before
    if (
        isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and value.dim() > 0
        and value.shape == local.shape
    ):
        return DTensor.from_local(
            value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return value


@contextlib.contextmanager
def _on_local_shards(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    groups = optimizer.param_groups
    params = [p for g in groups for p in g["params"]]
    if not _swappable(params):
        yield
        return
    local_of = {p: p._local_tensor for p in params if isinstance(p, DTensor)}
    saved_params = [g["params"] for g in groups]
    saved_state = optimizer.state
    local_state: defaultdict = defaultdict(dict)
    for key, entry in saved_state.items():
        if key in local_of:
            local_state[local_of[key]] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in entry.items()}
        else:
            local_state[key] = entry
    try:
        for p, local in local_of.items():
            local.grad = None if p.grad is None else p.grad._local_tensor
            local._zerofx_state = p._zerofx_state  # hooks (the stage-1/2 refresh) find the parameter
        for g in groups:
            g["params"] = [local_of.get(p, p) for p in g["params"]]
        optimizer.state = local_state
        yield
    finally:
        for g, ps in zip(groups, saved_params):
            g["params"] = ps
        locals_ = {}
        for p, local in local_of.items():
            local.grad = None
            # the shard is also the state_dict's value at stages 1-2 (_save_aliasing_shards): left
            # on it, the state pickled with it (process groups: torch.save failed from step 2 on)
            local.__dict__.pop("_zerofx_state", None)
            locals_[local] = p
        for key, entry in local_state.items():
            p = locals_.get(key)
            if p is None:
                saved_state[key] = entry
            else:
                before = saved_state.get(p, {})
                saved_state[p] = {k: _rewrap(v, before.get(k), p, key) for k, v in entry.items()}
        optimizer.state = saved_state
