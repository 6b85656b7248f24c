"""Rank-side scenarios for tests/test_overlap.py: bucketing, scheduling, selective unsharding,
and the cost model's memory prediction against the allocator."""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

import zerofx
from tests.models import CASES, MLP
from tests.multirank import attempt as run_scenario
from zerofx.measure.allocations import AllocationTrace
from zerofx.models import GPT, GPTConfig, random_batch
from zerofx.passes.cost_model import predict_step_peak
from zerofx.runtime.params import runtime_of

BENCH_GPT = GPTConfig(vocab_size=512, seq_len=128, n_layer=4, n_head=4, d_model=128)  # benchmarks' "small"


def _train_gpt(mesh, rank, world, steps, **options):
    torch.manual_seed(0)
    model = zerofx.compile(GPT(BENCH_GPT), mesh, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        x, y = random_batch(BENCH_GPT, 2 * world, gen)
        loss = model(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.to_local().clone() for p in model.parameters()]


def scenarios(rank: int, world: int, dump_root: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}

    def attempt(name, fn):
        run_scenario(out, name, fn)

    def exact_parity():
        plain_losses, plain_params = _train_gpt(mesh, rank, world, 4, disable_passes=("bucket", "schedule"))
        torch._dynamo.reset()
        losses, params = _train_gpt(mesh, rank, world, 4, dump_dir=f"{dump_root}/gpt")
        return {
            "losses_equal": plain_losses == losses,
            "params_equal": all(torch.equal(a, b) for a, b in zip(plain_params, params)),
            "losses": losses,
        }

    def unsharding(budget, **options):
        def run():
            case = CASES["mlp"]
            torch.manual_seed(0)
            model = case.build()
            ref = copy.deepcopy(model)
            zerofx.compile(model, mesh, keep_gathered_bytes=budget, bucket_bytes=0, **options)
            x, y = case.batch(2 * world, torch.Generator().manual_seed(1))
            mine = slice(2 * rank, 2 * rank + 2)
            with zerofx.CollectiveCounter() as comm:
                model(x[mine], y[mine]).backward()
            ref(x, y).backward()
            worst = max(
                (p.grad.to_local() - _rows(q.grad, rank, world)).abs().max().item()
                for p, q in zip(model.parameters(), ref.parameters())
            )
            psi = sum(p.numel() * p.element_size() for p in ref.parameters())
            return {"comm": dict(comm.bytes), "psi": psi, "grad_err": worst}

        return run

    def prefetch_order():
        torch.manual_seed(0)
        model = MLP(dims=(16, 64, 64, 64, 8))
        zerofx.compile(model, mesh, bucket_bytes=0, dump_dir=f"{dump_root}/mlp")
        x, y = CASES["mlp"].batch(2, torch.Generator().manual_seed(1))
        model(x, y).backward()
        return {}

    def memory_prediction():
        torch.manual_seed(0)
        model = zerofx.compile(GPT(BENCH_GPT), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)
        for step in range(3):
            x, y = random_batch(BENCH_GPT, 4, gen)
            if step == 2:
                with AllocationTrace() as trace:
                    t0 = trace.mark()
                    model(x, y).backward()
                    t1 = trace.mark()
                measured = trace.peak_between(t0, t1) - trace.live_at(t0)
            else:
                model(x, y).backward()
            opt.step()
            opt.zero_grad()
        estimates = runtime_of(model).compiled.memory_estimates
        frames = sorted(
            {gid for gid, kind in estimates if kind == "backward"}, key=lambda g: int(g.removeprefix("frame"))
        )
        return {"measured": measured, "predicted": predict_step_peak(estimates, frames[-1:])}

    def calibration():
        import os

        from zerofx.passes.cost_model import calibrate_comm

        os.environ["ZEROFX_CACHE_DIR"] = f"{dump_root}/cache"
        measured = calibrate_comm(repeats=3)
        cached = calibrate_comm(repeats=3)
        return {
            "measured": (measured.latency_s, measured.seconds_per_byte),
            "cached": (cached.latency_s, cached.seconds_per_byte),
        }

    attempt("calibration", calibration)
    attempt("exact_parity", exact_parity)
    for budget in (0, 1100, 10**9):
        attempt(f"unsharding_{budget}", unsharding(budget))
    # kept gathered parameters under an activation plan (a kept weight's transpose is a view:
    # its base is what the plan saves)
    attempt("unsharding_1100_budget", unsharding(1100, activation_budget=0.5))
    attempt("prefetch_order", prefetch_order)
    attempt("memory_prediction", memory_prediction)
    return out


def _rows(full, rank, world):
    rows = -(-full.shape[0] // world)
    return full[rank * rows : min((rank + 1) * rows, full.shape[0])]
