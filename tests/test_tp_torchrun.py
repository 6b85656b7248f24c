"""The 2x2 ZeRO + tensor-parallel parity run launched as two torchrun "nodes" on this machine
(issue 17, item 5): two ``torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0|1`` processes
meet at a c10d rendezvous on 127.0.0.1, each starts 2 ranks of tests/tp_torchrun.py over gloo,
and the (dp, tp) mesh's outer dimension dp is the node. The ranks must agree with the oracle bit
for bit as the single-launch run of tests/test_tensor_parallel.py does, and see the variables
torchrun sets for a node (``GROUP_RANK``, ``LOCAL_RANK``), different on the two nodes: nothing
may assume one node.

Every wait is bounded: the rendezvous (``join_timeout``), the collectives (120 s), and the
whole run (``RUN_TIMEOUT_S``); on any failure or timeout both torchrun process groups are killed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests import tp_scenarios

# minutes of 4-rank setup: `tox -e slow` (pytest -m slow), not the default run
pytestmark = pytest.mark.slow

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 420
CASES = ("gpt:3", "llama:3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the ranks it started
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp_torchrun")
    port, run_id = _free_port(), f"zerofx-tp-{uuid.uuid4().hex[:12]}"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",  # gloo binds to the loopback interface: both "nodes" are here
    }
    procs = []
    try:
        for node in (0, 1):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--node-rank",
                str(node),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                run_id,
                # node 0 hosts the rendezvous store; both wait at most a minute for each other
                "--rdzv-conf",
                f"is_host={1 - node},join_timeout=60",
                "--max-restarts",
                "0",
                str(ROOT / "tests" / "tp_torchrun.py"),
                str(out),
                *CASES,
            ]
            log = open(out / f"node{node}.log", "w")  # noqa: SIM115 - closed with the process below
            procs.append(
                (
                    subprocess.Popen(
                        cmd,
                        env={**env, "ZEROFX_TEST_NODE": str(node)},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # its own process group: killed together
                    ),
                    log,
                )
            )
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline and any(p.poll() is None for p, _ in procs):
            if any(p.poll() not in (None, 0) for p, _ in procs):
                time.sleep(5)  # let the other node's ranks notice and report
                break
            time.sleep(0.5)
        codes = [p.poll() for p, _ in procs]
    finally:
        for p, log in procs:
            _kill(p)
            log.close()
    logs = {node: (out / f"node{node}.log").read_text()[-4000:] for node in (0, 1)}
    assert codes == [0, 0], f"torchrun exit codes {codes} (None: still running after {RUN_TIMEOUT_S}s)\n{logs}"
    files = sorted(out.glob("rank*.json"))
    assert len(files) == 4, (files, logs)
    return {int(f.stem[4:]): json.loads(f.read_text()) for f in files}


def test_each_node_s_ranks_see_torchrun_s_node_variables(ranks):
    nodes = {}
    for rank, r in ranks.items():
        env = r["env"]
        assert int(env["RANK"]) == rank == r["dist_rank"]
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) == ("4", "2", "2")
        nodes.setdefault(env["ZEROFX_TEST_NODE"], []).append((int(env["GROUP_RANK"]), int(env["LOCAL_RANK"]), rank))
    assert sorted(nodes) == ["0", "1"]
    group_ranks = set()
    for node, members in nodes.items():
        # one torchrun process: one GROUP_RANK, LOCAL_RANK 0 and 1, global ranks node-major
        assert len({g for g, _, _ in members}) == 1, members
        assert sorted(local for _, local, _ in members) == [0, 1], members
        for group, local, rank in members:
            assert rank == 2 * group + local
        group_ranks.add(members[0][0])
    assert group_ranks == {0, 1}  # the two nodes differ


def test_tp_groups_are_within_a_node_and_dp_crosses_nodes(ranks):
    node_of = {rank: r["env"]["GROUP_RANK"] for rank, r in ranks.items()}
    for rank, r in ranks.items():
        assert {node_of[p] for p in r["tp_group"]} == {node_of[rank]}, r["tp_group"]
        assert len({node_of[p] for p in r["dp_group"]}) == 2, r["dp_group"]


@pytest.mark.parametrize("case", CASES)
def test_two_node_run_matches_the_oracle_bit_for_bit(ranks, case):
    for rank, r in ranks.items():
        got = r["results"][case]
        assert "error" not in got, f"rank {rank}:\n{got.get('error')}"
        got = got["ok"]
        assert got["oracle_equal"] == [True] * 3, "a loss differs from the TP model's without zerofx"
        assert got["divergences"] == [], got["divergences"][:3]
        assert got["losses"] == pytest.approx(got["single"], rel=tp_scenarios.SINGLE_RTOL)
