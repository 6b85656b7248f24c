"""Rank-side half of the memory tests: every checkpoint/offload policy trained against a reference.

``train_policies`` builds each model once per rank, keeps an unsharded eager reference (trained
once, on the whole global batch), then trains one zerofx copy per policy on this rank's slice,
each beside its own zerofx.testing.ShardedReference (bitwise parity: its findings are the
policy's ``failures``). It returns plain data: per policy the losses, the failures, the worst
parameter error against the whole-batch reference, what the plan predicted and what
``zerofx.MemoryTracker`` measured on the last step.

``train_on_disk`` is the disk-tier scenario: a GPT whose fp32 master shards + Adam state exceed
a host-memory cap trains with that state in memory-mapped files; resident memory is measured
with the kernel's high-water mark (see its docstring).
"""

from __future__ import annotations

import copy
import gc
import os
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import zerofx
from tests.models import CASES
from tests.multirank import mean_over_ranks
from tests.parity import reference_shard
from zerofx.backend import make_backend
from zerofx.dump import Recorder
from zerofx.measure.allocations import peak_rss_bytes, reset_peak_rss, rss_bytes
from zerofx.models import GPT, GPTConfig, random_batch
from zerofx.testing import ShardedReference, exact_divergence

STEPS = 3
PER_RANK = 2

# policy name -> options (per model where module names differ); "{dir}" is a per-run folder.
# Every policy and budget appears; orthogonal ones share a run to keep the matrix affordable
# (optimizer offload does not touch the activation plan; offload tiers ride on budgets).
POLICIES: dict[str, dict] = {
    "budget_100+optimizer_disk": {
        "activation_budget": 1.0,
        "offload_optimizer": "disk",
        "offload_dir": "{dir}",
        "host_memory_cap": 64 * 1024,
    },
    # stage 1: the parameter shards in files, the whole copies in memory (not views of each other)
    "stage1+optimizer_disk": {
        "stage": 1,
        "activation_budget": 1.0,
        "offload_optimizer": "disk",
        "offload_dir": "{dir}",
    },
    "budget_50+disk": {"activation_budget": 0.5, "offload_activations": "disk", "offload_dir": "{dir}"},
    "budget_25": {"activation_budget": 0.25},
    "full": {"checkpoint": "full"},
    "save_ops": {"checkpoint_save_ops": ("mm", "addmm")},
    "modules+host_50": {
        "checkpoint_modules": {"gpt": ("blocks.1",), "graph_break": ("b",)},
        "offload_activations": "host",
        "activation_budget": 0.5,
    },
}
MODELS = ("gpt", "graph_break")


def _options(policy: str, model: str, folder: str) -> dict:
    out = {}
    for key, value in POLICIES[policy].items():
        if isinstance(value, dict):
            value = value[model]
        if value == "{dir}":
            value = folder
        out[key] = value
    return out


def _reference(model_name: str, world: int) -> tuple[torch.nn.Module, list[float], list]:
    """Train the unsharded reference once; return its initial copy, losses and final params."""
    case = CASES[model_name]
    torch.manual_seed(0)
    model = case.build()
    initial = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=case.lr)
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(STEPS):
        x, y = case.batch(PER_RANK * world, gen)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return initial, losses, [p.detach().clone() for p in model.parameters()]


