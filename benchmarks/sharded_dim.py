"""Weights with fewer rows than ranks: zerofx's split along another dim against the split by rows.

    python benchmarks/sharded_dim.py --world-sizes 4 --json sharded_dim.json

A mixture-of-experts Llama (zerofx.models, expert-choice routing: every rank runs the same
graph) whose stacked experts ([experts, d, 2 * ffn] and [experts, ffn, d]) have fewer rows than
ranks, trained with zerofx (stage 3, AdamW) in two layouts side by side in one run: zerofx's
choice (``Shard(1)`` for the experts: zerofx/ir/layout.py, NOTE: the sharded dim) and
``shard_placement_fn=lambda p: Shard(0)`` (by rows: the first ranks hold a whole expert each,
the others none). The steps are timed interleaved (median of each layout's steps, the slowest
rank's, ranks starting each step together). Per layout: the most model-state bytes any rank
holds (parameters, gradients and optimizer state: ``zerofx.model_state_bytes``) and the bytes
each rank's collectives move per step (``zerofx.CollectiveCounter``). Compare within one run.
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

from benchmarks._launch import launch_local, markdown_table, write_json  # noqa: E402

LAYOUTS = ("zerofx", "rows")
CONFIG = dict(vocab_size=512, seq_len=64, n_layer=2, n_head=4, n_kv_head=2, d_model=256, ffn_hidden=512)


def _by_rows(param: torch.Tensor):
    from torch.distributed.tensor import Shard

    return Shard(0)


def _build(layout: str, experts: int, mesh):
    import zerofx
    from zerofx.models import Llama, LlamaConfig

    cfg = LlamaConfig(**CONFIG, n_experts=experts)
    torch.manual_seed(0)
    model = zerofx.compile(Llama(cfg), mesh, shard_placement_fn=_by_rows if layout == "rows" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=gen)
    return model, opt, (tokens[:, :-1], tokens[:, 1:])


def _step(model, opt, batch) -> None:
    model(*batch).backward()
    opt.step()
    opt.zero_grad()


def _rank_main(experts: int, steps: int) -> dict:
    import zerofx

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    try:
        built = {layout: _build(layout, experts, mesh) for layout in LAYOUTS}
        comm = {}
        for layout, (model, opt, batch) in built.items():
            for _ in range(2):  # compiles; the optimizer's state
                _step(model, opt, batch)
            with zerofx.CollectiveCounter() as counter:
                _step(model, opt, batch)
            comm[layout] = counter.total_bytes
        times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        for _ in range(steps):
            for layout, (model, opt, batch) in built.items():
                dist.barrier()
                start = time.perf_counter()
                _step(model, opt, batch)
                times[layout].append(time.perf_counter() - start)
        for layout, (model, opt, batch) in built.items():
            model(*batch).backward()  # gradients held, as at the step
            state = zerofx.model_state_bytes(model, opt).total
            opt.zero_grad()
            t = torch.tensor([statistics.median(times[layout]), state, comm[layout]], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out[layout] = tuple(t.tolist())
    finally:
        dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[4])
    parser.add_argument(
        "--experts", type=int, default=2, help="at least 2 (each token picks 2), fewer than the ranks to mean anything"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.experts < 2:
        parser.error("--experts: at least 2 (expert-choice routing sends each token to 2 experts)")
    rows = []
    for world in args.world_sizes:
        got = launch_local(_rank_main, world, args.experts, args.steps)[0]
        for layout in LAYOUTS:
            seconds, state, comm = got[layout]
            rows.append(
                {
                    "world": world,
                    "experts": args.experts,
                    "layout": layout,
                    "step_ms": seconds * 1e3,
                    "ratio": seconds / got["rows"][0],
                    "max_state_mib": state / 2**20,
                    "comm_mib": comm / 2**20,
                }
            )
    lines = [
        [
            str(r["world"]),
            str(r["experts"]),
            r["layout"],
            f"{r['step_ms']:.1f} ({r['ratio']:.2f}x)",
            f"{r['max_state_mib']:.2f}",
            f"{r['comm_mib']:.2f}",
        ]
        for r in rows
    ]
    header = ["N", "experts", "layout", "step ms (x rows)", "most model state MiB/rank", "comm MiB/step/rank"]
    print(markdown_table(header, lines))
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
