"""Offload tiers at run time: where parked activations and model state live, and how they move.

Two tiers below device memory, as in DeepSpeed's ZeRO-Offload / ZeRO-Infinity:

* ``host``: pinned host memory. On a CUDA device copies run on a side stream and the compute
  stream waits on an event only where the value is needed. On a CPU-only machine host memory
  *is* device memory: the copies are plain memcpys and save nothing; the tier still runs (and is
  tested) so that the graphs and their bookkeeping are the ones a GPU would run.
* ``disk``: files under ``Options.offload_dir`` (NVMe in practice). This is what makes offload
  real on a CPU-only machine: bytes on disk are not resident.

Model state (``place_model_state`` at ``zerofx.compile``, ``offload_optimizer`` on the optimizer):
each parameter shard and, after the first step, each optimizer-state tensor is moved into its
own memory-mapped file (``DiskStore``) by re-pointing the tensor at the mapping (``set_``), so
the model, autograd and the optimizer keep using the very same tensor objects. Pages come in
when something reads them (the forward's all-gather, the optimizer step) and are released
again right after (``page_out``: msync, ``MADV_DONTNEED``, ``POSIX_FADV_DONTNEED``): the
forward/backward graphs page each shard out after its last use, and the optimizer step runs a
window of parameters at a time, prefetching the next window (``MADV_WILLNEED``) while it
updates the current one.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import tempfile
import types
import weakref
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from zerofx.errors import ZeroFXError, some_names
from zerofx.ir.layout import pack_consecutive
from zerofx.ir.offload_ops import default_offload_dir, new_file, paged_storages, within_file_limit
from zerofx.runtime.local_step import (
    ELEMENTWISE,
    _class_step,
    class_step,
    fused_without_dtensor,
    step_over_whole_tensors,
)
from zerofx.runtime.params import optimizer_state, runtime_of
from zerofx.runtime.whole_step import Windows, stand_in, whole_step_class

__all__ = [
    "check_offload_dir",
    "resolve_offload_dir",
    "DiskStore",
    "place_model_state",
    "offload_optimizer",
    "state_store",
]


# -- the offload folder --------------------------------------------------------------------------


def check_offload_dir(path: str | os.PathLike) -> None:
    """Create ``path`` if needed and prove it takes a file, or raise a ZeroFXError naming it."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path) as f:
            f.write(b"zerofx")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise ZeroFXError(
            f"option offload_dir={str(path)!r} is not a writable folder ({e.strerror or e}); "
            "disk offload needs one: pass offload_dir=<a folder on a local disk>"
        ) from None


def resolve_offload_dir(options):
    """``options`` with ``offload_dir`` filled in (the default folder when unset) and proven
    writable, when anything may go to disk; unchanged otherwise. Called where the folder is
    first needed (``zerofx.compile``, the backend), so a bad path fails before tracing."""
    if not options.memory.uses_disk:
        return options
    folder = options.offload_dir if options.offload_dir is not None else default_offload_dir()
    check_offload_dir(folder)
    if folder == options.offload_dir:
        return options
    return dataclasses.replace(options, offload_dir=str(folder))