def _train_policy(model_name: str, policy: str, rank: int, world: int, mesh, initial, folder: str) -> dict:
    case = CASES[model_name]
    model = copy.deepcopy(initial)
    options = zerofx.Options(**_options(policy, model_name, folder))
    recorder = Recorder()
    zerofx.shard(model, mesh, options)
    from zerofx.runtime.offload_store import place_model_state

    place_model_state(model, options)
    model.compile(backend=make_backend(options, recorder))
    opt = torch.optim.AdamW(model.parameters(), lr=case.lr)
    if options.offload_optimizer != "none":
        opt = zerofx.offload_optimizer(opt)
    oracle = ShardedReference(copy.deepcopy(initial), model, lambda ps: torch.optim.AdamW(ps, lr=case.lr))
    gen = torch.Generator().manual_seed(1234)
    losses, memory, failures = [], {}, []
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for step in range(STEPS):
        x, y = case.batch(PER_RANK * world, gen)
        with zerofx.MemoryTracker() as mem:  # measured on every step; the last one is returned
            loss = model(x[mine], y[mine])
            loss.backward()
        ref_loss = oracle.backward(lambda m: m(x[mine], y[mine]))
        found = [d for d in [exact_divergence(step, "loss", "loss", loss.detach(), ref_loss)] if d]
        oracle.reduce_gradients()
        found += oracle.check_gradients(model, step)
        opt.step()
        opt.zero_grad()
        oracle.step()
        found += oracle.check_parameters(model, step)
        failures += map(str, found)
        losses.append(mean_over_ranks(loss))
        memory = mem.summary()
    plans = [dict(r) for r in _plans(recorder)]
    params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    on_disk = 0
    if options.offload_optimizer == "disk":
        from zerofx.runtime.offload_store import state_store

        store = state_store(next(model.parameters()))[1]
        on_disk = sum(1 for p in model.parameters() if p in store)
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in params],
        "memory": memory,
        "plans": plans,
        "summary": recorder.summary(),
        "params_on_disk": on_disk,
        "failures": failures,
        "bounded": sorted(oracle.bounded),
    }


def _plans(recorder: Recorder) -> list[dict]:
    """The activation-plan numbers each joint graph's checkpoint pass reported."""
    out = []
    for record in recorder.records:
        for line in record.messages:
            if line.startswith("activation plan:"):
                out.append({"graph": record.graph_id, "line": line})
    return out


def train_policies(rank: int, world: int, folder: str) -> dict:
    """Every (model, policy) pair on this rank; errors are returned, not raised, per pair."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    for model_name in MODELS:
        initial, ref_losses, ref_params = _reference(model_name, world)
        for policy in POLICIES:
            key = f"{model_name}/{policy}"
            try:
                result = _train_policy(
                    model_name, policy, rank, world, mesh, initial, os.path.join(folder, f"rank{rank}", policy)
                )
                ref_local = [reference_shard(q, rank, world) if world > 1 else q for q in ref_params]
                result["param_error"] = max((p - q).abs().max().item() for p, q in zip(result.pop("params"), ref_local))
                result["ref_losses"] = ref_losses
                out[key] = result
            except Exception:
                out[key] = {"error": traceback.format_exc()}
            torch._dynamo.reset()
    if world > 1:
        from zerofx.runtime.offload_store import place_model_state

        model = zerofx.shard(CASES["gpt"].build(), mesh, stage=1)
        options = zerofx.Options(stage=1, offload_optimizer="disk", offload_dir=os.path.join(folder, f"rank{rank}"))
        try:
            place_model_state(model, options)
            out["stage1_disk_after_plain_shard"] = {"message": ""}
        except zerofx.ZeroFXError as e:
            out["stage1_disk_after_plain_shard"] = {"message": str(e)}
    return out


# -- the disk tier -------------------------------------------------------------------------------

DISK_CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=8, d_model=512)


def train_on_disk(rank: int, world: int, folder: str, cap_fraction: float, steps: int) -> dict:
    """Train the same GPT twice on this rank: model state on disk under a host-memory cap, then
    in memory (for parity and for contrast).

    How resident memory is measured: after compiling (one forward+backward, gradients dropped),
    the process's RSS is the baseline and the kernel's high-water mark is reset (VmHWM, via
    /proc/self/clear_refs); the training steps' peak resident memory above the baseline is
    VmHWM - baseline. That counts everything the steps bring into memory: gradients,
    activations, optimizer state (created during the first measured step), parameter pages
    read from the files, and allocator slack. The test runs the ranks with glibc's
    MALLOC_MMAP_THRESHOLD_ lowered, so freed tensor memory goes back to the OS instead of
    staying in the heap, where it would inflate the high-water mark of later phases."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for tier in ("disk", "none"):
        torch.manual_seed(0)
        model = GPT(DISK_CFG)
        zerofx.shard(model, mesh)
        local_param_bytes = sum(p.to_local().numel() * 4 if world > 1 else p.numel() * 4 for p in model.parameters())
        master_and_adam = 3 * local_param_bytes
        cap = int(cap_fraction * master_and_adam)
        options = {"offload_optimizer": tier, "offload_dir": folder, "host_memory_cap": cap} if tier != "none" else {}
        zerofx.compile(model, mesh, **options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if tier != "none":
            opt = zerofx.offload_optimizer(opt)
        gen = torch.Generator().manual_seed(5)
        x, y = random_batch(DISK_CFG, PER_RANK * world, gen)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        model(x[mine], y[mine]).backward()  # compile; no step, so no optimizer state yet
        for p in model.parameters():
            p.grad = None
        if tier != "none":
            from zerofx.runtime.offload_store import state_store

            store = state_store(next(model.parameters()))[1]
            for p in model.parameters():
                store.page_out(p)
        gc.collect()
        dist.barrier()
        baseline = rss_bytes()
        reset_peak_rss()
        losses = []
        for _ in range(steps):
            x, y = random_batch(DISK_CFG, PER_RANK * world, gen)
            loss = model(x[mine], y[mine])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        peak = peak_rss_bytes() - baseline
        state_on_disk = 0
        if tier != "none":
            state_on_disk = sum(
                1 for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0 and v in store
            )
        out[tier] = {
            "losses": losses,
            "peak_rss_delta": peak,
            "cap": cap,
            "master_and_adam": master_and_adam,
            "local_param_bytes": local_param_bytes,
            "state_tensors_on_disk": state_on_disk,
            "params": [(p.to_local() if world > 1 else p).detach().clone() for p in model.parameters()],
        }
        del model, opt
        gc.collect()
        torch._dynamo.reset()
    disk, ram = out["disk"], out["none"]
    out["param_error"] = max((p - q).abs().max().item() for p, q in zip(disk.pop("params"), ram.pop("params")))
    return out


# -- step hooks around the disk tier's windows ---------------------------------------------------

HOOKS_CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16)


