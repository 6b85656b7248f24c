"""Do zerofx's collectives really run while compute runs? Measure it on this mesh.

    python benchmarks/async_overlap.py --world-size 2

Each rank times, for several all-gather sizes: the all-gather alone (issue + wait), a fixed
matmul loop alone, and the two overlapped (issue, compute, then wait) as the schedule pass
arranges them. Overlap is real when ``overlapped`` is well below ``comm + compute``; the ratio
``overlapped / (comm + compute)`` tends to 0.5 for perfectly hidden, equal-length halves and
1.0 for none. On gloo the collective runs on the process group's worker thread; on CUDA it
runs on NCCL's stream.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script (python benchmarks/x.py): this checkout's `benchmarks`, and its
    # zerofx whole (passes/ and codegen/ install into it: the bare source tree lacks them; benchmarks/_checkout.py)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks._checkout import import_checkout

    import_checkout()

from benchmarks._launch import launch_local, median_time, positive_int  # noqa: E402
from zerofx.ir.collectives import all_gather  # noqa: E402

F = torch.ops._c10d_functional


def _rank_main(args) -> list[dict]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, group = dist.get_world_size(), dist.group.WORLD.group_name
    a = torch.randn(256, 256)
    rows = []
    try:
        for mib in args.sizes_mib:
            shard = torch.randn(int(mib * 2**20 / 4 / world))

            def comm():
                F.wait_tensor(all_gather(shard, world, group))

            def compute():
                x = a
                for _ in range(args.matmuls):
                    x = torch.tanh(x @ a)

            def overlapped():
                work = all_gather(shard, world, group)  # the form zerofx issues on gloo
                compute()
                F.wait_tensor(work)

            comm(), compute(), overlapped()  # warm up
            t_comm, t_comp, t_both = (median_time(f, args.repeats) for f in (comm, compute, overlapped))
            rows.append(
                {
                    "gather_mib": mib,
                    "comm_ms": t_comm * 1e3,
                    "compute_ms": t_comp * 1e3,
                    "overlapped_ms": t_both * 1e3,
                    "ratio": t_both / (t_comm + t_comp),
                }
            )
    finally:
        dist.destroy_process_group()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=positive_int, default=2)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16])
    parser.add_argument("--matmuls", type=int, default=40)
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = launch_local(_rank_main, args.world_size, args)[0]
    print("| all-gather MiB | comm ms | compute ms | overlapped ms | overlapped / (comm + compute) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['gather_mib']:g} | {r['comm_ms']:.1f} | {r['compute_ms']:.1f} | {r['overlapped_ms']:.1f} | "
            f"{r['ratio']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": args.world_size, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
