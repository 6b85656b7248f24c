"""Measured memory outside the graphs: the allocator's live bytes over time (``AllocationTrace``)
and the process's resident memory as the kernel counts it.

``rss_bytes``/``peak_rss_bytes``/``reset_peak_rss`` read the kernel's view of this process
(``/proc/self/status``: VmRSS, VmHWM; writing 5 to ``/proc/self/clear_refs`` resets VmHWM):
what the disk tier's claims are checked against, since file-backed pages the process does not
touch are not resident.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Collection

__all__ = ["AllocationTrace", "allocated_above_start", "rss_bytes", "peak_rss_bytes", "reset_peak_rss"]


class AllocationTrace:
    """Live bytes over time as the allocator saw them, for the CPU (profiler memory events).

    On CPU there is no allocator counter to read, and torch.compile does not run compiled code
    under a dispatch mode, so a dispatch-level storage tracker would measure a different
    (eager) program. The profiler's memory events see every allocation and free that compiled
    and eager code make on the thread that traces. Use ``mark()`` to take timestamps between
    phases::

        with AllocationTrace() as trace:
            t0 = trace.mark(); step(); t1 = trace.mark()
        trace.peak_between(t0, t1) - trace.live_at(t0)   # bytes a step needed above its start

    # NOTE: frees the profiler does not see
    The profiler records a free only on a thread it profiles. Collective backends drop their
    last reference to a collective's buffers on their own worker thread (gloo's work objects
    hold the input until the work is destroyed there), so those frees never appear, and the
    allocator's running total (the events' ``total_allocated``) drifts upward by them, step
    after step, and across traces in one process (docs/measurements.md, allocations). So this class keeps
    its own ledger from the events' addresses and sizes: a block is live from its allocation
    until its free, or until the allocator hands out the same address again (which proves
    the block was freed in between, unseen); frees of blocks allocated before the trace are
    ignored. What remains is an over-count, never an under-count: an unseen free is taken
    to happen at the address's next reuse, at the latest the end of the trace.

    Over many steps that over-count piles up (gloo's collective buffers still "live" at later
    steps' starts while the process's in-use heap stays flat). ``step_peak`` is the measure for one
    step of a long run: at the step's start it counts only what a rank provably holds between
    steps: blocks allocated before ``persistent_before`` (pass the end of model construction:
    the model, its shards, wrappers' buffers) and the storages at ``held`` (model state the
    previous step kept: :func:`model_state_addresses` taken before ``zero_grad``, so storages
    that gradients are views of, such as DDP's buckets with ``gradient_as_bucket_view``, are
    included). A step leaves nothing else behind, so the rest of the ledger at that moment is
    blocks a backend thread freed unseen. Unseen frees within the measured step still
    over-count. It was checked against the kernel's count (docs/measurements.md, allocations).
    """

    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []  # (time_ns, live bytes since the trace started)
        self._raw: list[tuple[int, int, int]] = []  # (time_ns, bytes (< 0: a free), address)
        self._prof = None

    def __enter__(self) -> AllocationTrace:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def mark(self) -> int:
        """A timestamp on the profiler's clock (epoch nanoseconds)."""
        return time.time_ns()

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(*exc)
        from torch._C._profiler import _EventType

        raw = []
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                f = node.extra_fields
                raw.append((node.start_time_ns, f.alloc_size, f.ptr))
            stack.extend(node.children)
        raw.sort(key=lambda e: e[0])
        self._raw = raw
        live, ledger, events = 0, {}, []
        for t, size, ptr in raw:
            if size > 0:
                live += size - ledger.pop(ptr, 0)  # a reused address: its old block was freed
                ledger[ptr] = size
            else:
                live -= ledger.pop(ptr, 0)  # 0: allocated before the trace, not counted
            events.append((t, live))
        self.events = events

    def live_at(self, t_ns: int) -> int:
        live = 0
        for t, total in self.events:
            if t > t_ns:
                break
            live = total
        return live

    def peak_between(self, t0: int, t1: int) -> int:
        return max([self.live_at(t0)] + [total for t, total in self.events if t0 <= t <= t1])

    @property
    def peak(self) -> int:
        return max((total for _, total in self.events), default=0)

    def step_peak(self, t0: int, t1: int, persistent_before: int, held: Collection[int] = ()) -> int:
        """Most bytes live during ``[t0, t1]``, counting as live at ``t0`` only blocks allocated
        before ``persistent_before`` or at an address in ``held`` (see the NOTE above)."""
        ledger: dict[int, tuple[int, int]] = {}  # address -> (bytes, allocated at)
        start = bisect.bisect_right(self._raw, t0, key=lambda e: e[0])
        for t, size, ptr in self._raw[:start]:
            if size > 0:
                ledger[ptr] = (size, t)
            else:
                ledger.pop(ptr, None)
        sizes = {ptr: size for ptr, (size, t) in ledger.items() if t < persistent_before or ptr in held}
        live = peak = sum(sizes.values())
        for t, size, ptr in self._raw[start:]:
            if t > t1:
                break
            if size > 0:
                live += size - sizes.pop(ptr, 0)
                sizes[ptr] = size
            else:
                live -= sizes.pop(ptr, 0)
            peak = max(peak, live)
        return peak


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def allocated_above_start(fn: Callable[[], object]) -> int:
    """The most bytes ``fn()`` allocated above what was live at its start, as the allocator saw
    it (``AllocationTrace``: frees on a backend's thread are seen late, so never less than the
    truth): what a step adds at its peak."""
    with AllocationTrace() as trace:
        start = trace.mark()
        fn()
        end = trace.mark()
    return trace.peak_between(start, end) - trace.live_at(start)


def rss_bytes() -> int:
    """Resident memory of this process now (VmRSS)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Most resident memory of this process since start or the last ``reset_peak_rss`` (VmHWM)."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
