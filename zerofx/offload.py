"""Offload tiers at run time: where parked activations and model state live, and how they move.

Two tiers below device memory, as in DeepSpeed's ZeRO-Offload / ZeRO-Infinity:

* ``host``: pinned host memory. On a CUDA device copies run on a side stream and the compute
  stream waits on an event only where the value is needed. On a CPU-only machine host memory
  *is* device memory: the copies are plain memcpys and save nothing; the tier still runs (and is
  tested) so that the graphs and their bookkeeping are the ones a GPU would run.
* ``disk``: files under ``Options.offload_dir`` (NVMe in practice). This is what makes offload
  real on a CPU-only machine: bytes on disk are not resident.

Activations (graph ops, inserted by ``passes/offload.py``)::

    parked = zerofx.offload(x, tier, dir)         # after x's last forward use; returns at once,
                                                  # the copy/write runs asynchronously
    y = zerofx.reload(parked, tier, dev, size, stride)   # ahead of the first backward use: starts
    y = zerofx.reload_wait(y)                     # the read; the wait sits just before the use

A disk-parked activation is a tensor backed by a memory-mapped file (``torch.from_file``) whose
pages are written with ``pwrite`` by a background thread and never touched by this process
until the reload, so it holds no resident memory in between. The source tensor is kept alive by
the writer until its bytes are on disk, then freed.

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

import ctypes
import mmap
import os
import tempfile
import threading
import types
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from zerofx.errors import ZeroFXError

__all__ = ["default_offload_dir", "check_offload_dir", "DiskStore", "place_model_state", "offload_optimizer",
           "state_store", "OFFLOAD", "RELOAD", "RELOAD_WAIT", "PAGE_OUT"]


# -- the offload folder --------------------------------------------------------------------------

def default_offload_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "zerofx-offload")


def check_offload_dir(path: str | os.PathLike) -> None:
    """Create ``path`` if needed and prove it takes a file, or raise a ZeroFXError naming it."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path) as f:
            f.write(b"zerofx")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise ZeroFXError(f"option offload_dir={str(path)!r} is not a writable folder ({e.strerror or e}); "
                          "disk offload needs one: pass offload_dir=<a folder on a local disk>") from None


def _new_file(directory: str, nbytes: int) -> int:
    """An open, unlinked file of ``nbytes`` bytes: it disappears when the last user closes it."""
    fd, path = tempfile.mkstemp(dir=directory, prefix="zerofx-", suffix=".bin")
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.unlink(path)
    return fd


def _pwrite_all(fd: int, data: memoryview, offset: int = 0) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (and without needing numpy); the
    caller keeps ``t`` alive while the view is used."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


# -- activation offload: ops ---------------------------------------------------------------------

_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerofx-offload")
_pending: dict[int, Any] = {}  # data_ptr of a parked or reloading tensor -> Future or CUDA event
_pending_lock = threading.Lock()
_side_streams: dict[torch.device, Any] = {}


def _side_stream(device: torch.device):
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device)
    return _side_streams[device]


def _register(t: torch.Tensor, waitable: Any) -> None:
    with _pending_lock:
        _pending[t.data_ptr()] = waitable


def _take(t: torch.Tensor) -> Any:
    with _pending_lock:
        return _pending.pop(t.data_ptr(), None)


def _write_parked(fd: int, src: torch.Tensor, event: Any) -> None:
    try:
        if event is not None:
            event.synchronize()
        _pwrite_all(fd, _bytes_view(src))
    finally:
        os.close(fd)


@torch.library.custom_op("zerofx::offload", mutates_args=())
def offload(x: torch.Tensor, tier: str, directory: str) -> torch.Tensor:
    """Park ``x`` in ``tier``; returns the parked tensor at once while the copy completes."""
    if tier == "disk":
        nbytes = x.numel() * x.element_size()
        fd = _new_file(directory, max(nbytes, 1))
        parked = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=x.numel(), dtype=x.dtype).view(x.shape)
        event = None
        if x.device.type == "cuda":
            staged = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            stream = _side_stream(x.device)
            stream.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(stream):
                staged.copy_(x, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            x.record_stream(stream)
            src = staged
        else:
            src = x.contiguous()
        _register(parked, _io.submit(_write_parked, fd, src, event))
        return parked
    if x.device.type == "cuda":  # host tier: pinned buffer, copied on the side stream
        parked = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        stream = _side_stream(x.device)
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):
            parked.copy_(x, non_blocking=True)
        x.record_stream(stream)
        return parked
    return x.contiguous().clone()  # host tier on a CPU: host memory is device memory


