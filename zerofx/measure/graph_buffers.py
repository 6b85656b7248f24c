"""Measured memory: the buffers zerofx's compiled graphs allocate while they run.

``MemoryTracker`` measures what the compiled program actually allocates, at dispatch level.
torch.compile does not run compiled code under a TorchDispatchMode entered around it (a mode
makes dynamo fall back to eager, which would measure a different program), so zerofx's
executor enters the tracker's mode *inside* each compiled graph it runs, around the graph's
own ATen calls, whenever a tracker is active::

    with zerofx.MemoryTracker() as mem:
        model(x, y).backward()
    mem.activation_peak, mem.peak, mem.parked_peak["disk"], mem.flops["backward"]

# NOTE: what the tracker counts
Every buffer (untyped storage) that an op in a compiled graph creates is tracked from that op
until the buffer is freed (a weakref callback on the storage, or the graph freeing its bytes with
``inductor::resize_storage_bytes_(t, 0)``, passes/transport.py): outputs of view ops and of ops
that return an input (in-place, out=) create no buffer. Buffers that existed before (parameter
shards, gradients of earlier steps, user inputs) and eager code between graphs are not counted.

* ``activation_peak``: the most bytes of *saved activations* resident at once. A saved
  activation is a buffer a forward graph created that is still alive when the graph returns,
  other than the graph's user-visible outputs: what the forward keeps for the backward (across
  graph breaks, all frames' saved buffers add up). Buffers parked by ``zerofx.offload`` are
  not resident and are counted per tier in ``parked_peak`` instead ("disk": file-backed pages
  the process never touches; "host": on a CPU-only machine this is the same RAM, reported
  separately so the device-side number means what it would on a GPU).
* ``peak``: the most bytes of all tracked, resident buffers at once (forward and backward
  temporaries included): the step's peak above what existed before it.
* ``flops``: per graph kind (forward, backward), counted with ``cost_model.op_flops`` (the same convention the plan uses).
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zerofx._scoped import Scoped
from zerofx.passes.cost_model import op_flops

__all__ = ["MemoryTracker", "active_tracker"]

_OFFLOAD_OP = "zerofx::offload"
_RELEASE = torch.ops.inductor.resize_storage_bytes_.default


class _Buffer:
    __slots__ = ("nbytes", "category", "ref")

    def __init__(self, nbytes: int, category: str):
        self.nbytes = nbytes
        self.category = category  # "temp", "saved", "host", "disk"
        self.ref: weakref.ref | None = None


class _Mode(TorchDispatchMode):
    def __init__(self, tracker: MemoryTracker, kind: str):
        super().__init__()
        self.tracker = tracker
        self.kind = kind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tracker = self.tracker
        if func is _RELEASE and args[1] == 0:  # the graph freed a buffer's bytes (passes/transport.py)
            tracker._forget(id(args[0].untyped_storage()))
            return out
        tracker.flops[self.kind] += op_flops(func, args, kwargs, out)
        returns = func._schema.returns
        outs = out if isinstance(out, (list, tuple)) else (out,)
        for i, t in enumerate(outs):
            if not isinstance(t, torch.Tensor) or (i < len(returns) and returns[i].alias_info is not None):
                continue
            if func.is_view:
                continue
            category = "temp"
            if func._schema.name == _OFFLOAD_OP:
                category = args[1] if len(args) > 1 else kwargs.get("tier", "host")
            tracker._track(t, category)
        return out


class MemoryTracker(Scoped):
    """Measure the buffers zerofx's compiled graphs allocate (see NOTE: what the tracker counts)."""

    def __init__(self) -> None:
        self.live: Counter[str] = Counter()
        self.activation_peak = 0
        self.peak = 0
        self.parked_peak: Counter[str] = Counter()
        self.flops: Counter[str] = Counter()
        self.saved_at_boundary: list[int] = []  # resident saved bytes when each forward graph returned
        self._buffers: dict[int, _Buffer] = {}
        self._lock = threading.RLock()  # a storage may be freed (callback) while we hold it

    # -- bookkeeping -----------------------------------------------------------------------------
    def _update_peaks(self) -> None:
        self.activation_peak = max(self.activation_peak, self.live["saved"])
        self.peak = max(self.peak, self.live["temp"] + self.live["saved"])
        for tier in ("host", "disk"):
            self.parked_peak[tier] = max(self.parked_peak[tier], self.live[tier])

    def _track(self, t: torch.Tensor, category: str) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        with self._lock:
            if key in self._buffers:
                return
            buf = _Buffer(storage.nbytes(), category)
            self._buffers[key] = buf
            self.live[category] += buf.nbytes
            self._update_peaks()

        def freed(_ref, key=key, tracker=weakref.ref(self)):
            me = tracker()
            if me is not None:
                me._forget(key)

        buf.ref = weakref.ref(storage, freed)

    def _forget(self, key: int) -> None:
        with self._lock:
            buf = self._buffers.pop(key, None)
            if buf is not None:
                self.live[buf.category] -= buf.nbytes

    def _mark_saved(self, saved: list[Any]) -> None:
        """After a forward graph: its surviving temporaries are now saved activations."""
        flat, _ = tree_flatten(saved)
        with self._lock:
            for t in flat:
                if not isinstance(t, torch.Tensor):
                    continue
                buf = self._buffers.get(id(t.untyped_storage()))
                if buf is not None and buf.category == "temp":
                    self.live["temp"] -= buf.nbytes
                    buf.category = "saved"
                    self.live["saved"] += buf.nbytes
            self._update_peaks()
            self.saved_at_boundary.append(self.live["saved"])

    # -- the executor's hook ---------------------------------------------------------------------
    def run_graph(self, fn: Callable, args: list, kind: str, num_user_outputs: int | None) -> Any:
        with _Mode(self, kind):
            out = fn(args)
        if kind == "forward" and num_user_outputs is not None and isinstance(out, (list, tuple)):
            self._mark_saved(list(out[num_user_outputs:]))
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "activation_peak": self.activation_peak,
            "peak": self.peak,
            "parked_peak": dict(self.parked_peak),
            "flops": dict(self.flops),
            "saved_at_boundary": list(self.saved_at_boundary),
        }


def active_tracker() -> MemoryTracker | None:
    """The innermost active tracker (the executor measures into it), or None."""
    return MemoryTracker.innermost()
