"""Collective micro-benchmark: how each way of running a reduce-scatter costs on this backend.

    python benchmarks/collectives.py --world-sizes 2 4 --json collectives.json

Per world size and input size, side by side in one run (median of ``--repeats``, the slowest
rank's, ranks starting each call together):

* ``reduce_scatter``   torch.distributed.reduce_scatter_tensor (gloo: an all-reduce of the
                       whole input, then a copy of the shard)
* ``all_to_all+sum``   what zerofx's transport pass runs on gloo instead: the functional
                       all_to_all_single sends each rank its chunk, the receiver adds the N
                       chunks in rank order
* ``all_reduce``       for scale: the whole input reduced everywhere
* ``all_gather``       of an output as large as the reduce-scatter's input
* ``pair_exchange``    the same all-gather as zerofx's exchange pass runs it over two gloo ranks
                       (one all-to-all into the output: zerofx/ir/collectives.py, NOTE: pair
                       exchange); 2 ranks only
* ``pair_reduce_scatter`` the reduce-scatter as the exchange pass runs it over two gloo ranks:
                       only the peer's half sent, received into a half-size buffer and summed
                       there in place (NOTE: pair reduce-scatter); 2 ranks only

Ratios are to ``reduce_scatter`` of the same size and world size. Compare within one run only.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script (python benchmarks/x.py): this checkout's `benchmarks`, and its
    # zerofx whole (passes/ and codegen/ install into it: the bare source tree lacks them; benchmarks/_checkout.py)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks._checkout import import_checkout

    import_checkout()

from benchmarks._launch import launch_local, markdown_table, median_time, positive_int, write_json  # noqa: E402

SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)  # input bytes (fp32)
KINDS = ("reduce_scatter", "all_to_all+sum", "pair_reduce_scatter", "all_reduce", "all_gather", "pair_exchange")
PAIRS_ONLY = ("pair_exchange", "pair_reduce_scatter")


def _measure(fn, repeats: int) -> float:
    t = torch.tensor([median_time(fn, repeats)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _rank_main(sizes: tuple[int, ...], repeats: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    from zerofx.ir.collectives import ALL_TO_ALL, PAIR_GATHER_OUT, PAIR_REDUCE_SCATTER_OUT, PAIR_SUM, WAIT

    group = dist.group.WORLD.group_name
    out = {}
    try:
        for nbytes in sizes:
            n = nbytes // 4 // world * world
            x, shard, gathered = torch.randn(n), torch.empty(n // world), torch.empty(n)
            splits = [n // world] * world

            def a2a_sum():  # as passes/transport.py lowers it: functional, rank-ordered sum
                chunks = WAIT(ALL_TO_ALL(x, splits, splits, group)).view(world, -1)
                total = chunks[0]
                for i in range(1, world):
                    total = total + chunks[i]
                return total

            def pair_reduce_scatter():
                PAIR_SUM(WAIT(PAIR_REDUCE_SCATTER_OUT(x, group, out=shard)), x, group, 1)

            fns = {
                "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, x),
                "all_to_all+sum": a2a_sum,
                "all_reduce": lambda: dist.all_reduce(x.clone()),
                "all_gather": lambda: dist.all_gather_into_tensor(gathered, x[: n // world]),
                "pair_exchange": lambda: WAIT(PAIR_GATHER_OUT(x[: n // world], group, out=gathered)),
                "pair_reduce_scatter": pair_reduce_scatter,
            }
            for kind in KINDS:
                if kind in PAIRS_ONLY and world != 2:
                    continue
                _measure(fns[kind], 3)  # warm-up: connections, buffers
                out[f"{kind}@{nbytes}"] = _measure(fns[kind], repeats)
    finally:
        dist.destroy_process_group()
    return out


def run_world(world: int, sizes: tuple[int, ...], repeats: int) -> dict:
    return launch_local(_rank_main, world, sizes, repeats)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=positive_int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=positive_int, default=30)
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = []
    for world in args.world_sizes:
        times = run_world(world, SIZES, args.repeats)
        for nbytes in SIZES:
            base = times[f"reduce_scatter@{nbytes}"]
            for kind in KINDS:
                t = times.get(f"{kind}@{nbytes}")
                if t is None:
                    continue
                rows.append({"world": world, "input_bytes": nbytes, "kind": kind, "ms": t * 1e3, "ratio": t / base})
    lines = []
    for world in args.world_sizes:
        for nbytes in SIZES:
            cells = [r for r in rows if r["world"] == world and r["input_bytes"] == nbytes]
            by_kind = {r["kind"]: f"{r['ms']:.2f} ms ({r['ratio']:.2f}x)" for r in cells}
            lines.append([str(world), str(nbytes >> 10), *(by_kind.get(k, "n/a") for k in KINDS)])
    print(markdown_table(["N", "input KiB", *KINDS], lines))
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
