"""Delay injection for stress runs: seeded random sleeps where ranks and threads can race.

FSDP2's tests find ordering and lifetime bugs by sleeping before collectives, so that a
collective's worker thread finishes long before (or long after) the code around it expects.
zerofx does the same, switched on by one environment variable, read once at import::

    ZEROFX_STRESS_DELAY="SEED:MAX_MS"      e.g. "7:5": seed 7, sleeps of up to 5 ms

Unset (or empty), nothing is installed: ``wrap_graph`` returns the graph's callable unchanged,
``collectives()`` is one shared ``nullcontext`` and no optimizer hook exists, so the cost is
one branch when an executor is built and at import.

Where it sleeps (each point sleeps with probability 1/2, uniformly in [0, MAX_MS]; the
sequence comes from ``random.Random`` seeded with SEED and the rank, so a run is reproducible
as far as the ranks' own order goes):

* before every functional collective is issued and before every ``wait_tensor``, inside
  zerofx's compiled graphs (every executor's callable is wrapped by ``wrap_graph``, in
  codegen/executor.py) and in the eager flat-bucket collectives (zerofx/runtime/eager_buckets.py's
  ``refresh`` and ``reduce_pending``, decorated with ``eager``). One TorchDispatchMode, entered only while those run, sees the
  ops as they are dispatched, so the graphs themselves are unchanged (dumps, counts and
  the memory estimate are the same with and without stress);
* before zerofx's activation-offload waits and issues (``zerofx::offload``, ``reload``,
  ``reload_wait``), whose copies run on a background thread;
* before and after every optimizer step (global ``torch.optim`` step pre/post hooks,
  registered at import), around zerofx's own optimizer hooks (zerofx/runtime/local_step.py, the stage-1/2
  refresh).

Why a dispatch mode rather than a graph pass inserting sleep ops: a pass would change what
every other pass, the dump and the cost model see, and would miss the eager collectives;
the mode needs one hook per place collectives run and nothing else. The sleeps cannot change
results: they only move when host code runs relative to gloo's worker threads.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import time
from typing import Any, Callable

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ENV", "parse", "CONFIG", "delay", "collectives", "eager", "wrap_graph"]

ENV = "ZEROFX_STRESS_DELAY"


def parse(value: str | None) -> tuple[int, float] | None:
    """``"SEED:MAX_MS"`` -> ``(seed, max seconds)``; None when unset or empty."""
    if not value:
        return None
    try:
        seed, max_ms = value.split(":")
        config = int(seed), float(max_ms) / 1000.0
    except ValueError:
        raise ValueError(f"{ENV}={value!r}: expected SEED:MAX_MS, e.g. 7:5") from None
    if config[1] < 0:
        raise ValueError(f"{ENV}={value!r}: MAX_MS must be >= 0")
    return config


CONFIG = parse(os.environ.get(ENV))
_rng: random.Random | None = None
_NULL = contextlib.nullcontext()


def delay(where: str = "") -> None:
    """Sleep a seeded random time (see the module docstring); a no-op when stress is off."""
    global _rng
    if CONFIG is None:
        return
    if _rng is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        _rng = random.Random(CONFIG[0] * 1_000_003 + rank)
    if _rng.random() < 0.5:
        time.sleep(_rng.uniform(0.0, CONFIG[1]))


# zerofx's own ops that issue or wait for transfers (the pair exchanges are collectives).
_ZEROFX_DELAYED = ("offload", "reload", "reload_wait", "all_gather_pair_out", "reduce_scatter_pair_out")


def _delayed_op(func: Any) -> bool:
    ns = getattr(func, "namespace", None)
    return ns == "_c10d_functional" or (ns == "zerofx" and func._opname in _ZEROFX_DELAYED)


class _DelayMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _delayed_op(func):
            delay(func._opname)
        return func(*args, **(kwargs or {}))


def collectives() -> contextlib.AbstractContextManager:
    """Sleep before the collectives (and their waits) issued inside this block."""
    return _DelayMode() if CONFIG is not None else _NULL


def eager(fn: Callable) -> Callable:
    """Decorator: ``fn`` (eager code issuing collectives) run under ``collectives()``; ``fn``
    itself when stress is off."""
    if CONFIG is None:
        return fn

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _DelayMode():
            return fn(*args, **kwargs)

    return run


def wrap_graph(fn: Callable) -> Callable:
    """``fn`` (a boxed graph callable) running under ``collectives()``; ``fn`` itself when off."""
    if CONFIG is None:
        return fn

    def run(args: list) -> Any:
        with _DelayMode():
            return fn(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


if CONFIG is not None:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(lambda opt, args, kwargs: delay("optimizer.step pre"))
    register_optimizer_step_post_hook(lambda opt, args, kwargs: delay("optimizer.step post"))
