"""``zerofx demo``: train a small GPT with ZeRO (stage 3 by default) on local gloo ranks and
show what it costs.

The ranks are started with torchrun's own machinery (``zerofx.launch.local_ranks``), exactly
as ``torchrun --standalone --nproc-per-node N`` would, so nothing here is a home-made launcher.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DemoConfig:
    world_size: int = 2
    steps: int = 20
    batch: int = 4  # sequences per rank
    seq_len: int = 64
    layers: int = 2
    d_model: int = 64
    heads: int = 4
    vocab: int = 256
    lr: float = 1e-2
    dataset_size: int = 16
    dump_dir: str | None = None
    stage: int = 3
    param_dtype: str | None = None  # "bf16" for bf16 compute from fp32 master shards
    progress: bool = False  # one progress line redrawn in place (a terminal) instead of a line per step
    plot_dir: str | None = None  # write loss.png, memory.png and demo.json here
    plan: bool = False  # zerofx.plan the run first, then print the prediction beside the measurement


class ProgressLine:
    """A progress bar on one terminal line, redrawn in place: ``[####......] 7/20`` with the
    step's numbers and the time left. A dependency (tqdm, rich) would do the same for the one
    bar the demo draws; this is the few lines it needs, and nothing to install."""

    def __init__(self, total: int, stream=None):
        self.total = total
        self.stream = stream or sys.stdout
        self.first_done: float | None = None  # when the first step (which compiles) ended

    def update(self, done: int, text: str) -> None:
        width = shutil.get_terminal_size((100, 20)).columns
        now = time.perf_counter()
        if self.first_done is None:
            self.first_done = now
        # time left from the steps after the first: compiling makes the first one no guide
        eta = (now - self.first_done) / (done - 1) * (self.total - done) if done > 1 else 0.0
        bar_width = 20
        filled = bar_width * done // self.total
        line = f"[{'#' * filled}{'.' * (bar_width - filled)}] {done}/{self.total} ETA {eta:.0f}s {text}"
        self.stream.write("\r" + line[: width - 1].ljust(width - 1))
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _rank_main(cfg: DemoConfig) -> dict:
    import zerofx

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = _demo_model(cfg)
        unsharded = [p for p in model.parameters()]
        psi = sum(p.numel() * p.element_size() for p in unsharded)
        # params + grads + AdamW's two moments, all fp32
        unsharded_state = psi * 4
        options = {"dump_dir": cfg.dump_dir} if cfg.dump_dir else {}
        options.update(stage=cfg.stage, param_dtype=cfg.param_dtype)
        model = zerofx.compile(model, mesh, **options)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        # a fixed set of random token sequences: random data, yet learnable (memorized), so the
        # loss visibly falls; each rank draws its own batches from it
        data_gen = torch.Generator().manual_seed(1000)
        dataset = torch.randint(0, cfg.vocab, (cfg.dataset_size, cfg.seq_len + 1), generator=data_gen)
        gen = torch.Generator().manual_seed(2000 + rank)
        say = print if rank == 0 else (lambda *a, **k: None)
        say(
            f"zerofx demo: GPT {cfg.layers} layers, d_model {cfg.d_model}, {sum(p.numel() for p in unsharded):,} "
            f"parameters ({_mb(psi)}), ZeRO-{cfg.stage}{' with ' + cfg.param_dtype + ' compute' if cfg.param_dtype else ''} "
            f"over {world} gloo ranks, {cfg.steps} AdamW steps"
        )
        bar = ProgressLine(cfg.steps) if cfg.progress and rank == 0 else None
        if bar is None:
            say(f"{'step':>9} {'loss':>8} {'time':>9} {'all-gather':>12} {'reduce-scatter':>15}")
        comm_per_step = {}
        series: dict[str, list[float]] = {"loss": [], "measured_peak": [], "step_ms": []}
        started = time.perf_counter()
        for step in range(cfg.steps):
            rows = dataset[torch.randint(0, cfg.dataset_size, (cfg.batch,), generator=gen)]
            tokens, targets = rows[:, :-1], rows[:, 1:]
            t0 = time.perf_counter()
            with zerofx.CollectiveCounter() as comm:  # stages 1-2 all-gather after the step
                with zerofx.MemoryTracker() as mem:  # what the compiled graphs allocate
                    loss = model(tokens, targets)
                    loss.backward()
                opt.step()
            if step == cfg.steps - 1:
                state = zerofx.model_state_bytes(model, opt)  # grads still held: the step's peak
            opt.zero_grad()
            elapsed = time.perf_counter() - t0
            mean_loss = loss.detach().float()
            dist.all_reduce(mean_loss)
            comm_per_step = dict(comm.bytes)
            series["loss"].append(mean_loss.item() / world)
            series["measured_peak"].append(mem.peak)
            series["step_ms"].append(elapsed * 1e3)
            if bar is not None:
                bar.update(
                    step + 1,
                    f"loss {mean_loss.item() / world:.4f} {elapsed * 1e3:.0f} ms/step "
                    f"all-gather {_mb(comm.bytes['all_gather'])} reduce-scatter {_mb(comm.bytes['reduce_scatter'])}",
                )
            else:
                say(
                    f"{step + 1:>4}/{cfg.steps:<4} {mean_loss.item() / world:8.4f} {elapsed * 1e3:7.0f}ms "
                    f"{_mb(comm.bytes['all_gather']):>12} {_mb(comm.bytes['reduce_scatter']):>15}",
                    flush=True,
                )
        if bar is not None:
            bar.close()
            say(f"loss {series['loss'][0]:.4f} -> {series['loss'][-1]:.4f}")
        # tensors, not all_gather_object: object collectives need NumPy, which zerofx does not
        mine = torch.tensor([state.params, state.grads, state.optimizer, state.total], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        per_rank = [dict(zip(("params", "grads", "optimizer", "total"), t.tolist())) for t in gathered]
        total_time = time.perf_counter() - started
        share = (world - 1) / world
        if rank == 0:
            print(f"\nmodel state per rank (params + grads + AdamW state), unsharded total {_mb(unsharded_state)}:")
            for r, s in enumerate(per_rank):
                print(
                    f"  rank {r}: {_mb(s['total'])} = {s['total'] / unsharded_state:.1%} of unsharded "
                    f"(params {_mb(s['params'])}, grads {_mb(s['grads'])}, optimizer {_mb(s['optimizer'])})"
                )
            moved = sum(comm_per_step.values())
            if cfg.stage == 3:
                bound = (
                    f"ZeRO-3 bound 3·Ψ·(N-1)/N = {_mb(3 * psi * share)}; the backward re-gathers only the "
                    "parameters it reads"
                )
            else:
                bound = f"ZeRO-{cfg.stage}: 2·Ψ·(N-1)/N = {_mb(2 * psi * share)}"
            if cfg.param_dtype:
                bound += f"; all-gathers move {cfg.param_dtype}"
            print(f"collective bytes per step per rank: {_mb(moved)} ({bound})")
            print(f"{cfg.steps} steps in {total_time:.1f}s (first step includes compilation)")
            if cfg.plot_dir:
                series["estimated_peak"] = _estimated_peak(model)
                for line in write_plots(cfg, series):
                    print(line)
        return {"state": per_rank[rank], "comm": comm_per_step, "psi": psi}
    finally:
        dist.destroy_process_group()


def _estimated_peak(model) -> int:
    """The cost model's predicted forward + backward peak of the compiled graphs (every frame
    in the order it ran), what ``MemoryTracker.peak`` measures."""
    from zerofx.passes.cost_model import predict_step_peak
    from zerofx.runtime.params import runtime_of

    compiled = runtime_of(model).compiled
    return predict_step_peak(compiled.memory_estimates, compiled.frames())


def check_plotting() -> None:
    """``--plot`` needs matplotlib (the plots extra): fail before any rank starts."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("zerofx demo --plot draws with matplotlib: pip install 'zerofx[plots]'") from None


