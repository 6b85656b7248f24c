"""Optimizer-step micro-benchmark: a torch.optim step over zerofx's shards, stepped locally (the
default, zerofx/runtime/local_step.py) against the same step through DTensor, and FSDP2's step.

    python benchmarks/optimizer_step.py --world-sizes 2 4 --json optimizer_step.json
    python benchmarks/optimizer_step.py --whole     # Adafactor, Muon: zerofx's whole-tensor step

With ``--whole``, the optimizers zerofx steps over whole tensors (zerofx/runtime/whole_step.py)
against the same optimizer stepping an unsharded model on every rank (what a DDP rank's step
costs) and FSDP2's step through DTensor (n/a where it fails: Adafactor); ratios are to the
unsharded step.

Per world size, model size and optimizer, side by side in one run: each variant builds the
benchmark GPT (benchmarks/peers.py's sizes) sharded over all ranks, runs one forward/backward
for gradients and one step (the step that adopts the optimizer), then ``--repeats`` steps are
timed interleaved across variants (median, the slowest rank's, ranks starting each step
together). The optimizer's own arithmetic is the same in every variant; what differs is the
per-op DTensor dispatch. Ratios are to FSDP2. Compare within one run only. Each cell also
gives what one more (untimed) step allocated above its start at its peak, on the rank where
that is largest (+MiB: the step's transient memory).
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
from benchmarks.peers import SIZES as PEER_SIZES  # noqa: E402

# the peers' GPTs, and one whose embedding dwarfs every other parameter (as a real LM's
# vocabulary does): the transient memory of a whole-tensor step is its owner's
SIZES = {**PEER_SIZES, "vocab": dict(vocab_size=32768, seq_len=64, n_layer=2, n_head=4, d_model=256)}

OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "AdamW(foreach)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "SGD(momentum)": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
}
VARIANTS = ("fsdp2", "zerofx_dtensor", "zerofx_local")
WHOLE_OPTIMIZERS = {
    "Adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
    "Muon (matrices)": lambda ps: torch.optim.Muon([p for p in ps if p.dim() == 2], lr=2e-2),
}
WHOLE_VARIANTS = ("unsharded", "fsdp2", "zerofx_whole")


def _build(variant: str, size: str, mesh, make_opt):
    from torch.distributed.fsdp import fully_shard

    import zerofx
    from zerofx.models import GPT, GPTConfig, random_batch

    cfg = GPTConfig(**SIZES[size])
    torch.manual_seed(0)
    model = GPT(cfg)
    if variant == "fsdp2":
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif variant == "unsharded":
        pass
    else:
        zerofx.shard(model, mesh, local_optimizer_step=variant == "zerofx_local")
    opt = make_opt(model.parameters())
    x, y = random_batch(cfg, 2, torch.Generator().manual_seed(dist.get_rank()))
    model(x, y).backward()
    opt.step()  # creates the state; zerofx adopts the optimizer here
    return opt


def _built(variant: str, size: str, mesh, make_opt):
    """The variant's optimizer, or None where its first step fails (FSDP2's Adafactor)."""
    try:
        return _build(variant, size, mesh, make_opt)
    except RuntimeError:
        if variant != "fsdp2":
            raise
        return None


def _transient(opt) -> float:
    """Bytes one more step allocates above what was live at its start, at its peak (the
    allocator's view, zerofx.measure.AllocationTrace); NaN where the variant cannot step."""
    from zerofx.measure.allocations import allocated_above_start

    if opt is None:
        return float("nan")
    dist.barrier()
    return float(allocated_above_start(opt.step))


def _rank_main(sizes: list[str], repeats: int, whole: bool) -> dict:
    from zerofx.runtime.local_step import steps_locally

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
    optimizers, variants = (WHOLE_OPTIMIZERS, WHOLE_VARIANTS) if whole else (OPTIMIZERS, VARIANTS)
    out = {}
    try:
        for size in sizes:
            for opt_name, make in optimizers.items():
                opts = {v: _built(v, size, mesh, make) for v in variants}
                if not whole:
                    assert steps_locally(opts["zerofx_local"]) and not steps_locally(opts["zerofx_dtensor"])
                times: dict[str, list[float]] = {v: [] for v in variants}
                for _ in range(repeats):
                    for v, opt in opts.items():
                        if opt is None:
                            continue
                        dist.barrier()
                        start = time.perf_counter()
                        opt.step()
                        times[v].append(time.perf_counter() - start)
                for v in variants:
                    t = torch.tensor(
                        [statistics.median(times[v]) if times[v] else float("nan"), _transient(opts[v])],
                        dtype=torch.float64,
                    )
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    out[(size, opt_name, v)] = tuple(t.tolist())
    finally:
        dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    parser.add_argument("--sizes", nargs="+", default=["small", "medium"], choices=sorted(SIZES))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--whole", action="store_true", help="the whole-tensor step's optimizers (Adafactor, Muon)")
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    optimizers, variants = (WHOLE_OPTIMIZERS, WHOLE_VARIANTS) if args.whole else (OPTIMIZERS, VARIANTS)
    rows = []
    for world in args.world_sizes:
        times = launch_local(_rank_main, world, args.sizes, args.repeats, args.whole)[0]
        for (size, opt_name, v), (t, transient) in times.items():
            rows.append(
                {
                    "world": world,
                    "size": size,
                    "optimizer": opt_name,
                    "variant": v,
                    "ms": None if t != t else t * 1e3,  # NaN: the variant cannot step it
                    "ratio": None if t != t else t / times[(size, opt_name, variants[0])][0],
                    "step_transient_mib": None if transient != transient else transient / 2**20,
                }
            )
    lines = []
    for world in args.world_sizes:
        for size in args.sizes:
            for opt_name in optimizers:
                cells = [r for r in rows if (r["world"], r["size"], r["optimizer"]) == (world, size, opt_name)]
                lines.append(
                    [
                        str(world),
                        size,
                        opt_name,
                        *(
                            "n/a"
                            if r["ms"] is None
                            else f"{r['ms']:.2f} ms ({r['ratio']:.2f}x), +{r['step_transient_mib']:.1f} MiB"
                            for r in cells
                        ),
                    ]
                )
    print(markdown_table(["N", "GPT", "optimizer", *variants], lines))
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
