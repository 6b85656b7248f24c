"""Rank-side half of tests/test_optim.py: optimizers stepping zerofx's shards locally (the
default) against the same optimizers stepping the DTensors, on sharded eager models (the step
does not depend on compilation)."""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import zerofx
from tests.models import GPT_CFG
from tests.multirank import attempt
from zerofx.models import GPT, random_batch
from zerofx.runtime.local_step import steps_locally

STEPS = 3

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adam_amsgrad_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.1, foreach=True),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
}


class MyAdamW(torch.optim.AdamW):
    """A subclass: zerofx cannot know it is still elementwise, so it keeps the DTensor path."""


def _state(opt) -> dict:
    """Optimizer state by parameter index: (kind, local values) per entry."""
    sd = opt.state_dict()["state"]
    return {
        i: {k: (type(v).__name__, v.to_local() if isinstance(v, DTensor) else v) for k, v in entry.items()}
        for i, entry in sd.items()
    }


def _train(mesh, rank, make_opt, local: bool, stage: int = 3, steps: int = STEPS, hook=None, schedule=False):
    """``steps`` steps; with ``schedule`` two LR schedulers wrap ``step``, one built before the
    first step (so before zerofx adopts the optimizer), one after it."""
    torch.manual_seed(0)
    model = zerofx.shard(GPT(GPT_CFG), mesh, stage=stage, local_optimizer_step=local)
    opt = make_opt(model.parameters())
    seen: list[set[str]] = []
    opt.register_step_pre_hook(
        lambda o, a, k: seen.append({type(p).__name__ for g in o.param_groups for p in g["params"]})
    )
    if hook is not None:
        opt.register_step_pre_hook(hook)
    scheds = [torch.optim.lr_scheduler.MultiplicativeLR(opt, lambda epoch: 0.9)] if schedule else []
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for i in range(steps):
        x, y = random_batch(GPT_CFG, 2, gen)
        loss = model(x, y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        for sched in scheds:
            sched.step()
        if schedule and i == 0:
            scheds.append(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    x, y = random_batch(GPT_CFG, 2, gen)
    losses.append(model(x, y).item())  # reads stage 2's whole copies: refreshed after the last step
    return model, opt, losses, seen


def _compare(mesh, rank, make_opt, stage: int = 3, schedule: bool = False) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a_model, a_opt, a_losses, a_seen = _train(mesh, rank, make_opt, local=False, stage=stage, schedule=schedule)
        b_model, b_opt, b_losses, b_seen = _train(mesh, rank, make_opt, local=True, stage=stage, schedule=schedule)
    sa, sb = _state(a_opt), _state(b_opt)
    return {
        "params_equal": all(
            torch.equal(p.to_local(), q.to_local()) for p, q in zip(a_model.parameters(), b_model.parameters())
        ),
        "state_equal": sa.keys() == sb.keys()
        and all(
            sa[i].keys() == sb[i].keys()
            and all(sa[i][k][0] == sb[i][k][0] and torch.equal(sa[i][k][1], sb[i][k][1]) for k in sa[i])
            for i in sa
        ),
        "state_kinds": sorted({kind for entry in sb.values() for kind, _ in entry.values()}),
        "losses": (a_losses, b_losses),
        "seen_dtensor_path": a_seen,
        "seen_local_path": b_seen,
        "steps_locally": (steps_locally(a_opt), steps_locally(b_opt)),
        "lrs": (a_opt.param_groups[0]["lr"], b_opt.param_groups[0]["lr"]),
        "scheduler_warnings": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)],
    }


