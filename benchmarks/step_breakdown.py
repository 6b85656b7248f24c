"""Where a training step's time goes, per rank: zerofx against DDP (or any peers.py method).

    python benchmarks/step_breakdown.py --size medium --world 2 --methods ddp zerofx

Every method is built with benchmarks/peers.py's ``_build`` (the same GPT, batch and AdamW;
``zerofx:KEY=VALUE;...`` for any zerofx option), warmed up, then timed interleaved (one step of
each in turn, the order rotating each round). Per step, wall-clock timers split
forward, backward, ``opt.step()`` and ``zero_grad``; over ``--profile-steps`` further steps
torch.profiler's self CPU time of the main thread's ops is grouped into categories:

* compute: matmuls, pointwise, reductions, softmax/attention, embedding, loss;
* wait: ``wait_tensor`` / ``Work.wait`` (communication not hidden behind compute);
* issue: starting collectives (``all_gather_into_tensor_out``, ``all_to_all_single``, c10d ops);
* copies: ``copy_``, ``cat``, ``split_with_sizes_copy``, ``clone``, ``constant_pad_nd``, ``empty``;
* optimizer: ops under ``Optimizer.step`` (the AdamW arithmetic);
* other ops, and "untraced" (the step's wall time minus every op's self time: Python,
  dispatch and framework overhead between ops).

Each rank prints its table; times are ms per step. Compare methods within one run only.

``--timeline`` also profiles one more step of each method and prints every rank's collective
events on one clock: where the training thread issues and waits for each collective, and how
long the backend's worker threads (gloo's) run each one. Waits that begin right after their
collective's issue are communication nothing hides; a worker op that outlasts its peer's issue
is one rank waiting for the other.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script (python benchmarks/x.py): this checkout's `benchmarks`, and its
    # zerofx whole (passes/ and codegen/ install into it: the bare source tree lacks them; benchmarks/_checkout.py)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks._checkout import import_checkout

    import_checkout()

from benchmarks._launch import launch_local, positive_int  # noqa: E402
from benchmarks.peers import (  # noqa: E402
    METHODS,
    OPTIONAL_METHODS,
    SIZES,
    Setup,
    _backward,
    _batches,
    _build,
)

WAIT = ("wait_tensor", "Work.wait", "c10d::wait", "_wait_tensor")
ISSUE = ("all_gather", "all_to_all", "reduce_scatter", "allreduce", "all_reduce", "c10d::", "_c10d_functional::")
COPY = (
    "aten::copy_",
    "aten::cat",
    "split_with_sizes_copy",
    "aten::clone",
    "constant_pad_nd",
    "aten::empty",
    "aten::zeros",
    "aten::fill_",
    "aten::zero_",
    "resize_storage_bytes_",
    "aten::_to_copy",
    "aten::contiguous",
    "aten::index_select",
)


def category(name: str) -> str:
    if any(k in name for k in WAIT):
        return "wait"
    if any(k in name for k in ISSUE):
        return "issue"
    if any(k in name for k in COPY):
        return "copies"
    if name.startswith("aten::"):
        return "compute"
    return "other"


def _timed_step(model, opt, x, y, t: dict) -> None:
    c0, m0 = time.process_time(), time.thread_time()
    t0 = time.perf_counter()
    loss = model(x, y)
    t1 = time.perf_counter()
    _backward(model, loss)
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    opt.zero_grad()
    t4 = time.perf_counter()
    for k, v in (("forward", t1 - t0), ("backward", t2 - t1), ("opt.step", t3 - t2), ("zero_grad", t4 - t3)):
        t[k].append(v)
    t["step"].append(t4 - t0)
    main_cpu, all_cpu = time.thread_time() - m0, time.process_time() - c0
    t["main cpu"].append(main_cpu)  # the training thread's own CPU time
    t["other cpu"].append(all_cpu - main_cpu)  # every other thread of the rank: gloo's workers
    t["off cpu"].append(t4 - t0 - main_cpu)  # the training thread not running: blocked, or preempted


def _marked_step(model, opt, x, y) -> None:
    """One training step, its phases marked for the profiler (``zfx_bench::<phase>``)."""
    from torch.profiler import record_function

    with record_function("zfx_bench::step"):
        with record_function("zfx_bench::forward"):
            loss = model(x, y)
        with record_function("zfx_bench::backward"):
            _backward(model, loss)
        with record_function("zfx_bench::optimizer"):
            opt.step()
            opt.zero_grad()


def _profile(model, opt, batches, mine, steps: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            x, y = batches[i % 2][0][mine], batches[i % 2][1][mine]
            dist.barrier()
            t0 = time.perf_counter()
            _marked_step(model, opt, x, y)
            walls.append(time.perf_counter() - t0)
    main_tid = None
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    for e in events:
        if e.name == "zfx_bench::step":
            main_tid = e.thread
            break
    phases = {
        name: [(e.time_range.start, e.time_range.end) for e in events if e.name == f"zfx_bench::{name}"]
        for name in ("forward", "backward", "optimizer")
    }
    opt_ranges = phases["optimizer"]
    # only what runs inside a timed step: the barrier between steps (waiting for the slower rank)
    # is outside the wall time it is compared with
    step_ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name == "zfx_bench::step"]
    out: dict[str, float] = defaultdict(float)
    split: dict[str, float] = defaultdict(float)  # the same time again, by phase: not added to the total
    for e in events:
        if e.thread != main_tid or e.name.startswith("zfx_bench::"):
            continue
        if not any(a <= e.time_range.start < b for a, b in step_ranges):
            continue
        if not e.name.startswith(("aten::", "c10d", "_c10d_functional", "zerofx::", "inductor::")) and e.cpu_children:
            continue  # Python-side ranges (Optimizer.step#..., record_param_comms): their ops count below
        self_us = e.self_cpu_time_total
        start = e.time_range.start
        cat = category(e.name)
        if cat in ("compute", "copies", "other") and any(a <= start < b for a, b in opt_ranges):
            cat = "optimizer"
        out[cat] += self_us / 1e3 / steps
        for phase, ranges in phases.items():
            if cat != "optimizer" and any(a <= start < b for a, b in ranges):
                split[f"{phase}:{cat}"] += self_us / 1e3 / steps
    total_ops = sum(out.values())  # each op once (until 2026-12-07 the phase split was added in too)
    out["untraced"] = statistics.mean(walls) * 1e3 - total_ops
    out["wall"] = statistics.mean(walls) * 1e3
    return {**out, **split}


def _top_ops(prof_steps: int, model, opt, batches, mine, n: int = 25) -> list[tuple[str, float, int]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(prof_steps):
            x, y = batches[i % 2][0][mine], batches[i % 2][1][mine]
            _backward(model, model(x, y))
            opt.step()
            opt.zero_grad()
    rows = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:n]
    return [(a.key, a.self_cpu_time_total / 1e3 / prof_steps, a.count // prof_steps) for a in rows]


def _timeline(model, opt, batches, mine, rank: int) -> list[tuple[float, str]]:
    """One profiled step: ``(start in ms of wall-clock time, line)`` for the step's phases,
    the training thread's collective issues and waits, and the worker threads' collective runs."""
    from torch.profiler import ProfilerActivity, profile

    x, y = batches[0][0][mine], batches[0][1][mine]
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _marked_step(model, opt, x, y)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    step = next(e for e in events if e.name == "zfx_bench::step")
    # event times count from this process's profiler start; its wall-clock time puts every rank on one clock
    origin = prof.profiler.kineto_results.trace_start_ns() / 1e6
    lines = []
    for e in events:
        start, ms = origin + e.time_range.start / 1e3, (e.time_range.end - e.time_range.start) / 1e3
        if e.thread == step.thread:
            outer = e.cpu_parent is None or category(e.cpu_parent.name) not in ("wait", "issue")
            if e.name.startswith("zfx_bench::") or category(e.name) in ("wait", "issue") and outer:
                lines.append((start, f"r{rank} {ms:7.2f} ms  {e.name}"))
        elif e.name.startswith("gloo:") or "nccl" in e.name.lower():
            lines.append((start, f"r{rank} {ms:7.2f} ms    [worker {e.thread}] {e.name}"))
    return lines


STEP_METHODS = tuple(m for m in METHODS + OPTIONAL_METHODS if m != "deepspeed")


def _step_method(name: str) -> str:
    """An argparse ``type``: a peers.py method ``_build`` makes whole (DeepSpeed's engine is made
    with its optimizer by peers.py's ``prepare``, so it is not one here)."""
    if name in STEP_METHODS or name.startswith("zerofx:"):
        return name
    raise argparse.ArgumentTypeError(f"unknown method {name!r}: one of {STEP_METHODS}, or zerofx:KEY=VALUE;...")


def _rank_main(args) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    from zerofx.models import GPTConfig

    cfg = GPTConfig(**SIZES[args.size])
    setup = Setup(args.size, args.batch, args.steps, 2, tuple(args.methods))
    batches = list(_batches(cfg, setup, world, 2))
    mine = slice(rank * args.batch, (rank + 1) * args.batch)
    built = {}
    for m in args.methods:
        model = _build(m, cfg, mesh, args.size)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for i in range(3):
            x, y = batches[i % 2][0][mine], batches[i % 2][1][mine]
            _backward(model, model(x, y))
            opt.step()
            opt.zero_grad()
        built[m] = (model, opt)
        dist.barrier()
    timers = {m: defaultdict(list) for m in args.methods}
    names = list(built)
    for i in range(args.steps):  # the order rotates each round, as in peers.py
        for m in names[i % len(names) :] + names[: i % len(names)]:
            model, opt = built[m]
            x, y = batches[i % 2][0][mine], batches[i % 2][1][mine]
            dist.barrier()
            _timed_step(model, opt, x, y, timers[m])
    result = {}
    for m, (model, opt) in built.items():
        dist.barrier()
        cats = _profile(model, opt, batches, mine, args.profile_steps)
        dist.barrier()
        top = _top_ops(args.profile_steps, model, opt, batches, mine) if args.top else []
        timeline = _timeline(model, opt, batches, mine, rank) if args.timeline else []
        result[m] = {
            "timers": {k: statistics.median(v) * 1e3 for k, v in timers[m].items()},
            "categories": cats,
            "top": top,
            "timeline": timeline,
        }
    dist.destroy_process_group()
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="medium", choices=sorted(SIZES))
    p.add_argument("--world", type=positive_int, default=2)
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--profile-steps", type=positive_int, default=4)
    p.add_argument(
        "--methods",
        nargs="+",
        default=["ddp", "zerofx"],
        type=_step_method,
        help=f"of {', '.join(STEP_METHODS)}; or zerofx:KEY=VALUE;... (zerofx.compile's options)",
    )
    p.add_argument("--top", action="store_true", help="also list the 25 ops with the most self CPU time")
    p.add_argument("--timeline", action="store_true", help="also print one step's collectives, every rank on one clock")
    args = p.parse_args(argv)
    per_rank = launch_local(_rank_main, args.world, args)
    cats = ("compute", "wait", "issue", "copies", "optimizer", "other", "untraced", "wall")
    timers = ("forward", "backward", "opt.step", "zero_grad", "step", "main cpu", "other cpu", "off cpu")
    for rank, res in enumerate(per_rank):
        print(f"\nrank {rank} (ms per step; timers: median of {args.steps}, categories: mean of {args.profile_steps})")
        print("| method | " + " | ".join(timers) + " | " + " | ".join(cats) + " |")
        print("|---" * (1 + len(timers) + len(cats)) + "|")
        for m, r in res.items():
            t = " | ".join(f"{r['timers'].get(k, 0):.1f}" for k in timers)
            c = " | ".join(f"{r['categories'].get(k, 0):.1f}" for k in cats)
            print(f"| {m} | {t} | {c} |")
        for m, r in res.items():
            split = {k: v for k, v in r["categories"].items() if ":" in k}
            print(f"  {m} by phase: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(split.items())))
        for m, r in res.items():
            if r["top"]:
                print(f"\n  rank {rank} {m}: top ops (self ms/step, calls/step)")
                for name, ms, count in r["top"]:
                    print(f"    {ms:7.2f}  {count:5d}  {name}")
    for m in per_rank[0] if args.timeline else ():
        merged = sorted(line for res in per_rank for line in res[m]["timeline"])
        print(f"\n{m}: one step's collectives, ms since the first rank started it (issue, wait, worker run)")
        for start, text in merged:
            print(f"  {start - merged[0][0]:8.1f}  {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