# -- model state on disk -------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class DiskStore:
    """Tensors whose bytes live in memory-mapped files under one folder (one file per tensor).

    Each file is unlinked at creation; its bytes stay on disk while its descriptor is open and
    its mapping is alive. The tensor's storage holds the mapping (``torch.frombuffer``); the store
    only refers to it weakly, and when the storage dies (the model and optimizer are gone) the
    mapping's finalizer closes the descriptor and forgets the entry, so the disk space comes
    back then, not at process exit.
    """

    def __init__(self, directory: str | None):
        directory = default_offload_dir() if directory is None else directory
        check_offload_dir(directory)  # where the folder is first used: created, proven writable
        self.directory = str(directory)
        # data_ptr -> (a weak reference to the mapping, its file descriptor, nbytes)
        self.files: dict[int, tuple[weakref.ref, int, int]] = {}

    def __contains__(self, t: torch.Tensor) -> bool:
        return _local(t).untyped_storage().data_ptr() in self.files

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in list(self.files.values()))  # a copy: a finalizer may drop entries meanwhile

    def reserve(self, nbytes: int) -> tuple[int, mmap.mmap]:
        """A new file of ``nbytes`` bytes (allocated) and its memory map, for ``adopt`` to fill
        later: what can fail about a file (no room, no folder, no descriptor left) fails here."""
        fd = new_file(self.directory, nbytes)
        try:  # the map keeps a descriptor of its own (a dup of fd)
            mapping = within_file_limit(
                lambda: mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            )
        except BaseException:
            os.close(fd)
            raise
        return fd, mapping

    def adopt(self, t: torch.Tensor, reserved: tuple[int, mmap.mmap] | None = None) -> None:
        """Move ``t``'s bytes into a new file (``reserved``: that one, from ``reserve`` with
        ``t``'s bytes) and re-point ``t`` (its local shard) at the mapping."""
        local = _local(t)
        nbytes = local.numel() * local.element_size()
        if nbytes == 0 or t in self:
            if reserved is not None:
                _close(reserved)
            return
        # in storage order: a shard split along another dim is a permuted view (NOTE: the sharded dim)
        order = sorted(range(local.dim()), key=lambda d: -local.stride(d))
        in_order = local.permute(order)
        if not in_order.is_contiguous() or local.device.type != "cpu":
            if reserved is not None:
                _close(reserved)
            raise ZeroFXError(
                "disk offload keeps dense CPU tensors; got "
                f"{'a strided' if local.device.type == 'cpu' else local.device.type} tensor"
            )
        if reserved is not None and len(reserved[1]) != nbytes:
            _close(reserved)
            reserved = None
        fd, mapping = self.reserve(nbytes) if reserved is None else reserved
        data = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes).view(local.dtype)
        data.copy_(in_order.reshape(-1))
        with torch.no_grad():
            local.set_(data.untyped_storage(), 0, local.shape, local.stride())
        ptr = local.untyped_storage().data_ptr()
        self.files[ptr] = (weakref.ref(mapping), fd, nbytes)
        paged_storages[ptr] = self
        weakref.finalize(mapping, self._release, ptr, fd).atexit = False  # at exit the process closes it
        self.page_out(t)

    def _release(self, ptr: int, fd: int) -> None:
        """The mapping at ``ptr`` is gone with its storage: close its file, which frees its bytes.
        The address may already hold a newer mapping (the unmap comes first, and another thread may
        adopt a tensor meanwhile): its entry has another descriptor, and stays."""
        entry = self.files.get(ptr)
        if entry is not None and entry[1] == fd:
            del self.files[ptr]
            if paged_storages.get(ptr) is self:
                del paged_storages[ptr]
        os.close(fd)

    def _mapping(self, t: torch.Tensor) -> tuple[mmap.mmap, int] | None:
        entry = self.files.get(_local(t).untyped_storage().data_ptr())
        mapping = entry[0]() if entry is not None else None
        return None if mapping is None else (mapping, entry[1])

    def page_out(self, t: torch.Tensor) -> None:
        """Write ``t``'s dirty pages to its file and drop them from this process and the page cache."""
        entry = self._mapping(t)
        if entry is None:
            return
        mapping, fd = entry
        mapping.flush()
        mapping.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def prefetch(self, t: torch.Tensor) -> None:
        """Ask the kernel to start reading ``t``'s pages now (asynchronous readahead)."""
        entry = self._mapping(t)
        if entry is not None:
            entry[0].madvise(mmap.MADV_WILLNEED)


def _close(reserved: tuple[int, mmap.mmap]) -> None:
    """Give back a file ``DiskStore.reserve`` made and nothing adopted."""
    fd, mapping = reserved
    mapping.close()
    os.close(fd)