def _failing_step(mesh, rank) -> dict:
    """A step that raises half-way (a user pre-hook, run on the local tensors) leaves the
    optimizer holding the DTensors and their state; training then goes on with parity."""
    calls = {"n": 0}

    def boom(opt, args, kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")

    torch.manual_seed(0)
    model = zerofx.shard(GPT(GPT_CFG), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = opt.register_step_pre_hook(boom)
    gen = torch.Generator().manual_seed(100 + rank)
    raised = None
    for _ in range(2):
        x, y = random_batch(GPT_CFG, 2, gen)
        model(x, y).backward()
        try:
            opt.step()
            opt.zero_grad()
        except RuntimeError as e:  # its gradients stay for the next step
            raised = str(e)
    handle.remove()
    params_back = [p is q for p, q in zip(opt.param_groups[0]["params"], model.parameters())]
    kinds = sorted({type(v).__name__ for entry in opt.state.values() for v in entry.values()})
    grads_on_locals = [p._local_tensor.grad is not None for p in model.parameters()]
    opt.step()  # the gradients of the failed step are still there: this step applies them
    opt.zero_grad()
    x, y = random_batch(GPT_CFG, 2, gen)
    loss = model(x, y).item()
    # the same three updates without a failure, on the DTensor path
    _, _, ref_losses, _ = _train(mesh, rank, lambda ps: torch.optim.AdamW(ps, lr=1e-2), local=False, steps=2)
    return {
        "raised": raised,
        "params_back": all(params_back),
        "state_kinds": kinds,
        "grads_on_locals": any(grads_on_locals),
        "loss": loss,
        "ref_loss": ref_losses[-1],
    }


# optimizers zerofx steps over whole tensors (zerofx/runtime/whole_step.py), and Rprop and fused
# SGD / Adagrad, whose every step runs on local shards: each against the same optimizer stepping an unsharded copy of
# the model on the same (gathered) gradients
WHOLE = {
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2, weight_decay=0.1),
    "hf_adafactor": lambda ps: _hf_adafactor(ps),
    "muon": lambda ps: torch.optim.Muon([p for p in ps if p.dim() == 2], lr=2e-2),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    # fused kernels without a DTensor strategy: every step on local shards, as Rprop's
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    "adagrad_fused": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True),
}


def _hf_adafactor(ps):
    from transformers.optimization import Adafactor  # the test env has the hf extra

    return Adafactor(ps, lr=None, beta1=0.9)  # relative step, scaled by each parameter's RMS, with momentum