def train_with_step_hooks(mesh, folder: str, disk: bool, scheduler_first: bool, steps: int, events: list) -> dict:
    """Train a small GPT on this rank with the optimizer's own and torch's global step pre- and
    post-hooks recording, into ``events``, each call and how many parameters its groups hold;
    ``disk``: the optimizer state in files under a cap that splits each step into windows (the
    caller records the windows into ``events`` too). An LR scheduler halves the rate every step,
    built before ``zerofx.offload_optimizer`` or after it."""
    import warnings

    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(HOOKS_CFG)
    options = {"offload_optimizer": "disk", "offload_dir": folder, "host_memory_cap": 4096} if disk else {}
    zerofx.compile(model, mesh, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler_first else None
    if disk:
        opt = zerofx.offload_optimizer(opt)
    if sched is None:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def record(kind):
        def hook(o, args, kwargs):
            if o is opt:
                events.append((kind, sum(len(g["params"]) for g in o.param_groups)))

        return hook

    opt.register_step_pre_hook(record("pre"))
    opt.register_step_post_hook(record("post"))
    handles = [
        register_optimizer_step_pre_hook(record("global pre")),
        register_optimizer_step_post_hook(record("global post")),
    ]
    gen = torch.Generator().manual_seed(5)
    losses, lrs = [], []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                x, y = random_batch(HOOKS_CFG, PER_RANK, gen)
                loss = model(x, y)
                loss.backward()
                events.append(("step", None))
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                losses.append(loss.item())
                lrs.append(opt.param_groups[0]["lr"])
    finally:
        for handle in handles:
            handle.remove()
    return {
        "losses": losses,
        "lrs": lrs,
        "n_params": len(list(model.parameters())),
        "params": [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()],
        "scheduler_warnings": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)],
    }
