"""One rank of the two-"node" run of tests/test_tp_torchrun.py: started by ``torchrun --nnodes 2
--nproc-per-node 2 --node-rank N --rdzv-backend c10d ...`` (two torchrun processes on this
machine, one per "node"), it joins the gloo process group torchrun's environment describes,
runs tests/tp_scenarios.py's parity scenarios on the (dp, tp) = (2, 2) mesh, whose outer
dimension dp is the node (global ranks are node-major: ``RANK = GROUP_RANK * 2 + LOCAL_RANK``,
so each row of the mesh, a tp group, is one node) and writes ``rank<RANK>.json`` into the
folder given as the first argument: torchrun's variables as this rank saw them, the ranks of
its dp and tp groups, and each scenario's result (or its traceback).

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29555 --rdzv-id run1 tests/tp_torchrun.py OUT [MODEL:STAGE ...]
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

if __package__ in (None, ""):  # run as a script by torchrun: make `tests` importable
    # appended, not prepended (as pytest's --import-mode=append): in the source tree zerofx/ lacks
    # zerofx.passes and zerofx.codegen, so the repository root must not shadow the installed package
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK")
DEFAULT_CASES = ("gpt:3", "llama:3")


def main(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    from tests import tp_scenarios

    out_dir, cases = argv[0], argv[1:] or list(DEFAULT_CASES)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # env:// from torchrun
    rank = dist.get_rank()
    out: dict = {
        "env": {k: os.environ.get(k) for k in (*TORCHRUN_VARS, "ZEROFX_TEST_NODE")},
        "dist_rank": rank,
        "world": dist.get_world_size(),
    }
    try:
        mesh = tp_scenarios.mesh_2x2()
        out["dp_group"] = dist.get_process_group_ranks(mesh.get_group("dp"))
        out["tp_group"] = dist.get_process_group_ranks(mesh.get_group("tp"))
        results = {}
        for case in cases:
            model, stage = case.split(":")
            try:
                results[case] = {"ok": tp_scenarios.parity(model, int(stage))}
            except Exception:  # noqa: BLE001 - reported to the test
                results[case] = {"error": traceback.format_exc()}
            torch._dynamo.reset()
        out["results"] = results
    finally:
        dist.destroy_process_group()
    tmp = os.path.join(out_dir, f".rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))  # the test reads only whole files
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
