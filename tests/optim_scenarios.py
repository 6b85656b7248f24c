"""Rank-side half of tests/test_optim.py: optimizers stepping zerofx's shards locally (the
default) against the same optimizers stepping the DTensors, on sharded eager models (the step
does not depend on compilation)."""

from __future__ import annotations

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


def scenarios(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    for name, make in OPTIMIZERS.items():
        attempt(out, name, lambda make=make: _compare(mesh, rank, make))
    attempt(out, "stage2_adamw", lambda: _compare(mesh, rank, OPTIMIZERS["adamw"], stage=2))
    attempt(out, "lr_schedulers", lambda: _compare(mesh, rank, OPTIMIZERS["adamw"], schedule=True))
    attempt(out, "subclass", lambda: _compare(mesh, rank, lambda ps: MyAdamW(ps, lr=1e-2)))
    attempt(out, "failing_step", lambda: _failing_step(mesh, rank))
    return out
