"""Run a function on N local gloo ranks, each in its own process, with bounded waits.

Each rank initializes the default process group from a FileStore in a fresh temporary folder
(no ports to collide), runs ``fn(rank, world_size, *args)``, sends back its result or its
traceback, and always destroys the process group. The parent waits at most ``timeout``
seconds in total: a rank that fails or hangs ends the run with every rank's traceback instead
of hanging the test suite.

Ranks are forked from a fork server that imported torch, zerofx and transformers once
(``PRELOAD``), so a rank starts in a fraction of a second instead of spending several seconds
of CPU re-importing them (each of four ranks on two cores did, at every run). The server holds
no process group, thread pool or tensor: each rank still starts from a fresh interpreter state
as a spawned one would. A run whose environment differs from the one the server started with
(a test that sets ``MALLOC_MMAP_THRESHOLD_`` or another variable read at process start) spawns
its ranks as before.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 120
# what every rank imports anyway, imported once by the fork server (which skips one not installed):
# ours, and what torch imports lazily on a process's first compile (dynamo's debugging backends,
# AOT autograd's compilers, Inductor's pattern matcher for the CSE our passes run, export's tracer),
# about a second of a forked rank's CPU per run otherwise (one GPT's first compile, 2.5 s -> 1.4 s)
PRELOAD = [
    "tests.forkserver_path",  # first: the path the test process imports from
    "zerofx",
    "zerofx.testing",
    "tests.multirank",
    "transformers.models.llama.modeling_llama",
    "torch._dynamo.repro.after_dynamo",
    "torch._dynamo.backends.debugging",
    "torch._dynamo.backends.distributed",
    "torch._dynamo.backends.inductor",
    "torch._dynamo.dce_extra_outputs",
    "functorch.compile",
    "torch._functorch._aot_autograd.subclass_codegen",
    "torch._inductor.compiler_bisector",
    "torch._inductor.lowering",
    "torch._inductor.pattern_matcher",
    "torch._inductor.fx_passes.dedupe_symint_uses",
    "torch._higher_order_ops.passes.inline_invoke_subgraph",
    "torch._subclasses.schema_check_mode",
    "torch.distributed.tensor.experimental",
    "torch.export._trace",
    "torch.fx.experimental.validator",
]
_server_env: dict[str, str] | None = None  # the environment the fork server started with


def _environment() -> dict[str, str]:
    """What a rank's behaviour may depend on: the environment, less what torch's elastic launcher
    sets in its caller (``TORCHELASTIC_SIGNALS_TO_HANDLE``), which only its agents read, and
    pytest's ``PYTEST_CURRENT_TEST`` (the running test's name, rewritten at every setup, call and
    teardown: compared, it made every run after the first test's setup spawn its ranks)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_") and k != "PYTEST_CURRENT_TEST"}


def start_fork_server() -> None:
    """Start the fork server now (once per process), with ``PRELOAD`` and this environment; the
    one server torch's launcher uses too when its start method is forkserver."""
    global _server_env
    if _server_env is None:
        from multiprocessing import forkserver

        os.environ["ZEROFX_FORKSERVER_SYS_PATH"] = os.pathsep.join(sys.path)
        mp.set_forkserver_preload(PRELOAD)
        forkserver.ensure_running()
        _server_env = _environment()


def _context() -> Any:
    """The fork server's context, or spawn's when this run's environment is not the server's."""
    start_fork_server()
    return mp.get_context("forkserver" if _environment() == _server_env else "spawn")


def _rank_main(fn: Callable, rank: int, world_size: int, store_path: str, args: tuple, results: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        try:
            results.put((rank, "ok", fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report everything, including SystemExit from a rank
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 420) -> list[Any]:
    """``[fn(0, N, *args), ..., fn(N-1, N, *args)]``, each computed on its own rank."""
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, world_size, store, args, results), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        got: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(got) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    rank, status, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    # a rank that ended without a result (crashed, or exited, even with status 0)
                    if any(p.exitcode is not None and r not in got for r, p in enumerate(procs)) and results.empty():
                        time.sleep(0.5)  # give a dying rank's last message time to arrive
                        if results.empty():
                            break
                    continue
                got[rank] = (status, value)
                if status == "error":
                    deadline = min(deadline, time.monotonic() + 10)  # let peers report, briefly
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    errors = {r: v for r, (s, v) in got.items() if s == "error"}
    missing = sorted(set(range(world_size)) - set(got))
    if errors or missing:
        report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        if missing:
            report += f"\nranks {missing} sent no result within {timeout:.0f}s (hung or crashed)"
        raise AssertionError(f"multi-rank run of {fn.__name__} failed:\n{report}")
    return [got[r][1] for r in range(world_size)]


REPLAY = "ZEROFX_REPLAY_RUNS"


def replayed(name: str) -> Any:
    """The results the stress driver recorded as ``name`` for a test file's fixture to hand its
    tests instead of running the ranks (tests/stress.py, ``check_with_tests``: a stress run's
    results judged by the file's own assertions), or None outside such a check."""
    path = os.environ.get(REPLAY)
    if not path:
        return None
    import pickle

    with open(path, "rb") as f:
        return pickle.load(f)[name]


def attempt(results: dict, name: str, fn: Callable[[], Any]) -> None:
    """Run one rank-side scenario: its result, or its traceback, lands in ``results[name]``, so
    one failing scenario does not hide the others; dynamo's caches are reset after each."""
    import torch

    try:
        results[name] = fn()
    except Exception:
        results[name] = {"error": traceback.format_exc()}
    torch._dynamo.reset()


def scenario_results(per_rank: list[dict], name: str) -> list[Any]:
    """Every rank's result of scenario ``name`` (see ``attempt``); a rank's traceback fails the test."""
    got = [r[name] for r in per_rank]
    for rank, r in enumerate(got):
        assert not (isinstance(r, dict) and "error" in r), f"rank {rank}:\n{r['error']}"
    return got


def mean_over_ranks(loss) -> float:
    """The global batch's mean loss from each rank's mean over its equal slice (a collective)."""
    import torch.distributed as dist

    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


@contextlib.contextmanager
def one_rank_mesh(folder: str) -> Iterator[Any]:
    """A one-rank gloo process group (file store in ``folder``) and its mesh, for tests that
    shard without peers; the group is destroyed and dynamo's caches reset afterwards."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.makedirs(folder, exist_ok=True)  # a FileStore in a missing folder waits forever
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
