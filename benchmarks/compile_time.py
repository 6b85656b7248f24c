"""Compile time: ``zerofx.compile(model, mesh)`` against ``torch.compile(model)`` (Inductor).

    python benchmarks/compile_time.py --sizes medium llama-medium --rounds 2
    python benchmarks/compile_time.py --sizes deep --world 2 --rounds 1

One gloo rank by default, where zerofx does not shard (no gathers to bucket or schedule: the
unsharded model's compile); ``--world 2`` compiles the sharded model on two ranks, each timing
its own, which is what issue 19's compile-time target is judged by, the benchmark models of benchmarks/peers.py (the medium GPT; "llama-medium", an HF
``LlamaForCausalLM`` from a config with the same shapes; "deep", 48 narrow GPT blocks, for passes
whose cost grows with depth). Per round and method a fresh model is
built and its first training step (forward + backward) timed; compile time is that step minus
the median of the next three. The methods alternate within each round, and Inductor's caches
are disabled (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``, set here before torch is imported), so
every round compiles from scratch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if __package__ in (None, ""):  # run as a script (python benchmarks/x.py): this checkout's `benchmarks`, and its
    # zerofx whole (passes/ and codegen/ install into it: the bare source tree lacks them; benchmarks/_checkout.py)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks._checkout import import_checkout

    import_checkout()

from benchmarks._launch import launch_local, markdown_table, positive_int, write_json  # noqa: E402
from benchmarks.peers import SIZES, HFCausalLM  # noqa: E402

METHODS = ("inductor", "zerofx")


def _compile_seconds(method: str, size: str, mesh) -> float:
    import zerofx
    from zerofx.models import GPT, GPTConfig

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(**SIZES[size])
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=g) for _ in range(2))
    model = HFCausalLM(cfg) if size.startswith("llama-") else GPT(cfg)
    model = torch.compile(model) if method == "inductor" else zerofx.compile(model, mesh)
    start = time.perf_counter()
    model(x, y).backward()
    first = time.perf_counter() - start
    steps = []
    for _ in range(3):
        start = time.perf_counter()
        model(x, y).backward()
        steps.append(time.perf_counter() - start)
    return first - statistics.median(steps)


def _rank_main(sizes: list[str], rounds: int) -> list[dict]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
        rows = []
        for size in sizes:
            seconds: dict[str, list[float]] = {m: [] for m in METHODS}
            for _ in range(rounds):
                for method in METHODS:
                    seconds[method].append(_compile_seconds(method, size, mesh))
            ratios = [z / i for z, i in zip(seconds["zerofx"], seconds["inductor"])]
            rows.append({"size": size, **{f"{m}_s": seconds[m] for m in METHODS}, "ratios": ratios})
        return rows
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["medium", "llama-medium"], choices=sorted(SIZES))
    parser.add_argument("--rounds", type=positive_int, default=2)
    parser.add_argument("--world", type=positive_int, default=1, help="ranks compiling (rank 0's times are printed)")
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = launch_local(_rank_main, args.world, args.sizes, args.rounds)[0]
    fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    print(
        markdown_table(
            ["model", "torch.compile (Inductor) s", "zerofx.compile s", "zerofx / Inductor per round"],
            [
                [r["size"], fmt(r["inductor_s"]), fmt(r["zerofx_s"]), ", ".join(f"{x:.2f}" for x in r["ratios"])]
                for r in rows
            ],
        )
    )
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
