"""ZeRO on the data-parallel dimension of a (dp, tp) gloo mesh, beside FSDP2 with the same
tensor-parallel plan (torchtitan's composition), in one launch:

    python benchmarks/tp.py --sizes medium llama-medium --json tp.json

Per model (benchmarks/peers.py SIZES: the medium GPT, and an HF LlamaForCausalLM of the same
shapes), every method parallelizes the same seeded model on ``mesh["tp"]`` with the same plan
(``zerofx.tensor_parallel``: ``gpt_plan``, Megatron-style with sequence parallelism, or the HF
model's own ``hf_plan``), then:

* ``fsdp2``: ``fully_shard`` on ``mesh["dp"]`` per transformer block, then the root;
* ``fsdp2_compile``: the same, with each transformer block ``torch.compile``d (in place, before
  ``fully_shard``: torchtitan's order). Compiling the whole model instead fails in torch 2.13:
  dynamo's trace of the row-wise embedding leaves a fake tensor in the output placement's
  mask buffer (``MaskPartial``), and AOTAutograd's trace then mixes fake modes ("Mixing fake
  modes NYI"); the leaked buffer then breaks later embeddings in the same process;
* ``zerofx``: ``zerofx.compile(model, mesh["dp"])`` (ZeRO-3).

Each rank trains on its data-parallel slice of the same batches (ranks of one TP group on the
same slice) with AdamW. Measurement is benchmarks/peers.py's (``prepare``,
``time_round_robin``): every method built and warmed up, then the timed steps interleaved (one
step of each in turn, ranks starting each step together); median step time, the slowest rank's;
peak bytes per rank from the allocator (zerofx.measure.allocations.AllocationTrace, the least of
three traced steady-state steps); model-state bytes (parameters, gradients, optimizer state).
Ratios are to FSDP2 eager of the same run; compare within one run only (ranks share the
machine's cores).
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

from benchmarks import peers  # noqa: E402
from benchmarks._launch import launch_local, markdown_table, write_json  # noqa: E402

METHODS = ("fsdp2", "fsdp2_compile", "zerofx")


def build(method: str, cfg, mesh, size: str) -> torch.nn.Module:
    """``method``'s model on the 2-D ``mesh`` (dims "dp", "tp"): peers' seeded model, tensor
    parallel on "tp" with the model's plan, data parallel on "dp"."""
    import zerofx
    from zerofx.tensor_parallel import gpt_plan, hf_plan, parallelize

    model = peers._build("single", cfg, None, size)  # seeded: the same values for every method
    if size.startswith("llama-"):
        parallelize(model.lm, mesh["tp"], hf_plan(model.lm))
    else:
        parallelize(model, mesh["tp"], gpt_plan(model))
    if method in ("fsdp2", "fsdp2_compile"):
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            if method == "fsdp2_compile":
                block.compile()  # each block in place, before fully_shard, as torchtitan does
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model
    if method == "zerofx":
        return zerofx.compile(model, mesh["dp"])
    raise ValueError(method)


def _rank_main(setups: list[peers.Setup], dp: int, tp: int) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh.get_local_rank("dp")
        out = []
        for setup in setups:
            out.append(peers.measure_methods(setup, dp_rank, dp, mesh, build))
            torch._dynamo.reset()
        return out
    finally:
        dist.destroy_process_group()


def table(rows: list[dict]) -> str:
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([r["size"], r["method"], f"failed: {r['error']}", "", "", "", ""])
            continue
        ratio = "n/a" if r.get("ratio_to_fsdp2") is None else f"{r['ratio_to_fsdp2']:.2f}"
        lines.append(
            [
                r["size"],
                r["method"],
                f"{r['step_s'] * 1e3:.1f}",
                ratio,
                f"{r['compile_s']:.1f}",
                mib(r["peak_bytes"]),
                mib(r["state_bytes"]),
            ]
        )
    header = ["model", "method", "step ms", "×FSDP2 eager", "compile s", "peak MiB/rank", "state MiB/rank"]
    return markdown_table(header, lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["medium", "llama-medium"], choices=sorted(peers.SIZES))
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="steps before measuring (>= 2)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.warmup < 2:
        parser.error("--warmup must be at least 2 (the first compiles; the last notes what a step keeps)")
    if "fsdp2" not in args.methods:
        print("without fsdp2 there is no ratio column", flush=True)
    setups = [peers.Setup(size, args.batch, args.steps, args.warmup, tuple(args.methods)) for size in args.sizes]
    world = args.dp * args.tp
    print(f"(dp, tp) = ({args.dp}, {args.tp}) on {world} gloo ranks: {', '.join(args.sizes)}", flush=True)
    per_rank = launch_local(_rank_main, world, setups, args.dp, args.tp)
    rows = []
    for i, setup in enumerate(setups):
        rows += peers.summarize(setup.size, world, [r[i] for r in per_rank], None)
    print(table(rows))
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
