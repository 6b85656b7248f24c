"""Rank-side half of tests/test_testing.py: zerofx.testing's oracle and verify tool on gloo ranks,
on models that train the same sharded and on ones that do not."""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

import zerofx
from tests import verify_models
from tests.multirank import attempt
from zerofx.testing import ShardedReference, verify


def _report(fn, mesh, **kwargs) -> dict:
    return verify(fn, mesh, steps=3, **kwargs).to_json()


def _next_float(t: torch.Tensor, index) -> None:
    """Move one element of ``t`` to the next representable float (the smallest change there is)."""
    with torch.no_grad():
        t[index] = torch.nextafter(t[index], torch.tensor(float("inf")))


def perturbed(rank: int, world: int, mesh, options: dict, target: str, grad_scale: float = 0.0) -> dict:
    """Train the MLP with the oracle and, at step 1, nudge one of zerofx's own values: with
    ``target="grad"`` one element of a gradient shard on the last rank (by one ulp, or by
    ``grad_scale`` of the largest entry), with ``target="param"`` one element of a parameter
    shard on rank 0 after the optimizer step. Returns what the oracle found per step (later
    steps see the consequences: the ranks' models then differ)."""
    torch.manual_seed(0)
    model, batch = verify_models.mlp()
    replica = copy.deepcopy(model)
    zerofx.compile(model, mesh, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = ShardedReference(replica, model, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    gen = torch.Generator().manual_seed(3)
    found, bounded = [], []
    mine = slice(rank * 2, rank * 2 + 2)
    for step in range(3):
        x, y = batch(2 * world, gen)
        model(x[mine], y[mine]).backward()
        ref.backward(lambda m: m(x[mine], y[mine]))
        ref.reduce_gradients()
        bounded.append(list(ref.bounded))
        name, p = next(iter(model.named_parameters()))
        if step == 1 and target == "grad" and rank == world - 1:
            g = p.grad.to_local()
            if grad_scale:
                with torch.no_grad():
                    g[0, 0] += grad_scale * g.abs().max()
            else:
                _next_float(g, (0, 0))
        divs = ref.check_gradients(model, step)
        opt.step()
        opt.zero_grad()
        ref.step()
        if step == 1 and target == "param" and rank == 0:
            _next_float(p.to_local(), (1, 1))
        divs += ref.check_parameters(model, step)
        found.append([dict(kind=d.kind, name=d.name, count=d.count, index=list(d.index), note=d.note) for d in divs])
    return {"found": found, "bounded": bounded}


def scenarios(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    if world == 2:
        attempt(out, "mlp", lambda: _report(verify_models.mlp, mesh))
        attempt(out, "mlp_stage1_clip", lambda: _report(verify_models.mlp, mesh, stage=1, max_grad_norm=0.05))
        attempt(out, "cond", lambda: _report(verify_models.cond_mlp, mesh))
        attempt(out, "cond_stage1", lambda: _report(verify_models.cond_mlp, mesh, stage=1))
        attempt(out, "noisy", lambda: _report(verify_models.noisy_mlp, mesh))
        attempt(out, "drifting", lambda: _report(verify_models.drifting_mlp, mesh))
        attempt(out, "rank_init", lambda: _report(verify_models.rank_init_mlp, mesh))
        attempt(out, "grad_perturbed", lambda: perturbed(rank, world, mesh, {}, "grad"))
        attempt(out, "param_perturbed", lambda: perturbed(rank, world, mesh, {}, "param"))
    else:  # 4 ranks: whole (replicated) parameters are all-reduced by gloo in its own order
        attempt(out, "persist", lambda: _report(verify_models.mlp, mesh, persistence_threshold=10**6))
        attempt(
            out,
            "persist_perturbed",
            lambda: perturbed(rank, world, mesh, {"persistence_threshold": 10**6}, "grad", grad_scale=1e-3),
        )
    return out
