"""``zerofx.plan``'s predictions against measured training steps, configuration by configuration.

    python benchmarks/plan_accuracy.py --json plan_accuracy.json

For each configuration: plan first (fake tensors, fake process group, in this process), then
train it for real on local gloo ranks and measure ten steps after two warm-up ones on rank 0
(the planned rank):

* model-state bytes: ``zerofx.model_state_bytes(model, opt)`` after the backward (parameters,
  gradients, optimizer state, by storage), against ``PerRank.model_state_bytes``;
* step peak: the allocator's live bytes during forward + backward above the step's start
  (``AllocationTrace``, profiler memory events), the largest of the measured steps (when gloo's
  threads allocate varies it by a buffer or so), against ``PerRank.step_peak_bytes``;
* collective bytes: ``CollectiveCounter`` over forward, backward and optimizer step, against
  the sum of ``Plan.comm_bytes_per_step``;
* step time: measured beside the roofline prediction on this CPU's rates (no target: the CPU
  model is one core's round numbers).

Both sides run with ``calibrate=False`` (the default): the decisions that depend on the collective
constants (bucket sizes) are then the same in the plan and in the run.
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

BATCH, SEQ = 4, 64
MEASURED = 10  # steps measured after two warm-up steps: the largest peak counts (when gloo's threads run varies it)


def build_gpt():
    from zerofx.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=512, seq_len=SEQ, n_layer=2, n_head=4, d_model=128))


def build_hf_llama():
    return small_hf_llama(2, SEQ)


MODELS = {"gpt": build_gpt, "hf-llama": build_hf_llama}

# (model, world, options)
CONFIGS = [
    ("gpt", 2, {"stage": 3}),
    ("gpt", 2, {"stage": 1}),
    ("gpt", 2, {"stage": 2}),
    ("gpt", 4, {"stage": 3}),
    ("gpt", 2, {"stage": 3, "activation_budget": 0}),
    ("hf-llama", 2, {"stage": 3}),
    ("hf-llama", 4, {"stage": 2}),
    ("hf-llama", 2, {"stage": 3, "activation_budget": 0}),
    # bf16 logits the caller holds while the backward rebuilds their fp32 copy; stage 1's boundary
    # reduce while the caller still holds them
    ("hf-llama", 2, {"stage": 3, "param_dtype": "bf16"}),
    ("hf-llama", 2, {"stage": 1, "param_dtype": "bf16"}),
    # ZeRO++: quantize / dequantize hold an fp32 buffer of the bucket while they run (cost_model.py,
    # NOTE: op workspace)
    ("gpt", 2, {"stage": 3, "param_dtype": "bf16", "quantize_weights": "int8", "quantize_grads": "int8"}),
    ("gpt", 2, {"stage": 2, "quantize_grads": "int4"}),
    ("gpt", 2, {"stage": 3, "quantize_weights": "fp8"}),
]


def _batch(model_name: str, vocab: int, gen: torch.Generator):
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    if model_name == "hf-llama":
        return (), {"input_ids": tokens, "labels": tokens}
    return (tokens, tokens), {}


def _loss(out):
    return out.loss if hasattr(out, "loss") else out


def measure_rank(model_name: str, options: dict) -> dict:
    """One rank: two warm-up AdamW steps, then ``MEASURED`` measured ones."""
    import zerofx
    from zerofx.measure.allocations import AllocationTrace

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = zerofx.compile(MODELS[model_name](), mesh, **options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)
        peaks, times = [], []
        for step in range(2 + MEASURED):
            args, kwargs = _batch(model_name, 512, gen)
            if step < 2:
                _loss(model(*args, **kwargs)).backward()
                opt.step()
                opt.zero_grad()
                continue
            dist.barrier()
            started = time.perf_counter()
            with zerofx.CollectiveCounter() as comm:
                with AllocationTrace() as trace:
                    t0 = trace.mark()
                    out = model(*args, **kwargs)  # held through the backward, as the plan assumes
                    _loss(out).backward()
                    t1 = trace.mark()
                    del out
                state = zerofx.model_state_bytes(model, opt)
                opt.step()
            times.append(time.perf_counter() - started)
            peaks.append(trace.peak_between(t0, t1) - trace.live_at(t0))
            opt.zero_grad()
        out = {
            "model_state_bytes": state.total,
            "step_peak_bytes": max(peaks),
            "step_peaks": peaks,
            "comm_bytes": comm.total_bytes,
            "step_s": statistics.median(times),
        }
        return out
    finally:
        dist.destroy_process_group()


def run_config(model_name: str, world: int, options: dict) -> dict:
    import zerofx

    plan = zerofx.plan(MODELS[model_name], (world,), batch=BATCH, seq=SEQ, device="cpu", backend="gloo", **options)
    measured = launch_local(measure_rank, world, model_name, options)[0]
    predicted = {
        "model_state_bytes": plan.per_rank.model_state_bytes,
        "step_peak_bytes": plan.per_rank.step_peak_bytes,
        "comm_bytes": sum(b for dims in plan.comm_bytes_per_step.values() for b in dims.values()),
        "step_s": plan.step_time_s,
    }
    return {
        "model": model_name,
        "world": world,
        "options": options,
        "predicted": predicted,
        "measured": measured,
        "ratio": {k: predicted[k] / measured[k] if measured[k] else float("nan") for k in predicted},
        "plan_s": plan.plan_seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--only", default=None, choices=sorted(MODELS), help="run only configurations whose model is this"
    )
    args = parser.parse_args(argv)
    rows = [run_config(m, w, o) for m, w, o in CONFIGS if args.only in (None, m)]
    lines = []
    for r in rows:
        p, m, q = r["predicted"], r["measured"], r["ratio"]
        opts = ", ".join(f"{k}={v}" for k, v in r["options"].items())
        lines.append(
            [
                r["model"],
                str(r["world"]),
                opts,
                f"{p['model_state_bytes']} / {m['model_state_bytes']}",
                f"{p['step_peak_bytes'] / 2**20:.2f} / {m['step_peak_bytes'] / 2**20:.2f} ({q['step_peak_bytes']:.3f})",
                f"{p['comm_bytes']} / {m['comm_bytes']} ({q['comm_bytes']:.4f})",
                f"{p['step_s'] * 1e3:.0f} / {m['step_s'] * 1e3:.0f}",
            ]
        )
    print(
        markdown_table(
            [
                "model",
                "ranks",
                "options",
                "model state B (pred / meas)",
                "step peak MiB (pred / meas, ratio)",
                "collective B (pred / meas, ratio)",
                "step ms (pred / meas)",
            ],
            lines,
        )
    )
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