@offload.register_fake
def _offload_fake(x, tier, directory):
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


def _read_parked(parked: torch.Tensor, dst: torch.Tensor, written: Future | None) -> None:
    if written is not None:
        written.result()
    dst.copy_(parked)


@torch.library.custom_op("zerofx::reload", mutates_args=())
def reload(parked: torch.Tensor, tier: str, device: torch.device, size: list[int], stride: list[int]) -> torch.Tensor:
    """Start bringing ``parked`` back to ``device`` with its original layout; pair with reload_wait."""
    written = _take(parked)
    if device.type == "cuda":
        host = parked
        if tier == "disk":
            host = torch.empty(parked.shape, dtype=parked.dtype, pin_memory=True)
            _read_parked(parked, host, written)
        dst = torch.empty_strided(size, stride, dtype=parked.dtype, device=device)
        stream = _side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            dst.copy_(host.view(size), non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        dst.record_stream(stream)
        _register(dst, event)
        return dst
    dst = torch.empty_strided(size, stride, dtype=parked.dtype, device=device)
    if tier == "disk":
        _register(dst, _io.submit(_read_parked, parked, dst, written))
    else:
        dst.copy_(parked)
    return dst


@reload.register_fake
def _reload_fake(parked, tier, device, size, stride):
    return torch.empty_strided(size, stride, dtype=parked.dtype, device=device)


_lib = torch.library.Library("zerofx", "FRAGMENT")
_lib.define("reload_wait(Tensor(a) t) -> Tensor(a)")
_lib.define("page_out(Tensor t) -> ()")


def _reload_wait(t: torch.Tensor) -> torch.Tensor:
    """Block until ``t``'s reload has landed (an event wait on CUDA: the host does not block)."""
    waitable = _take(t)
    if isinstance(waitable, Future):
        waitable.result()
    elif waitable is not None:
        torch.cuda.current_stream(t.device).wait_event(waitable)
    return t


def _page_out(t: torch.Tensor) -> None:
    store = _store_of.get(t.untyped_storage().data_ptr())
    if store is not None:
        store.page_out(t)


_lib.impl("reload_wait", _reload_wait, "CompositeExplicitAutograd")
_lib.impl("page_out", _page_out, "CompositeExplicitAutograd")
torch.library.register_fake("zerofx::reload_wait", lambda t: t, lib=_lib)
torch.library.register_fake("zerofx::page_out", lambda t: None, lib=_lib)
torch.fx.node.has_side_effect(torch.ops.zerofx.reload_wait.default)
torch.fx.node.has_side_effect(torch.ops.zerofx.page_out.default)

OFFLOAD = torch.ops.zerofx.offload.default
RELOAD = torch.ops.zerofx.reload.default
RELOAD_WAIT = torch.ops.zerofx.reload_wait.default
PAGE_OUT = torch.ops.zerofx.page_out.default


# -- model state on disk -------------------------------------------------------------------------

_store_of: dict[int, DiskStore] = {}  # storage data_ptr -> the store holding it


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class DiskStore:
    """Tensors whose bytes live in memory-mapped files under one folder (one file per tensor)."""

    def __init__(self, directory: str):
        self.directory = str(directory)
        self.files: dict[int, tuple[mmap.mmap, int, int]] = {}  # data_ptr -> (mapping, fd, nbytes)

    def __contains__(self, t: torch.Tensor) -> bool:
        return _local(t).untyped_storage().data_ptr() in self.files

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.files.values())

    def adopt(self, t: torch.Tensor) -> None:
        """Move ``t``'s bytes into a new file and re-point ``t`` (its local shard) at the mapping."""
        local = _local(t)
        nbytes = local.numel() * local.element_size()
        if nbytes == 0 or t in self:
            return
        if not local.is_contiguous() or local.device.type != "cpu":
            raise ZeroFXError("disk offload keeps contiguous CPU tensors; got "
                              f"{'a non-contiguous' if local.device.type == 'cpu' else local.device.type} tensor")
        fd = _new_file(self.directory, nbytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        data = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes).view(local.dtype)
        data.copy_(local.reshape(-1))
        with torch.no_grad():
            local.set_(data.untyped_storage(), 0, local.shape, local.stride())
        ptr = local.untyped_storage().data_ptr()
        self.files[ptr] = (mapping, fd, nbytes)
        _store_of[ptr] = self
        self.page_out(t)

    def page_out(self, t: torch.Tensor) -> None:
        """Write ``t``'s dirty pages to its file and drop them from this process and the page cache."""
        entry = self.files.get(_local(t).untyped_storage().data_ptr())
        if entry is None:
            return
        mapping, fd, _ = entry
        mapping.flush()
        mapping.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def prefetch(self, t: torch.Tensor) -> None:
        """Ask the kernel to start reading ``t``'s pages now (asynchronous readahead)."""
        entry = self.files.get(_local(t).untyped_storage().data_ptr())
        if entry is not None:
            entry[0].madvise(mmap.MADV_WILLNEED)


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
    param_bytes = sum(_local(p).numel() * _local(p).element_size() for p in params)
    if tier == "auto":
        tier = "disk" if 3 * param_bytes > options.host_memory_cap else "host"
    window = options.host_memory_cap // 8 if options.host_memory_cap else 64 * 2**20
    store = None
    if tier == "disk":
        store = DiskStore(options.offload_dir)
        for p in params:
            if _local(p).device.type != "cpu":
                raise ZeroFXError("offload_optimizer='disk' keeps parameter shards in memory-mapped files, "
                                  f"which the device reads directly only on CPU; this model is on "
                                  f"{_local(p).device}: use offload_optimizer='host'")
            store.adopt(p)
    for p in params:
        _param_store[p] = (tier, store, window)
    model._zerofx_state_tier = tier
    where = (f"{len(store.files)} memory-mapped files under {store.directory} ({store.nbytes} B)" if store
             else "host memory" + (" (this CPU's own memory: nothing moves)" if params and
                                   _local(params[0]).device.type == "cpu" else ""))
    model._zerofx_state_report = (
        f"model state: offload_optimizer={options.offload_optimizer!r} -> {tier}: {len(params)} parameter shards "
        f"({param_bytes} B; with Adam's two moments {3 * param_bytes} B"
        + (f", host_memory_cap {options.host_memory_cap} B" if options.host_memory_cap else "")
        + f") in {where}; the optimizer steps {window} B windows (call zerofx.offload_optimizer(opt))")
    return tier


