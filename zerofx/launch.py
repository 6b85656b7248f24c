"""Starting ranks on this machine with torchrun's own machinery.

``local_ranks(fn, world, *args)`` is what ``torchrun --standalone --nproc-per-node world`` does
for a script, for a Python function: torch's elastic launcher (``torch.distributed.launcher``)
starts ``world`` processes, a c10d rendezvous on a free local port gives them their ranks and
``MASTER_ADDR``/``MASTER_PORT``, and each one's return value comes back to the caller. The demo
and the benchmarks use it; nothing here is a launcher of our own.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable

# torchrun's --start-method for local_ranks: "spawn" starts each rank in a fresh interpreter;
# "forkserver" forks it from a server process, which pays torch's import once where
# ``multiprocessing.set_forkserver_preload`` names the modules (the test suite does: its many
# short launches otherwise spend seconds of CPU per rank importing torch again). Forked ranks
# write to the stdout and stderr the server had when it started, not to the caller's current ones
START_METHOD = "spawn"


def local_ranks(fn: Callable, world: int, *args: Any, name: str = "zerofx") -> list[Any]:
    """``[fn(*args) on rank 0, ..., on rank world-1]``, one process per rank, started by
    :data:`START_METHOD` (spawn unless set; ``fn`` must be importable: a module-level function).
    Each rank initializes its own process group. ``OMP_NUM_THREADS`` defaults to 1 so ranks
    sharing a machine do not oversubscribe it. A rank that fails makes the launcher stop the
    others and raise (no restarts)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world,
        run_id=f"{name}-{uuid.uuid4()}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.2,
        start_method=START_METHOD,
    )
    results = elastic_launch(launch, fn)(*args)
    return [results[r] for r in range(world)]
