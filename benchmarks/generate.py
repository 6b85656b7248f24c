"""Generation on a ZeRO-3 model: per-token gathering vs ``zerofx.gathered`` (tokens per second).

    python benchmarks/generate.py --world-sizes 2 --new-tokens 32 --json generate.json

An HF ``LlamaForCausalLM`` built from a config (no download; ``pip install 'zerofx[hf]'``),
compiled with ``zerofx.compile(model, mesh)`` (stage 3), greedy ``generate`` of ``--new-tokens``
tokens for a batch of prompts, side by side in one run, each way ``--repeats`` times
interleaved (the slowest rank's time, median):

* ``per-step``   ``model.generate`` as is: every forward (one per token) all-gathers every
                 parameter inside the compiled graphs. Timed after one untimed generate, so
                 recompiles for new shapes are not counted (they would dominate);
* ``gathered``   inside ``zerofx.gathered(model)``: one all-gather per parameter on entering
                 (counted in the time), then forwards with no communication;
* ``unsharded``  the same model unsharded, on each rank alone: the floor.

Every way must produce the unsharded model's tokens (checked; the run fails otherwise).
``gathered MiB`` is what the context adds per rank (``Gathered.nbytes``).
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

WAYS = ("per-step", "gathered", "unsharded")


def build_llama(hidden: int, layers: int, vocab: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=1024,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _rank_main(hidden: int, layers: int, vocab: int, batch: int, prompt: int, new_tokens: int, repeats: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import zerofx

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        world = dist.get_world_size()
        reference = build_llama(hidden, layers, vocab)
        model = build_llama(hidden, layers, vocab)
        zerofx.compile(model, init_device_mesh("cpu", (world,)))
        ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(1))
        kwargs = dict(
            attention_mask=torch.ones_like(ids),
            pad_token_id=0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
        held = {}

        def per_step():
            return model.generate(ids, **kwargs)

        def gathered():
            with zerofx.gathered(model) as g:
                held["nbytes"] = g.nbytes
                return model.generate(ids, **kwargs)

        def unsharded():
            return reference.generate(ids, **kwargs)

        fns = {"per-step": per_step, "gathered": gathered, "unsharded": unsharded}
        times: dict[str, list[float]] = {w: [] for w in WAYS}
        with torch.no_grad():
            want = unsharded()
            for way in WAYS:  # warm-up: compiles for every shape generate produces
                if not torch.equal(fns[way](), want):
                    raise AssertionError(f"{way}: generated tokens differ from the unsharded model's")
            for _ in range(repeats):
                for way in WAYS:
                    dist.barrier()
                    start = time.perf_counter()
                    fns[way]()
                    times[way].append(_slowest(time.perf_counter() - start))
        out = {w: statistics.median(ts) for w, ts in times.items()}
        out["gathered_bytes"] = held["nbytes"]
        out["params"] = sum(p.numel() for p in reference.parameters())
        return out
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=positive_int, nargs="+", default=[2])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows, lines = [], []
    for world in args.world_sizes:
        r = launch_local(
            _rank_main,
            world,
            args.hidden,
            args.layers,
            args.vocab,
            args.batch,
            args.prompt,
            args.new_tokens,
            args.repeats,
        )[0]
        tokens = args.batch * args.new_tokens
        row = {"world": world, "params": r["params"], "tokens": tokens, "gathered_bytes": r["gathered_bytes"]}
        for way in WAYS:
            row[f"{way}_s"] = r[way]
            row[f"{way}_tokens_per_s"] = tokens / r[way]
        rows.append(row)
        lines.append(
            [
                str(world),
                f"{r['params'] / 1e6:.1f}M",
                *(f"{tokens / r[w]:.1f} ({r['per-step'] / r[w]:.1f}x)" for w in WAYS),
                f"{r['gathered_bytes'] / 2**20:.1f}",
            ]
        )
    print(f"greedy generate, {args.batch} x {args.new_tokens} new tokens; tokens/s (speed-up vs per-step)")
    print(markdown_table(["N", "params", *WAYS, "gathered MiB"], lines))
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
