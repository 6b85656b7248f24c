"""Transient bytes of eager code on fake tensors: what ``zerofx.plan`` adds for the optimizer step.

The planner runs the optimizer's step on fake tensors (zerofx/planner.py), where no allocator
counts anything. ``TransientBytes`` is a dispatch mode that watches every storage the code
under it creates: a storage's bytes count from the op that made it until its last Python
reference dies (a weak reference's callback; views and in-place results share a storage and
add nothing). Storages that outlive the region (state the step created, a replaced state
tensor) are model state, which the plan counts elsewhere, so ``peak`` is the most bytes held
at once by storages created in the region and freed before it ended: the step's transient, on
top of whatever it started from and kept.

Why not the profiler (``AllocationTrace``): fake tensors allocate nothing. Why not torch's
``torch.distributed._tools.mem_tracker.MemTracker``: it is private, tracks whole modules and
categories, and counts the surviving state into its peak; the plan needs only the region's
transient. Ops a tensor subclass runs inside its own dispatch (DTensor redistributing) are
below the mode and unseen; their results are seen through the subclass's inner tensors.
zerofx's optimizer steps run on plain local tensors (zerofx/runtime/local_step.py,
whole_step.py), so the step's own arithmetic is all seen.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["TransientBytes"]


class TransientBytes(TorchDispatchMode):
    """``with TransientBytes() as t: code()``, then ``t.peak``: the most bytes that storages made
    inside the region and freed inside it held at once (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        # live storages made here, by address: (serial number, a weak reference kept alive here)
        self._refs: dict[int, tuple[int, weakref.ref]] = {}
        self._events: list[tuple[int, int]] = []  # (serial number, +bytes made / -bytes freed)
        self._open = True
        self.peak = 0

    def _track(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            for name in names:
                self._track(getattr(t, name))
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._refs:
            return
        nbytes, serial = storage.nbytes(), len(self._events)  # (an address is reused once freed)
        self._events.append((serial, nbytes))

        def freed(_: Any) -> None:
            if self._open:
                self._events.append((serial, -nbytes))
            self._refs.pop(key, None)

        self._refs[key] = (serial, weakref.ref(storage, freed))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._open = False
        survivors = {serial for serial, _ in self._refs.values()}  # still referenced: kept state
        live = 0
        for serial, delta in self._events:
            if serial not in survivors:
                live += delta
                self.peak = max(self.peak, live)
        self._refs.clear()
