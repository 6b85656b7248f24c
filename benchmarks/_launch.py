"""What the benchmarks share: launching ranks on this machine and timing a call."""

from __future__ import annotations

import os
import statistics
import time
import uuid
from typing import Any, Callable

import torch.distributed as dist


def launch_local(fn: Callable, world: int, *args: Any) -> list[Any]:
    """``[fn(*args) on rank 0, ..., on rank world-1]``: ``world`` processes on this machine,
    started by torch's elastic launcher (what torchrun runs), one thread each."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ["OMP_NUM_THREADS"] = "1"
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=f"bench-{uuid.uuid4()}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                          monitor_interval=0.2, start_method="spawn")
    results = elastic_launch(launch, fn)(*args)
    return [results[r] for r in range(world)]


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, every rank starting each call together."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