_param_store = WeakIdKeyDictionary()  # parameter -> (tier, store, window)


def state_store(param: torch.Tensor) -> tuple[str, DiskStore | None, int] | None:
    """``(tier, store, window bytes)`` for a parameter placed by ``place_model_state``, else None."""
    return _param_store.get(param)


def place_model_state(model: torch.nn.Module, options) -> str:
    """Put the model's parameter shards in the tier ``options.offload_optimizer`` names.

    Returns the tier chosen ("none", "host" or "disk"; "auto" resolves by ``host_memory_cap``:
    disk when parameters plus Adam's two moments would not fit in it)."""
    tier = options.offload_optimizer
    if tier == "none":
        return tier
    params = list(dict.fromkeys(model.parameters()))
    # the largest shard of each (NOTE: windows every rank agrees on): "auto" picks one tier on every rank
    param_bytes = sum(_agreed_bytes(p) for p in params)
    if tier == "auto":
        tier = "disk" if 3 * param_bytes > options.host_memory_cap else "host"
    window = options.host_memory_cap // 8 if options.host_memory_cap else 64 * 2**20
    store = None
    runtime = runtime_of(model)
    if tier == "disk":
        in_whole = [
            s.qualname
            for s in runtime.states
            if s.full is not None
            and _local(s.param).untyped_storage().data_ptr() == s.full.untyped_storage().data_ptr()
        ]
        if in_whole:
            raise ZeroFXError(
                f"offload_optimizer='disk' at stage {runtime.stage}: the model was sharded without it, so "
                f"its shards are rows of the whole copies in memory ({some_names(in_whole)}), not tensors "
                "a file can hold; shard with the same option (zerofx.shard(model, mesh, stage=..., "
                "offload_optimizer='disk')) or let zerofx.compile shard the model"
            )
        for p in params:
            if _local(p).device.type != "cpu":
                raise ZeroFXError(
                    "offload_optimizer='disk' keeps parameter shards in memory-mapped files, "
                    f"which the device reads directly only on CPU; this model is on "
                    f"{_local(p).device}: use offload_optimizer='host'"
                )
        failed = None
        try:  # a rank's own disk (full, removed) fails there alone: every rank stops, none goes on to wait
            store = DiskStore(options.offload_dir)
            for p in params:
                store.adopt(p)
        except Exception as e:  # whatever it is: the other ranks must not go on to wait for this one
            failed = e
        if _any_rank_failed(_agree_groups(params), failed is not None) or failed is not None:
            if failed is not None:
                raise failed
            raise ZeroFXError(
                "offload_optimizer='disk': another rank could not put its parameter shards in files under its "
                "offload_dir, so zerofx.compile stopped on every rank (that rank's error says why)"
            )
    for p in params:
        _param_store[p] = (tier, store, window)
    for state in runtime.whole_copies:
        state.mark_synced()  # adopting a shard re-points it (set_), which counts as a write
    for state in runtime.states if store is not None else ():
        if state.leaf is not None:
            state.make_leaf()  # the graphs' input over the shard follows it into the file
    runtime.state_tier = tier
    where = (
        f"{len(store.files)} memory-mapped files under {store.directory} ({store.nbytes} B)"
        if store
        else "host memory"
        + (" (this CPU's own memory: nothing moves)" if params and _local(params[0]).device.type == "cpu" else "")
    )
    runtime.state_report = (
        f"model state: offload_optimizer={options.offload_optimizer!r} -> {tier}: {len(params)} parameter shards "
        f"({param_bytes} B; with Adam's two moments {3 * param_bytes} B"
        + (f", host_memory_cap {options.host_memory_cap} B" if options.host_memory_cap else "")
        + f") in {where}; the optimizer steps {window} B windows (call zerofx.offload_optimizer(opt))"
    )
    return tier


