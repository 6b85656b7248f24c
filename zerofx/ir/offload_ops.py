"""Offload ops: where an activation is parked between its forward and backward uses.

The tiers (``host``, ``disk``) are described in zerofx.runtime.offload_store.

Activations (graph ops, inserted by ``passes/offload.py``)::

    parked = zerofx.offload(x, tier, dir)         # after x's last forward use; returns at once,
                                                  # the copy/write runs asynchronously
    y = zerofx.reload(parked, tier, dev, size, stride)   # ahead of the first backward use: starts
    y = zerofx.reload_wait(y)                     # the read; the wait sits just before the use

A disk-parked activation is a tensor backed by a memory-mapped file (``torch.from_file``) whose
pages are written with ``pwrite`` by a background thread and never touched by this process
until the reload, so it holds no resident memory in between. The source tensor is kept alive by
the writer until its bytes are on disk, then freed.
"""

from __future__ import annotations

import ctypes
import errno
import os
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from zerofx.errors import ZeroFXError

__all__ = [
    "OFFLOAD",
    "RELOAD",
    "RELOAD_WAIT",
    "PAGE_OUT",
    "bytes_view",
    "default_offload_dir",
    "new_file",
    "paged_storages",
]


def default_offload_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "zerofx-offload")


def _fallocate(fd: int, nbytes: int) -> None:
    """Linux's ``fallocate(2)``: ``os.posix_fallocate`` is glibc's, which on a file system
    without the call (NFSv3, older ZFS) emulates it by writing a byte into every 4 KiB block,
    millions of system calls for a large file."""
    libc = ctypes.CDLL(None, use_errno=True)
    call = getattr(libc, "fallocate64", None) or libc.fallocate
    call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if call(fd, 0, 0, nbytes) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def within_file_limit(open_: Callable[[], Any]) -> Any:
    """``open_()`` (which opens a file descriptor); when the process is at its limit of open
    files (``ulimit -n``, often 1024 soft), the soft limit is raised to the hard one once and
    ``open_`` tried again, else a ``ZeroFXError`` says so. Disk offload holds each tensor's file
    open for the tensor's life, two descriptors per tensor (its own and the memory map's), so an
    offloaded optimizer over a few hundred parameters passes 1024."""
    import resource

    try:
        return open_()
    except OSError as e:
        if e.errno != errno.EMFILE:
            raise
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        try:
            return open_()
        except OSError as e:
            if e.errno != errno.EMFILE:
                raise
            soft = hard
    raise ZeroFXError(
        f"disk offload: this process has {soft} files open, its limit (ulimit -n); each offloaded tensor "
        "keeps its file open (two descriptors). Raise the limit (ulimit -n 65536 before launching, or "
        "the hard limit in /etc/security/limits.conf), or offload less (offload_optimizer='host')"
    ) from None


def _map_file(fd: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``numel`` elements mapped onto the file open at ``fd``. ``torch.from_file``
    opens the file once more (and closes it once mapped); its RuntimeError at the limit of open
    files is an ``OSError`` (EMFILE) here, for ``within_file_limit``."""
    try:
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=dtype)
    except RuntimeError as e:
        if f"({errno.EMFILE})" in str(e):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE)) from e
        raise


def new_file(directory: str, nbytes: int, preallocate: bool = True) -> int:
    """An open, unlinked file of ``nbytes`` bytes: it disappears when the last user closes it.

    With ``preallocate`` (files written through a memory map: the disk tier's model state), its
    blocks are allocated now (``fallocate``), not at the first write: a sparse file on a disk
    that fills up later fails at a write through its map, and the process dies of SIGBUS. Out
    of space here is a ``ZeroFXError`` naming the folder and the bytes. A file system without
    ``fallocate`` keeps the sparse file. Files written with ``pwrite`` (parked activations) need
    none: a full disk is an ordinary error there."""
    try:
        fd, path = within_file_limit(lambda: tempfile.mkstemp(dir=directory, prefix="zerofx-", suffix=".bin"))
    except OSError as e:
        raise _cannot_create(directory, nbytes, e) from None
    try:
        os.ftruncate(fd, nbytes)
        if nbytes and preallocate:
            try:
                _fallocate(fd, nbytes)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    os.close(fd)
                    raise ZeroFXError(
                        f"offload folder {directory!r}: no room for {nbytes:,} more bytes ({e.strerror}); "
                        "free space there or pass another offload_dir"
                    ) from None
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    os.close(fd)
                    raise _cannot_create(directory, nbytes, e) from None
    except OSError as e:  # ftruncate
        os.close(fd)
        raise _cannot_create(directory, nbytes, e) from None
    finally:
        os.unlink(path)
    return fd


def _cannot_create(directory: str, nbytes: int, e: OSError) -> ZeroFXError:
    """An offload file could not be made: the error names the option and its folder (not the
    file's random name)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return ZeroFXError(
            f"offload folder {directory!r}: no room for {nbytes:,} more bytes ({e.strerror}); "
            "free space there or pass another offload_dir"
        )
    return ZeroFXError(
        f"option offload_dir={directory!r}: could not create an offload file of {nbytes:,} bytes there "
        f"({e.strerror or e}); the folder must stay a writable folder on a local disk while the model "
        "trains: restore it, or pass another offload_dir"
    )


def _pwrite_all(fd: int, data: memoryview, offset: int = 0) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (and without needing numpy); the
    caller keeps ``t`` alive while the view is used."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


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


def _write_parked(fd: int, src: torch.Tensor, event: Any, directory: str) -> None:
    """Write a parked activation to its file (on the I/O thread: a failure surfaces where the
    backward waits for the activation's reload)."""
    try:
        if event is not None:
            event.synchronize()
        _pwrite_all(fd, bytes_view(src))
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise ZeroFXError(
            f"offload folder {directory!r}: no room to park an activation of {src.numel() * src.element_size():,} "
            f"bytes ({e.strerror}); free space there, pass another offload_dir, or offload_activations='host'"
        ) from None
    finally:
        os.close(fd)


@torch.library.custom_op("zerofx::offload", mutates_args=())
def offload(x: torch.Tensor, tier: str, directory: str) -> torch.Tensor:
    """Park ``x`` in ``tier``; returns the parked tensor at once while the copy completes."""
    if tier == "disk":
        nbytes = x.numel() * x.element_size()
        directory = directory or default_offload_dir()
        fd = new_file(directory, max(nbytes, 1), preallocate=False)
        try:
            parked = within_file_limit(lambda: _map_file(fd, x.numel(), x.dtype)).view(x.shape)
        except BaseException:
            os.close(fd)
            raise
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
        _register(parked, _io.submit(_write_parked, fd, src, event, directory))
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


# storage data_ptr -> the object holding that storage's file mapping (zerofx.runtime.offload_store's
# DiskStore registers its tensors here); page_out is a no-op on any other tensor
paged_storages: dict[int, Any] = {}


def _page_out(t: torch.Tensor) -> None:
    store = paged_storages.get(t.untyped_storage().data_ptr())
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
