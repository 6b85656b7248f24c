"""Shared test setup.

Triton kernels run on CPU in Triton's interpreter, and Triton fixes that mode when it is first
imported (see zerofx.codegen.triton_runtime, NOTE: interpreter mode is fixed at import), so
``TRITON_INTERPRET=1`` is set here, before any test module can import triton. Only the
"triton" executor and the codegen kernels read it: the "aten" executor never touches Triton
and Inductor's CPU backend generates C++, so the other tests run exactly as without it.
"""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # before the fork server starts: its ranks inherit its environment


@pytest.fixture(scope="session", autouse=True)
def fork_server():
    """Ranks the suite starts through torchrun's launcher (``zerofx.launch.local_ranks``: the HF,
    Lightning and verify tests) fork from the same preloaded server as tests/multirank.py's. Started
    in the first test's setup, under pytest's output capture, so that the server and every rank
    forked from it write into the capture, as spawned ranks did (started at configure time, they
    would write to the terminal)."""
    import zerofx.launch
    from tests.multirank import start_fork_server

    start_fork_server()
    zerofx.launch.START_METHOD = "forkserver"


@pytest.fixture
def triton_interpreter():
    """For tests that launch Triton kernels: fail clearly if they cannot run here."""
    pytest.importorskip("triton")
    import torch

    from zerofx.codegen.triton_runtime import launch_problem

    problem = launch_problem(torch.device("cpu"))
    if problem is not None:
        pytest.fail(f"codegen tests run kernels in the Triton interpreter, but: {problem}")


@pytest.fixture(scope="session")
def codegen_runs(tmp_path_factory):
    """``get(world_size) -> (per-rank results of tests/codegen_ranks.run, dump folder)``, run once."""
    cache: dict = {}

    def get(world_size: int):
        if world_size not in cache:
            import io

            import torch

            from tests.codegen_ranks import run
            from tests.multirank import run_ranks

            dump = tmp_path_factory.mktemp(f"codegen_dump_w{world_size}")
            per_rank = [torch.load(io.BytesIO(b), weights_only=False) for b in run_ranks(run, world_size, str(dump))]
            cache[world_size] = (per_rank, dump)
        return cache[world_size]

    return get


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A one-rank gloo process group and its mesh, for tests that shard without peers."""
    from tests.multirank import one_rank_mesh

    with one_rank_mesh(str(tmp_path_factory.mktemp("store"))) as mesh:
        yield mesh