def write_plots(cfg: DemoConfig, series: dict) -> list[str]:
    """loss.png (loss per step), memory.png (per step: the measured peak of what the compiled
    graphs allocate, against the cost model's estimate) and demo.json (the numbers) in
    ``cfg.plot_dir``; returns the lines saying where they are."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(cfg.plot_dir, exist_ok=True)
    steps = list(range(1, len(series["loss"]) + 1))
    title = f"zerofx demo: GPT, ZeRO-{cfg.stage}, {cfg.world_size} ranks"
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, series["loss"], marker="o", markersize=3)
    ax.set(xlabel="step", ylabel="loss (mean over ranks)", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    loss_png = os.path.join(cfg.plot_dir, "loss.png")
    fig.savefig(loss_png, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(
        steps, [b / 2**20 for b in series["measured_peak"]], marker="o", markersize=3, label="measured (MemoryTracker)"
    )
    ax.axhline(series["estimated_peak"] / 2**20, color="C1", linestyle="--", label="estimated (cost model)")
    ax.set(xlabel="step", ylabel="forward + backward peak, MiB (rank 0)", title=title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    memory_png = os.path.join(cfg.plot_dir, "memory.png")
    fig.savefig(memory_png, dpi=120)
    plt.close(fig)

    data_json = os.path.join(cfg.plot_dir, "demo.json")
    with open(data_json, "w") as f:
        json.dump({"config": cfg.__dict__, **series}, f, indent=2)
    last = series["measured_peak"][-1]
    return [
        f"plots: {loss_png}, {memory_png} (numbers: {data_json}); peak of the last step "
        f"{_mb(last)} measured, {_mb(series['estimated_peak'])} estimated"
    ]


def _demo_model(cfg: DemoConfig):
    from zerofx.models import GPT, GPTConfig

    return GPT(
        GPTConfig(vocab_size=cfg.vocab, seq_len=cfg.seq_len, n_layer=cfg.layers, n_head=cfg.heads, d_model=cfg.d_model)
    )


def run_demo(cfg: DemoConfig) -> dict:
    """Start ``cfg.world_size`` local ranks with torchrun's launcher and train; returns rank 0's stats.
    With ``cfg.plan``, plan the same run first (``zerofx.plan``, in this process, before any rank
    starts) and print the prediction, then the measurement beside it."""
    import functools

    from zerofx.launch import local_ranks

    predicted = None
    if cfg.plan:
        import zerofx

        options = {"stage": cfg.stage, "param_dtype": cfg.param_dtype} if cfg.param_dtype else {"stage": cfg.stage}
        predicted = zerofx.plan(
            functools.partial(_demo_model, cfg), (cfg.world_size,), batch=cfg.batch, seq=cfg.seq_len,
            device="cpu", backend="gloo", **options,
        )  # fmt: skip
        print(predicted.report(), flush=True)
    stats = local_ranks(_rank_main, cfg.world_size, cfg, name="zerofx-demo")[0]
    if predicted is not None:
        comm = sum(b for dims in predicted.comm_bytes_per_step.values() for b in dims.values())
        measured_comm = sum(stats["comm"].values())
        print(
            f"plan vs measured (rank 0): model state {_mb(predicted.per_rank.model_state_bytes)} / "
            f"{_mb(stats['state']['total'])}; collective bytes per step {_mb(comm)} / {_mb(measured_comm)}"
        )
        stats["plan"] = predicted.to_json()
    return stats
