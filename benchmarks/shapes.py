"""Does a symbolic sequence length cost step time? Varying-length steps against fixed-shape ones.

    python benchmarks/shapes.py --world-size 2 --lengths 16 32 48 64 80 96 112 128 --rounds 5

Every rank builds the same GPT twice. ``varying`` is compiled with ``dynamic="auto"`` and sees
a different sequence length every step: it compiles twice (the first length exactly, then one
graph with the length as a symbol that every later length reuses). ``fixed`` is compiled with
``dynamic=False``: one graph per length, each specialized to its shape, which is what a run at
one fixed length would execute. After one warm-up step of each at every length (the compiles),
the timed steps interleave: for every length, one step of each model (which one goes first
alternates by round), so load drifting on the machine falls on both alike. A step is forward,
backward and AdamW's step, every rank starting together. The table gives the median step per
length and their ratio (varying / fixed: the symbolic graph's cost at that length); the total
row compares the sums of the medians. ``--json F`` keeps the rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script (python benchmarks/x.py): this checkout's `benchmarks`, and its
    # zerofx whole (passes/ and codegen/ install into it: the bare source tree lacks them; benchmarks/_checkout.py)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks._checkout import import_checkout

    import_checkout()

from benchmarks._launch import launch_local, markdown_table, positive_int, write_json  # noqa: E402


def _step(model, opt, x, y) -> None:
    model(x, y).backward()
    opt.step()
    opt.zero_grad()


def _rank_main(args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import zerofx
    from zerofx.models import GPT, GPTConfig
    from zerofx.runtime.params import runtime_of

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        cfg = GPTConfig(
            vocab_size=args.vocab, seq_len=max(args.lengths), n_layer=args.layers, n_head=4, d_model=args.d_model
        )
        mesh = init_device_mesh("cpu", (world,))
        models, opts = {}, {}
        for name, dynamic in (("varying", "auto"), ("fixed", False)):
            torch.manual_seed(0)
            models[name] = zerofx.compile(GPT(cfg), mesh, stage=args.stage, dynamic=dynamic)
            opts[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(100 + rank)

        def batch(length):
            data = torch.randint(0, cfg.vocab_size, (args.batch, length + 1), generator=gen)
            return data[:, :-1], data[:, 1:]

        compile_s = {}
        for name in models:  # warm-up: every compile happens here
            start = time.perf_counter()
            for length in args.lengths:
                _step(models[name], opts[name], *batch(length))
            compile_s[name] = time.perf_counter() - start
        times: dict[tuple[str, int], list[float]] = {(n, length): [] for n in models for length in args.lengths}
        for r in range(args.rounds):
            order = ("varying", "fixed") if r % 2 == 0 else ("fixed", "varying")
            for length in args.lengths:
                x, y = batch(length)
                for name in order:
                    dist.barrier()
                    start = time.perf_counter()
                    _step(models[name], opts[name], x, y)
                    times[(name, length)].append(time.perf_counter() - start)
        compiles = {name: dict(runtime_of(m).compiled.size_symbols) for name, m in models.items()}
        return {
            "times": {f"{n}:{length}": t for (n, length), t in times.items()},
            "compile_s": compile_s,
            "compiles": compiles,
        }
    finally:
        dist.destroy_process_group()


def _rows(result: dict, lengths: list[int]) -> list[dict]:
    rows = []
    for length in lengths:
        varying = statistics.median(result["times"][f"varying:{length}"]) * 1e3
        fixed = statistics.median(result["times"][f"fixed:{length}"]) * 1e3
        rows.append({"length": length, "varying_ms": varying, "fixed_ms": fixed, "ratio": varying / fixed})
    total_v, total_f = sum(r["varying_ms"] for r in rows), sum(r["fixed_ms"] for r in rows)
    rows.append({"length": "total", "varying_ms": total_v, "fixed_ms": total_f, "ratio": total_v / total_f})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=positive_int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 48, 64, 80, 96, 112, 128])
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    per_rank = launch_local(_rank_main, args.world_size, args)
    rows = _rows(per_rank[0], args.lengths)
    compiles = per_rank[0]["compiles"]
    print(
        markdown_table(
            ["length", "varying ms", "fixed ms", "varying / fixed"],
            [[str(r["length"]), f"{r['varying_ms']:.1f}", f"{r['fixed_ms']:.1f}", f"{r['ratio']:.3f}"] for r in rows],
        )
    )
    for name, frames in compiles.items():
        symbolic = sum(1 for s in frames.values() if s)
        print(
            f"{name}: {len(frames)} compiles ({symbolic} with size symbols), "
            f"warm-up incl. compiles {per_rank[0]['compile_s'][name]:.1f} s (rank 0)"
        )
    write_json(
        args.json,
        [{**r, "world_size": args.world_size, "stage": args.stage} for r in rows]
        + [{"compiles": {n: len(f) for n, f in compiles.items()}, "compile_s": per_rank[0]["compile_s"]}],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
