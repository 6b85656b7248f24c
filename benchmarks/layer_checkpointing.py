"""transformers' activation checkpointing under zerofx: taken over, as torch.utils.checkpoint calls, or off.

    python benchmarks/layer_checkpointing.py --world-size 2 --json layer_checkpointing.json

An HF ``LlamaForCausalLM`` from a config (4 layers, width 256, vocab 512), default ``zerofx.compile`` (stage 3), trained in four
ways side by side in one run, the steps interleaved:

- ``off``: no activation checkpointing;
- ``taken over``: ``model.activation_checkpointing_enable()`` before ``zerofx.compile``, which
  recomputes the layers with its own checkpoint pass (zerofx/layer_checkpointing.py);
- ``torch calls``: the same call after ``zerofx.compile``, so each layer runs
  ``torch.utils.checkpoint`` and the plan treats each call as a region (passes/checkpoint.py,
  NOTE: checkpoint calls in the model);
- ``zerofx full``: ``checkpoint="full"`` (every block recomputed) on the model without it.

Per way, rank 0's: the bytes the forward leaves saved for the backward, the step's peak above
model state (``zerofx.MemoryTracker``), the backward's FLOPs, the dynamo frames compiled, and
the median step time (AdamW; the slowest rank's). Compare within one run.
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

from benchmarks._launch import launch_local, markdown_table, small_hf_llama, write_json  # noqa: E402

WAYS = ("off", "taken over", "torch calls", "zerofx full")
CONFIG = dict(n_layer=4, hidden=256, intermediate=1024)  # benchmarks._launch.small_hf_llama: vocab 512, 4 heads


def _build(way: str, mesh, seq: int):
    import zerofx

    torch.manual_seed(0)
    model = small_hf_llama(seq=seq, **CONFIG).train()
    if way == "taken over":
        model.activation_checkpointing_enable()
    zerofx.compile(model, mesh, **({"checkpoint": "full"} if way == "zerofx full" else {}))
    if way == "torch calls":
        model.activation_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, model.config.vocab_size, (4, seq), generator=gen)
    return model, opt, tokens


def _step(model, opt, tokens) -> None:
    model(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    opt.zero_grad()


def _rank(steps: int, seq: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        return _measure(init_device_mesh("cpu", (dist.get_world_size(),)), steps, seq)
    finally:
        dist.destroy_process_group()


def _measure(mesh, steps: int, seq: int) -> dict:
    from torch._dynamo.utils import counters

    import zerofx

    built, out = {}, {}
    for way in WAYS:
        frames = counters["stats"]["unique_graphs"]
        model, opt, tokens = built[way] = _build(way, mesh, seq)
        _step(model, opt, tokens)  # compiles
        with zerofx.MemoryTracker() as mem:
            model(input_ids=tokens, labels=tokens).loss.backward()
        opt.zero_grad()
        summary = mem.summary()
        out[way] = {
            "saved_bytes": max(summary["saved_at_boundary"]),
            "peak_bytes": summary["peak"],
            "backward_flops": summary["flops"]["backward"],
            "frames": counters["stats"]["unique_graphs"] - frames,
            "times": [],
        }
    for _ in range(steps):  # interleaved: every way once per round
        for way in WAYS:
            dist.barrier()
            start = time.perf_counter()
            _step(*built[way])
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            out[way]["times"].append(float(elapsed))
    for way in WAYS:
        out[way]["step_ms"] = 1e3 * statistics.median(out[way].pop("times"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    result = launch_local(_rank, args.world_size, args.steps, args.seq)[0]
    mib = lambda n: f"{n / 2**20:.2f}"  # noqa: E731
    lines = [
        [
            way,
            mib(r["saved_bytes"]),
            mib(r["peak_bytes"]),
            f"{r['backward_flops'] / 1e9:.2f}",
            str(r["frames"]),
            f"{r['step_ms']:.1f}",
        ]
        for way, r in result.items()
    ]
    print(f"HF Llama {CONFIG}, batch 4 x {args.seq} per rank, {args.world_size} ranks, rank 0:")
    print(
        markdown_table(
            ["way", "saved for backward (MiB)", "peak (MiB)", "backward GFLOP", "frames", "step (ms)"], lines
        )
    )
    if args.json:
        write_json(
            args.json, [{"way": way, "world_size": args.world_size, "seq": args.seq, **r} for way, r in result.items()]
        )


if __name__ == "__main__":
    main()