def _windows(params: list[torch.Tensor], window: int, state_factor: int = 3) -> list[list[torch.Tensor]]:
    """Consecutive groups of parameters whose bytes (with their optimizer state) fit ``window``;
    a parameter larger than the window is a group of its own."""
    groups: list[list[torch.Tensor]] = []
    used = 0
    for p in params:
        nbytes = _local(p).numel() * _local(p).element_size() * state_factor
        if groups and used + nbytes <= window:
            groups[-1].append(p)
            used += nbytes
        else:
            groups.append([p])
            used = nbytes
    return groups


def offload_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer`` keep its state where the model's ``offload_optimizer`` option put the
    parameters, and step a window of parameters at a time. Returns the same optimizer.

    Works for optimizers whose per-parameter state is elementwise (Adam, AdamW, SGD with
    momentum, ...): each window is stepped by the optimizer's own ``step`` with its parameter
    groups narrowed to that window, so the arithmetic is the optimizer's, unchanged."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    placed = [state_store(p) for p in params]
    if not params or any(s is None for s in placed):
        raise ZeroFXError("zerofx.offload_optimizer: build the optimizer over a model compiled with "
                          "zerofx.compile(..., offload_optimizer='host' | 'disk' | 'auto')")
    tier, store, window = placed[0]
    if getattr(optimizer, "_zerofx_offload", None) is not None:
        return optimizer
    class_step: Callable = type(optimizer).step
    optimizer._zerofx_offload = (tier, store, window)
    optimizer._zerofx_local_step = False  # windows step through DTensor (zerofx/optim.py)

    def streamed_step(self: torch.optim.Optimizer, closure: Callable | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        full = [list(g["params"]) for g in self.param_groups]
        ordered = [p for ps in full for p in ps if p.grad is not None]
        windows = _windows(ordered, window)
        try:
            for i, win in enumerate(windows):
                if store is not None and i + 1 < len(windows):
                    for p in windows[i + 1]:
                        _prefetch(self, store, p)
                members = set(win)
                for g, ps in zip(self.param_groups, full):
                    g["params"] = [p for p in ps if p in members]
                _swap_in(self, win, tier)
                class_step(self)
                _park(self, win, tier, store)
        finally:
            for g, ps in zip(self.param_groups, full):
                g["params"] = ps
        return loss

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


def _park(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], tier: str, store: DiskStore | None) -> None:
    """After this window's step: state back to its tier, and its pages out of memory."""
    for p in params:
        for key, value in list(_state_tensors(optimizer, p)):
            if store is not None:
                if value not in store:
                    store.adopt(value)
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
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())
    return local