def global_value(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def state_mismatches(opt, ref_opt) -> list:
    """The state entries of ``opt`` (sharded; gathered whole) that differ from ``ref_opt``'s at
    all, by (parameter index, key), and the parameters only one of them holds state for."""
    sd, ref_sd = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    return sorted(sd.keys() ^ ref_sd.keys()) + [  # in one order on every rank: each gather of a DTensor is a collective
        (j, k)
        for j in sorted(sd.keys() & ref_sd.keys())
        for k in sorted(sd[j].keys() | ref_sd[j].keys())
        if k not in sd[j]
        or k not in ref_sd[j]
        or not torch.equal(torch.as_tensor(global_value(sd[j][k])), torch.as_tensor(ref_sd[j][k]))
    ]


# zerofx.offload_optimizer's host-memory cap in the offloaded scenarios: windows of 16 KiB (cap / 8),
# a few parameters of the test GPT each, so that a step runs several windows
OFFLOAD_CAP = 128 << 10


def _against_unsharded(
    mesh, rank, make_opt, stage: int = 3, path: str | None = None, cfg=GPT_CFG, offload: str | None = None
) -> dict:
    """``STEPS`` steps of a sharded GPT and, beside it, of an unsharded copy given the sharded
    model's whole gradients: the parameters and the optimizer state (gathered) after each step,
    bit for bit. One step passes a closure. A pre-hook registered after the first step records
    whether the parameters had changed when it ran. With ``path``, the sharded run saves a
    checkpoint before its last step and a fresh model and optimizer loaded from it take that step
    too. ``cfg``: the GPT's shapes (a vocabulary of odd size gives shards of unequal rows).
    ``offload``: a folder for the model's state on disk (``offload_optimizer='disk'``,
    ``zerofx.offload_optimizer``: the step in windows of ``OFFLOAD_CAP / 8`` bytes)."""
    from zerofx.runtime.offload_store import place_model_state, state_store

    torch.manual_seed(0)
    ref = GPT(cfg)
    torch.manual_seed(0)
    model = zerofx.shard(GPT(cfg), mesh, stage=stage)
    if offload is not None:
        place_model_state(
            model, zerofx.Options(offload_optimizer="disk", offload_dir=offload, host_memory_cap=OFFLOAD_CAP)
        )
    opt, ref_opt = make_opt(list(model.parameters())), make_opt(list(ref.parameters()))
    windows_run: list[int] = []  # the windows each offloaded step ran
    if offload is not None:
        from zerofx.runtime.params import optimizer_state

        opt = zerofx.offload_optimizer(opt)
        held = optimizer_state(opt)
        before_window = held.windows.before

        def counting(window, following):
            windows_run[-1] += 1
            before_window(window, following)

        held.windows = dataclasses.replace(held.windows, before=counting)
        opt.register_step_pre_hook(lambda *_: windows_run.append(0))
    gen = torch.Generator().manual_seed(100 + rank)
    hook_saw_changed: list[bool] = []
    mismatched_params, mismatched_state, closure_losses = [], [], []
    resumed = None
    for i in range(STEPS):
        x, y = random_batch(cfg, 2, gen)
        before = [p.to_local().clone() for p in model.parameters()]

        def closure():
            loss = model(x, y)
            loss.backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                q.grad = None if p.grad is None else global_value(p.grad).clone()
            return loss

        if path is not None and i == STEPS - 1:
            zerofx.checkpoint.save(path, model, opt)
        if i == 1:
            got = opt.step(closure)
            closure_losses.append(got is not None and got.item())
        else:
            closure()
            grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
            opt.step()
        ref_opt.step()
        if i == 0:
            opt.register_step_pre_hook(
                lambda o, a, k: hook_saw_changed.append(
                    any(not torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before))
                )
            )
        if path is not None and i == STEPS - 1:  # the last step again, from the checkpoint
            torch.manual_seed(1)
            again = zerofx.shard(GPT(cfg), mesh, stage=stage)
            again_opt = make_opt(list(again.parameters()))
            zerofx.checkpoint.load(path, again, again_opt)
            for p, g in zip(again.parameters(), grads):
                p.grad = g
            again_opt.step()
            resumed = [
                n
                for (n, p), q in zip(again.named_parameters(), model.parameters())
                if not torch.equal(p.to_local(), q.to_local())
            ]
        opt.zero_grad()
        ref_opt.zero_grad()
        mismatched_params.append(
            [n for (n, p), q in zip(model.named_parameters(), ref.parameters()) if not torch.equal(global_value(p), q)]
        )
        mismatched_state.append(state_mismatches(opt, ref_opt))
    x, y = random_batch(cfg, 2, gen)
    with torch.no_grad():
        last = (model(x, y).item(), ref(x, y).item())  # stages 1 and 2 read their refreshed whole copies
    layout = sorted({(k, p.dim(), type(v).__name__) for p, entry in opt.state.items() for k, v in entry.items()})
    # where each state entry with elements lives: (key, kind, in a memory-mapped file?)
    store = state_store(next(model.parameters()))
    placed = sorted(
        {
            (k, type(v).__name__, store is not None and store[1] is not None and v in store[1])
            for entry in opt.state.values()
            for k, v in entry.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        }
    )
    return {
        "windows_run": windows_run,
        "placed": placed,
        "params_placed": sorted(
            {store is not None and store[1] is not None and p in store[1] for p in model.parameters()}
        ),
        "mismatched_params": mismatched_params,
        "mismatched_state": mismatched_state,
        "moved": any(not torch.equal(global_value(p), q) for p, q in zip(model.parameters(), GPT(cfg).parameters())),
        "closure_losses": closure_losses,
        "hook_saw_changed": hook_saw_changed,
        "last_losses": last,
        "state_layout": layout,
        "resumed": resumed,
    }


def alone(run, nbytes: int = 1 << 10):
    """``run()`` with every tensor of at least ``nbytes`` in an exchange of its own
    (zerofx/runtime/whole_step.py, ``ALONE_BYTES``: the test models' are smaller than the default)."""
    import zerofx.runtime.whole_step as whole_step

    before, whole_step.ALONE_BYTES = whole_step.ALONE_BYTES, nbytes
    try:
        return run()
    finally:
        whole_step.ALONE_BYTES = before