def _agreed_bytes(p: torch.Tensor) -> int:
    """The bytes of the largest shard of ``p`` over its ranks (the global shape split as DTensor
    splits it, rounded up): the same number on every rank, at least this rank's shard."""
    if not isinstance(p, DTensor):
        return p.numel() * p.element_size()
    shape = list(p.shape)
    for mesh_dim, placement in enumerate(p.placements):
        if placement.is_shard():
            n = p.device_mesh.size(mesh_dim)
            shape[placement.dim] = -(-shape[placement.dim] // n)
    return math.prod(shape) * p.element_size()


def _windows(params: list[torch.Tensor], window: int, state_factor: int = 3) -> list[list[torch.Tensor]]:
    """Consecutive groups of parameters whose bytes (with their optimizer state) fit ``window``;
    a parameter larger than the window is a group of its own. Packed from the largest shard of
    each parameter (``_agreed_bytes``), so every rank packs the same windows (NOTE: windows
    every rank agrees on)."""
    return pack_consecutive(params, lambda p: _agreed_bytes(p) * state_factor, window)


# NOTE: windows every rank agrees on
# Only the optimizers of ``ELEMENTWISE`` (exact classes, zerofx/runtime/local_step.py) step in
# windows with their param groups narrowed: their update of a parameter reads that parameter,
# its gradient and its own state only. Any other class may read across parameters inside its
# step (a global gradient-norm clip: timm's Lamb) or keep state in its groups (schedule-free's
# group['k']): narrowed, it would clip by a window's norm and count a step per window. Such a
# class steps over its whole groups in one window, as in memory (on a CPU: a disk-tier step
# then maps all its state at once, and the kernel pages it as it needs), or, where its state
# would have to move to an accelerator whole (host tier), is refused when offloaded. The
# windows are packed from sizes every rank computes alike (the largest shard of each
# parameter), never from this rank's shard sizes: with uneven shards those differ, and so would
# the number of windows, and with it of anything a step runs per window.

# NOTE: a step that cannot leave half its windows stepped
# At the disk tier each optimizer-state tensor gets its file the first time its window is
# parked, after its window has stepped. Were that file's creation to fail (a full disk, the
# folder gone, no descriptor left) in a later window, the earlier windows would be stepped
# and a retry would step them twice. So before a step whose parameters were not all parked yet
# (the first), the step's files are made first (``_reserve``): the state each parameter will
# hold is learned from the class's own step over a one-element stand-in parameter (a stand-in
# optimizer: nothing real is read or written), and a file of the shard's bytes and its memory
# map are made for each parameter-shaped state tensor; the ranks then agree that every rank
# made its files (one small all-reduce per group, first steps only), and a failure anywhere
# raises on every rank before any window steps. Anything that still fails after a window
# stepped marks the optimizer: its next step refuses (saying the last one was partly applied)
# until ``load_state_dict`` gives it a consistent state again.

_PARTLY = "_zerofx_partly_stepped"  # an optimizer's attribute: why its step refuses


def _refuse_partly_stepped(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    message = vars(optimizer).get(_PARTLY)
    if message is not None:
        raise ZeroFXError(message)


def _forget_partly_stepped(optimizer: torch.optim.Optimizer) -> None:
    vars(optimizer).pop(_PARTLY, None)


def _mark_partly_stepped(optimizer: torch.optim.Optimizer, error: BaseException) -> None:
    line = (str(error).strip().splitlines() or [""])[0][:300]
    vars(optimizer)[_PARTLY] = (
        f"zerofx.offload_optimizer: a step of this {type(optimizer).__name__} failed part-way ({type(error).__name__}: "
        f"{line}) after some of its windows had stepped, so some parameters and their state took that step "
        "and others did not; stepping again would step those twice. Load a checkpoint (model and optimizer: "
        "optimizer.load_state_dict clears this), or build a new optimizer"
    )


def _agree_groups(params: list[torch.Tensor]) -> list[tuple]:
    """The process groups (of more than one rank) the parameters span, in their order."""
    groups: dict[str, tuple] = {}
    for p in params:
        s = getattr(p, "_zerofx_state", None)
        for g in (s.shard_group, s.replicate_group) if s is not None else ():
            if g is not None and g.size > 1:
                groups.setdefault(g.name, (g, _local(p).device))
    return list(groups.values())


def _any_rank_failed(groups: list[tuple], failed: bool) -> bool:
    flag = int(failed)
    for group, device in groups:
        t = torch.tensor([flag], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_resolve_process_group(group.name))
        flag = max(flag, int(t))
    return bool(flag)


def _state_layout(optimizer: torch.optim.Optimizer, index: int, p: torch.Tensor) -> dict[str, torch.dtype] | None:
    """The parameter-shaped state tensors (key -> dtype) the class's step leaves for ``p`` of
    param group ``index``: from one step of a stand-in optimizer over a one-element stand-in
    parameter (with ``p``'s state, if it has any yet, as its state). None where that step fails."""
    local = _local(p)
    dummy = torch.zeros(1, dtype=local.dtype, device=local.device)
    dummy.grad = torch.zeros(1, dtype=local.dtype, device=local.device)
    seeded: dict[str, Any] = {}
    for k, v in optimizer.state.get(p, {}).items():
        if isinstance(v, torch.Tensor):
            v = _local(v)
            seeded[k] = torch.zeros(1, dtype=v.dtype, device=v.device) if v.dim() > 0 else v.detach().clone()
        else:
            seeded[k] = v
    groups = [{**g, "params": [dummy] if i == index else []} for i, g in enumerate(optimizer.param_groups)]
    state: defaultdict = defaultdict(dict)
    if seeded:
        state[dummy] = seeded
    try:
        _class_step(optimizer)(stand_in(optimizer, groups, state))
    except Exception:
        return None
    return {
        k: v.dtype
        for k, v in state.get(dummy, {}).items()
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == 1
    }


def _reserve(
    optimizer: torch.optim.Optimizer, store: DiskStore, params: list[torch.Tensor]
) -> dict[tuple[int, str], tuple[int, mmap.mmap]]:
    """The files (and maps) the state of ``params`` will need (NOTE: a step that cannot leave half
    its windows stepped), by (id of the parameter, state key); on a failure none are kept."""
    index_of = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    layouts: dict[tuple, dict | None] = {}
    reserved: dict[tuple[int, str], tuple[int, mmap.mmap]] = {}
    try:
        for p in params:
            local = _local(p)
            if local.numel() == 0 or local.device.type != "cpu":
                continue
            have = optimizer.state.get(p, {})
            key = (index_of[p], local.dtype, tuple(sorted(map(str, have))))
            if key not in layouts:
                layouts[key] = _state_layout(optimizer, index_of[p], p)
            for k, dtype in (layouts[key] or {}).items():
                value = have.get(k)
                if isinstance(value, torch.Tensor) and value in store:
                    continue
                reserved[(id(p), k)] = store.reserve(local.numel() * dtype.itemsize)
    except BaseException:
        for r in reserved.values():
            _close(r)
        raise
    return reserved


def offload_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer`` keep its state where the model's ``offload_optimizer`` option put the
    parameters, and step a window of parameters at a time. Returns the same optimizer.

    An optimizer of ``ELEMENTWISE`` (Adam, AdamW, SGD, ...: exact classes, whose update of a
    parameter reads only it, its gradient and its state) steps each window by its own ``step``
    with its parameter groups narrowed to that window, so the arithmetic is the optimizer's,
    unchanged; its step hooks (its own, torch's global ones) run once per step around the
    windows, with the whole groups. One that steps over whole tensors (Adafactor,
    Muon: zerofx/runtime/whole_step.py) steps its own windows of whole tensors, at most the
    window's bytes at a time; after each, the state shaped like the parameters (sharded: Muon's
    momentum, an unfactored variance) goes back to the tier, while the small state every rank
    holds whole (Adafactor's row and column factors, step counts) stays in memory. Any other
    class (one that may clip by a global norm or keep state in its groups) steps over its whole
    groups in one window, on a CPU; on an accelerator (host tier) it is refused (NOTE: windows
    every rank agrees on)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    placed = [state_store(p) for p in params]
    if not params or any(s is None for s in placed):
        raise ZeroFXError(
            "zerofx.offload_optimizer: build the optimizer over a model compiled with "
            "zerofx.compile(..., offload_optimizer='host' | 'disk' | 'auto')"
        )
    tier, store, window = placed[0]
    if fused_without_dtensor(optimizer):
        raise ZeroFXError(
            f"zerofx.offload_optimizer: torch.optim.{type(optimizer).__name__}(fused=True) has no DTensor "
            "kernel, and offloaded windows step through DTensor: build it without fused=True (foreach or the "
            "default), or keep its state in memory"
        )
    whole = whole_step_class(optimizer) is not None
    # an ELEMENTWISE class, or a subclass that keeps its step (a user's AdamW with another name)
    elementwise = any(isinstance(optimizer, c) and _class_step(optimizer) is class_step(c) for c in ELEMENTWISE)
    if not whole and not elementwise and any(_local(p).device.type != "cpu" for p in params):
        cls = type(optimizer)
        raise ZeroFXError(
            f"zerofx.offload_optimizer: {cls.__module__}.{cls.__qualname__} is not one of the optimizers known to "
            "update each parameter from its own gradient and state alone (zerofx.runtime.local_step.ELEMENTWISE: "
            "exact classes), so its step cannot run a window of parameters at a time (a global gradient-norm clip "
            "or a group-level counter would be computed per window), and stepping it whole would bring all its "
            f"state to {_local(params[0]).device} at once: keep its state in memory (offload_optimizer='none'), "
            "or use one of those optimizers"
        )
    state = optimizer_state(optimizer, create=True)
    if state.offload is not None:
        return optimizer
    optimizer.register_step_pre_hook(_refuse_partly_stepped)
    optimizer.register_load_state_dict_post_hook(_forget_partly_stepped)
    if whole:
        # its own windows, over whole tensors (NOTE: whole-tensor steps); each window's
        # parameter-shaped state parked after it like an elementwise window's
        def before(win: list[torch.Tensor], following: list[torch.Tensor]) -> None:
            _swap_in(optimizer, win, tier)
            for p in following if store is not None else ():
                _prefetch(optimizer, store, p)

        def after(win: list[torch.Tensor]) -> None:
            try:
                _park(optimizer, win, tier, store, rows_only=True)
            except BaseException as e:  # this window (and those before it) stepped
                _mark_partly_stepped(optimizer, e)
                raise

        step_over_whole_tensors(optimizer, Windows(window, before, after))
        state.offload = (tier, store, window)
        return optimizer
    state.offload = (tier, store, window)
    state.local_step = False  # windows step through DTensor (zerofx/runtime/local_step.py)
    parked = WeakIdKeyDictionary()  # parameters whose state went to the tier once (-> True)

    def windows_step(self: torch.optim.Optimizer, closure: Callable | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        full = [list(g["params"]) for g in self.param_groups]
        ordered = [p for ps in full for p in ps if p.grad is not None]
        # (NOTE: windows every rank agrees on) another class: its whole groups, in one window
        windows = _windows(ordered, window) if elementwise else [ordered]
        reserved: dict = {}
        if store is not None and any(p not in parked for p in ordered):  # the same on every rank
            # (NOTE: a step that cannot leave half its windows stepped)
            failed: BaseException | None = None
            try:
                reserved = _reserve(self, store, ordered)
            except Exception as e:
                failed = e
            if _any_rank_failed(_agree_groups(ordered), failed is not None) or failed is not None:
                for r in reserved.values():
                    _close(r)
                if failed is not None:
                    raise failed
                raise ZeroFXError(
                    "zerofx.offload_optimizer: another rank could not make the files of this step's optimizer "
                    "state (under its offload_dir); no parameter took this step on any rank (that rank's "
                    "error says why)"
                )
            # every rank made its files: from here the set changes alike on every rank, whatever fails later
            parked.update(dict.fromkeys(ordered, True))
        stepped = False  # whether a window's step ran to its end (a failure from then on is part-way)
        try:
            for i, win in enumerate(windows):
                if store is not None and i + 1 < len(windows):
                    for p in windows[i + 1]:
                        _prefetch(self, store, p)
                if elementwise:
                    members = set(win)
                    for g, ps in zip(self.param_groups, full):
                        g["params"] = [p for p in ps if p in members]
                _swap_in(self, win, tier)
                _class_step(self)(self)  # without torch's hooks: they run once per step (NOTE below)
                stepped = True
                _park(self, win, tier, store, reserved)
        except BaseException as e:
            if stepped:
                _mark_partly_stepped(self, e)
            raise
        finally:
            for g, ps in zip(self.param_groups, full):
                g["params"] = ps
            for r in reserved.values():
                _close(r)
        return loss

    # NOTE: step hooks around the windows
    # The step pre- and post-hooks (the optimizer's own and torch's global ones, zerofx's among
    # them: the adopting pre-hook, the refresh of whole copies after the step) run once per step,
    # around all the windows, with the whole parameter groups, by torch's own wrapper, as they run
    # around an optimizer's step in memory; each window runs the class's step without them.
    hooked_step = torch.optim.Optimizer.profile_hook_step(windows_step)
    after_scheduler = getattr(optimizer.step, "_wrapped_by_lr_sched", False)

    def streamed_step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if after_scheduler:
            self._opt_called = True  # what the scheduler's wrapper this step replaces recorded
        return hooked_step(self, *args, **kwargs)

    if after_scheduler:  # an LR scheduler built before wrapped the step this one replaces: keep its mark
        streamed_step._wrapped_by_lr_sched = True
    optimizer.step = types.MethodType(streamed_step, optimizer)
    return optimizer


def _state_tensors(optimizer: torch.optim.Optimizer, p: torch.Tensor):
    for key, value in optimizer.state.get(p, {}).items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            yield key, value


def _prefetch(optimizer: torch.optim.Optimizer, store: DiskStore, p: torch.Tensor) -> None:
    store.prefetch(p)
    for _, value in _state_tensors(optimizer, p):
        store.prefetch(value)


def _swap_in(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], tier: str) -> None:
    """Host tier on an accelerator: bring this window's state from pinned host memory."""
    if tier != "host":
        return
    for p in params:
        device = _local(p).device
        if device.type == "cpu":
            continue
        for key, value in list(_state_tensors(optimizer, p)):
            optimizer.state[p][key] = _with_local(value, _local(value).to(device, non_blocking=True))


def _park(
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    tier: str,
    store: DiskStore | None,
    reserved: dict | None = None,
    rows_only: bool = False,
) -> None:
    """After this window's step: state back to its tier, and its pages out of memory
    (``rows_only``: only the state sharded like the parameter, the DTensors; ``reserved``: files
    made for it before the step, by (id of the parameter, key), taken from there)."""
    for p in params:
        for key, value in list(_state_tensors(optimizer, p)):
            if rows_only and not isinstance(value, DTensor):
                continue
            if store is not None:
                if value not in store:
                    store.adopt(value, reserved.pop((id(p), key), None) if reserved else None)
                else:
                    store.page_out(value)
            elif tier == "host" and _local(value).device.type != "cpu":
                host = torch.empty(_local(value).shape, dtype=_local(value).dtype, pin_memory=True)
                host.copy_(_local(value))
                optimizer.state[p][key] = _with_local(value, host)
        if store is not None:
            store.page_out(p)


def _with_local(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if isinstance(like, DTensor):
        return DTensor.from_local(
            local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
        )
    return local
