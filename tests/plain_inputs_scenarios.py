"""Rank-side half of tests/test_plain_inputs.py: the same compiled training with the graphs
given plain local tensors (``plain_graph_inputs=True``, the default) and given the DTensor
parameters (``False``), on 2 gloo ranks."""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

import zerofx
import zerofx.backend
from tests.models import GPT_CFG
from tests.multirank import attempt
from zerofx.models import GPT, random_batch

STEPS = 3


class _InputKinds:
    """Records which kinds of tensors the compiled frames are given (by patching a helper the
    zerofx backend calls with every frame's example inputs)."""

    def __init__(self):
        self.kinds: set[str] = set()
        self._original = zerofx.backend._size_symbols

    def __enter__(self):
        def recording(example_inputs):
            self.kinds.update(type(x).__name__ for x in example_inputs if isinstance(x, torch.Tensor))
            return self._original(example_inputs)

        zerofx.backend._size_symbols = recording
        return self

    def __exit__(self, *exc):
        zerofx.backend._size_symbols = self._original


def _train(mesh, rank: int, plain: bool, stage: int, *, hooks: bool = False, micro: int = 1) -> dict:
    """``STEPS`` steps of AdamW (``micro`` micro-batches each, gradients zeroed in place) on a
    compiled GPT whose first block's attention projection is frozen after sharding; with ``hooks`` a gradient hook halves one parameter's gradient and a
    post-accumulate hook counts its calls."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    with _InputKinds() as seen:
        model = zerofx.compile(GPT(GPT_CFG), mesh, stage=stage, plain_graph_inputs=plain)
        frozen = model.blocks[0].attn.proj.weight
        frozen.requires_grad_(False)
        named = dict(model.named_parameters())
        calls = []
        if hooks:
            target = named["blocks.1.fc.weight"]
            target.register_hook(lambda g: g * 0.5)
            target.register_post_accumulate_grad_hook(lambda p: calls.append(type(p.grad).__name__))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(100 + rank)
        losses, grads = [], {}
        for step in range(STEPS):
            for _ in range(micro):
                x, y = random_batch(GPT_CFG, 2, gen)
                loss = model(x, y)
                losses.append(loss.item())
                loss.backward()
            if step == STEPS - 1:
                grads = {n: None if p.grad is None else p.grad.to_local().clone() for n, p in named.items()}
                grad_kinds = sorted({type(p.grad).__name__ for p in named.values() if p.grad is not None})
            opt.step()
            opt.zero_grad(set_to_none=micro == 1)
        x, y = random_batch(GPT_CFG, 2, gen)
        losses.append(model(x, y).item())
    return {
        "losses": losses,
        "params": {n: p.to_local().clone() for n, p in named.items()},
        "grads": grads,
        "grad_kinds": grad_kinds,
        "frozen_grad": frozen.grad is None,
        "hook_calls": calls,
        "input_kinds": sorted(seen.kinds),
    }


def _compare(mesh, rank: int, stage: int, **kw) -> dict:
    off = _train(mesh, rank, False, stage, **kw)
    on = _train(mesh, rank, True, stage, **kw)

    def same(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(
            (a[k] is None and b[k] is None) or (a[k] is not None and b[k] is not None and torch.equal(a[k], b[k]))
            for k in a
        )

    return {
        "losses": (off["losses"], on["losses"]),
        "params_equal": same(off["params"], on["params"]),
        "grads_equal": same(off["grads"], on["grads"]),
        "grad_kinds": (off["grad_kinds"], on["grad_kinds"]),
        "frozen_grad_none": (off["frozen_grad"], on["frozen_grad"]),
        "hook_calls": (off["hook_calls"], on["hook_calls"]),
        "input_kinds": (off["input_kinds"], on["input_kinds"]),
    }


class _BrokenLinear(torch.nn.Linear):
    """A Linear whose forward has a graph break: dynamo compiles ``forward`` as a frame of its
    own, which then runs for every instance whose guards pass."""

    def forward(self, x):
        torch._dynamo.graph_break()
        return super().forward(x)


class _TwoHeads(torch.nn.Module):
    """Heads of 5 and 6 rows: at 2 ranks rank 0 holds 3 rows of each (torch.chunk), so only the
    guard on the row count tells the two frames apart there."""

    def __init__(self):
        super().__init__()
        self.a = _BrokenLinear(8, 5)
        self.b = _BrokenLinear(8, 6)

    def forward(self, x):
        return self.a(x).square().mean() + self.b(x).square().mean()


def _frame_shared_by_modules(mesh) -> dict:
    """A frame compiled for one module and run for another of the same class but other rows: the
    guards tell them apart (nothing is dropped that differs between parameters). Every rank
    takes the same batch, so its loss and the averaged gradients are the unsharded model's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = _TwoHeads()
    model = copy.deepcopy(reference)
    zerofx.compile(model, mesh)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    want = reference(x)
    want.backward()
    got = model(x)
    got.backward()
    named = dict(model.named_parameters())
    return {
        "loss": (got.item(), want.item()),
        "grads_err": max(
            (named[n].grad.full_tensor() - p.grad).abs().max().item() for n, p in reference.named_parameters()
        ),
    }


def scenarios(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    for stage in (3, 2, 1):
        attempt(out, f"stage{stage}", lambda stage=stage: _compare(mesh, rank, stage))
    attempt(out, "hooks", lambda: _compare(mesh, rank, 3, hooks=True))
    attempt(out, "accumulation", lambda: _compare(mesh, rank, 3, micro=2))
    attempt(out, "frame_shared_by_modules", lambda: _frame_shared_by_modules(mesh))
    return out