class _Flaky(torch.optim.Adafactor):
    """Adafactor whose step raises on rank ``fail_on`` (a subclass calling its parent's step)."""

    fail_on: int | None = None

    def step(self, closure=None):
        import torch.distributed as dist

        if self.fail_on == dist.get_rank():
            raise RuntimeError("boom")
        return super().step(closure)


class _Counting(torch.optim.Adafactor):
    """Adafactor counting its steps on itself and in each param group (a subclass's own state)."""

    runs: list = []  # one entry per run of this step function, on any object (a class attribute)

    def step(self, closure=None):
        type(self).runs.append(len(self.param_groups[0]["params"]))
        self.calls = getattr(self, "calls", 0) + 1
        for g in self.param_groups:
            g["steps_seen"] = g.get("steps_seen", 0) + 1
        return super().step(closure)


def _counting_whole_step(mesh, rank) -> dict:
    """Three whole-tensor steps in windows of a few parameters each: what the step sets on the
    optimizer and in its groups is set once per step, not once per window."""
    import zerofx.runtime.whole_step as whole_step

    torch.manual_seed(0)
    model = zerofx.shard(GPT(GPT_CFG), mesh)
    opt = _Counting(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    window, whole_step.WINDOW_BYTES = whole_step.WINDOW_BYTES, 16 << 10
    _Counting.runs.clear()
    try:
        for _ in range(3):
            x, y = random_batch(GPT_CFG, 2, gen)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    finally:
        whole_step.WINDOW_BYTES = window
    return {
        "calls": getattr(opt, "calls", None),
        "steps_seen": [g.get("steps_seen") for g in opt.param_groups],
        "windows": sum(1 for n in _Counting.runs if n) / 3,  # runs on parameters (not torch's empty one) per step
    }


def _failing_whole_step(mesh, rank) -> dict:
    """A whole-tensor step that raises on one rank only (each rank steps other parameters):
    every rank raises, no shard or state changes, and the next step runs on every rank."""
    torch.manual_seed(0)
    model = zerofx.shard(GPT(GPT_CFG), mesh)
    opt = _Flaky(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(type(o).__name__))
    for i in range(2):
        x, y = random_batch(GPT_CFG, 2, gen)
        model(x, y).backward()
        if i == 0:
            opt.step()
            opt.zero_grad()
    params = [p.to_local().clone() for p in model.parameters()]
    state = [
        (k, (v.to_local() if isinstance(v, DTensor) else v).clone()) for e in opt.state.values() for k, v in e.items()
    ]
    opt.fail_on = 1
    try:
        opt.step()
        raised = None
    except Exception as e:
        raised = (type(e).__name__, str(e))
    unchanged = all(torch.equal(p.to_local(), q) for p, q in zip(model.parameters(), params)) and all(
        k == k2 and torch.equal((v.to_local() if isinstance(v, DTensor) else v), v2)
        for (k2, v2), (k, v) in zip(state, [(k, v) for e in opt.state.values() for k, v in e.items()])
    )
    opt.fail_on = None
    opt.step()
    moved = any(not torch.equal(p.to_local(), q) for p, q in zip(model.parameters(), params))
    return {"raised": raised, "unchanged": unchanged, "moved": moved, "hooks_seen": seen}


def _lbfgs(mesh, rank, stage: int, poke: bool = False) -> dict:
    """Two LBFGS steps (a closure evaluated several times per step, between updates) on a
    sharded GPT; the closure averages the loss over the ranks, so that every rank's line search
    decides alike. Stages 1-2 read whole copies the step's own updates made stale. ``poke``:
    write one shard in place on this rank alone first, changing no value (its copy is stale
    here only)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = zerofx.shard(GPT(GPT_CFG), mesh, stage=stage)
    if poke:
        with torch.no_grad():
            next(iter(model.parameters())).to_local().mul_(1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=3)
    gen = torch.Generator().manual_seed(100 + rank)
    calls = []
    for _ in range(2):
        x, y = random_batch(GPT_CFG, 2, gen)

        def closure():
            opt.zero_grad()
            loss = model(x, y)
            loss.backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            calls.append(mean.item())
            return mean

        opt.step(closure)
    return {"params": [p.to_local().detach().clone() for p in model.parameters()], "calls": calls}


def _lbfgs_stages(mesh, rank) -> dict:
    a, b, c = _lbfgs(mesh, rank, 3), _lbfgs(mesh, rank, 2), _lbfgs(mesh, rank, 2, poke=rank == 1)
    return {
        "calls": (a["calls"], b["calls"], c["calls"]),
        "params_equal": all(torch.equal(p, q) for p, q in zip(a["params"], b["params"])),
        "poked_params_equal": all(torch.equal(p, q) for p, q in zip(a["params"], c["params"])),
    }


def scenarios(rank: int, world: int, path: str | None = None) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    for name, make in WHOLE.items():
        attempt(out, f"whole_{name}", lambda make=make: _against_unsharded(mesh, rank, make))
    attempt(out, "whole_adafactor_stage2", lambda: _against_unsharded(mesh, rank, WHOLE["adafactor"], stage=2))
    attempt(out, "lbfgs", lambda: _lbfgs_stages(mesh, rank))
    attempt(out, "whole_failing_step", lambda: _failing_whole_step(mesh, rank))
    attempt(out, "whole_counting_step", lambda: _counting_whole_step(mesh, rank))
    odd = dataclasses.replace(GPT_CFG, vocab_size=GPT_CFG.vocab_size + 1)
    attempt(out, "whole_muon_uneven", lambda: _against_unsharded(mesh, rank, WHOLE["muon"], cfg=odd))
    for name in ("adafactor", "hf_adafactor", "muon"):  # most tensors in an exchange of their own
        attempt(
            out,
            f"whole_{name}_alone",
            lambda name=name: alone(lambda: _against_unsharded(mesh, rank, WHOLE[name], cfg=odd)),
        )
    for name in ("adafactor", "hf_adafactor", "muon"):  # state on disk, stepped in windows
        attempt(
            out,
            f"whole_{name}_offload",
            lambda name=name: _against_unsharded(mesh, rank, WHOLE[name], offload=f"{path}/offload_{name}_{rank}"),
        )
    for name in ("hf_adafactor", "muon"):
        attempt(
            out,
            f"whole_{name}_resume",
            lambda name=name: _against_unsharded(mesh, rank, WHOLE[name], path=f"{path}/{name}"),
        )
    for name, make in OPTIMIZERS.items():
        attempt(out, name, lambda make=make: _compare(mesh, rank, make))
    attempt(out, "stage2_adamw", lambda: _compare(mesh, rank, OPTIMIZERS["adamw"], stage=2))
    attempt(out, "lr_schedulers", lambda: _compare(mesh, rank, OPTIMIZERS["adamw"], schedule=True))
    attempt(out, "subclass", lambda: _compare(mesh, rank, lambda ps: MyAdamW(ps, lr=1e-2)))
    attempt(out, "failing_step", lambda: _failing_step(mesh, rank))
    attempt(out, "lbfgs_uneven", lambda: _lbfgs_uneven(mesh, rank))
    return out


def _lbfgs_uneven(mesh, rank) -> dict:
    """LBFGS over a layer with an odd number of rows, which DTensor cannot flatten."""
    from torch import nn

    out = {}
    for key, features, layers in (
        ("lbfgs", 4, (nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))),  # a [3, 4] weight
        ("one_dim", 3, (nn.LayerNorm(3), nn.Linear(3, 4))),  # [3] weight and bias; a [4, 3] weight
    ):
        torch.manual_seed(0)
        model = zerofx.compile(nn.Sequential(*layers), mesh)
        x = torch.randn(2, features, generator=torch.Generator().manual_seed(rank))
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=2)
        try:
            opt.step(lambda: model(x).pow(2).sum())
            out[key] = "stepped"
        except zerofx.ZeroFXError as e:
            out[key] = str(e)
    return out


def _few_rows(mesh, rank, by_rows: bool = False) -> dict:
    """transformers' Adafactor on a layer with fewer output rows than ranks (2 rows over 4)
    against the unsharded step on the same gradients. zerofx splits its weight along dim 1
    (zerofx/ir/layout.py, NOTE: the sharded dim); ``by_rows`` (``shard_placement_fn``) keeps
    dim 0: one padded row per rank, some ranks hold none. Either way the whole tensors the owner
    steps must be laid out as the unsharded ones (contiguous), or its norms round differently."""
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    torch.manual_seed(0)
    model = zerofx.shard(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)),
        mesh,
        persistence_threshold=0,
        shard_placement_fn=(lambda p: Shard(0)) if by_rows else None,
    )
    opt, ref_opt = _hf_adafactor(list(model.parameters())), _hf_adafactor(list(ref.parameters()))
    gen = torch.Generator().manual_seed(100 + rank)
    mismatched = []
    for _ in range(3):
        x = torch.randn(4, 8, generator=gen)
        model(x).square().mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = global_value(p.grad).clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        sd, ref_sd = opt.state_dict()["state"], ref_opt.state_dict()["state"]
        mismatched.append(
            [n for (n, p), q in zip(model.named_parameters(), ref.parameters()) if not torch.equal(global_value(p), q)]
            + [
                (j, k)
                for j in sorted(ref_sd)
                for k in sorted(ref_sd[j])
                if not torch.equal(torch.as_tensor(global_value(sd[j][k])), torch.as_tensor(ref_sd[j][k]))
            ]
        )
    return {"mismatched": mismatched, "local_shapes": [list(p.to_local().shape) for p in model.parameters()]}


def _exact_splits(mesh, rank) -> dict:
    """``to_owners`` / ``from_owners`` over 4 ranks with tensors of fewer rows than ranks, or not
    divisible by them (eager_buckets.py, NOTE: exact splits): rank 0 owns a (2, 1000) tensor
    alone, rank 1 a (3, 10) and a (5, 7) one. What each owner gets: the whole tensors, and for
    the lone one the received buffer holds exactly its bytes (no padding rows); back, every rank
    gets its rows of each (plus 1) and rank 0's small tensor whole."""
    from zerofx.ir.layout import local_rows, row_offset
    from zerofx.runtime.eager_buckets import from_owners, to_owners
    from zerofx.runtime.params import GroupInfo

    n = mesh.size()
    group = GroupInfo(n, mesh.get_group().group_name, rank)
    wholes = [torch.arange(2 * 1000.0).view(2, 1000), torch.arange(30.0).view(3, 10), -torch.arange(35.0).view(5, 7)]

    def mine(t):  # this rank's rows, as a Shard(0) DTensor holds them
        first = row_offset(t.shape[0], n, rank)
        return t[first : first + local_rows(t.shape[0], n, rank)].clone()

    owned = [[wholes[0]], [wholes[1], wholes[2]], [], []]
    got = to_owners([[(mine(t), t.shape[0]) for t in ts] for ts in owned], group)
    small = torch.tensor([7.0, 8.0])
    sent = [t + 1 for t in got] + ([small] if rank == 0 else [])
    expect = [[(t.shape, True) for t in ts] for ts in owned]
    expect[0].append((small.shape, False))
    back = from_owners(sent, expect, torch.float32, torch.device("cpu"), group)
    return {
        "got_equal": [torch.equal(a, b) for a, b in zip(got, owned[rank])],
        "got_bytes": [a.untyped_storage().nbytes() for a in got],
        "back_equal": [torch.equal(a, mine(t + 1)) for a, t in zip(back[0][:1] + back[1], wholes)],
        "small_back": back[0][-1].tolist(),
    }


def hybrid_scenarios(rank: int, world: int) -> dict:
    """The whole-tensor steps on a 2x2 hybrid mesh (replicate x shard): each parameter gathered
    over its shard dimension only."""
    mesh = init_device_mesh("cpu", (2, world // 2))
    out: dict = {}
    for name in ("adafactor", "muon"):
        attempt(out, f"whole_{name}", lambda name=name: _against_unsharded(mesh, rank, WHOLE[name]))
    flat = init_device_mesh("cpu", (world,))
    attempt(out, "few_rows", lambda: _few_rows(flat, rank))
    attempt(out, "few_rows_by_rows", lambda: _few_rows(flat, rank, by_rows=True))
    attempt(out, "exact_splits", lambda: _exact_splits(flat, rank))
    return out
