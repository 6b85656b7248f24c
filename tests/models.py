"""Models for the parity tests, each exercising one thing ZeRO-3 must get right.

Every model's ``forward(x, y)`` returns a scalar mean loss, so averaging per-rank gradients of
equal-sized local batches equals the gradient of the global batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zerofx.models import GPT, GPTConfig, random_batch


class MLP(nn.Module):
    """No biases and an input that requires grad: the backward reads every weight, so ZeRO-3
    moves exactly 3·Ψ·(N-1)/N per step."""

    def __init__(self, dims=(16, 32, 32, 8)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in zip(dims, dims[1:]))

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return F.mse_loss(x, y)


class GraphBreakNet(nn.Module):
    """Two dynamo frames: the print forces a graph break between the halves."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 24)
        self.b = nn.Linear(24, 12)
        self.c = nn.Linear(12, 4)

    def forward(self, x, y):
        h = torch.tanh(self.a(x))
        torch._dynamo.graph_break()
        h = torch.relu(self.b(h)) + x
        return F.mse_loss(self.c(h), y)


class RoutedExperts(nn.Module):
    """A mixture of experts that runs only the experts some token is routed to, as eager MoE code
    does (``if not hit.any(): continue``, a graph break): ranks whose tokens go to other experts
    run other graphs. The route is an input, so a test decides which experts each rank uses."""

    def __init__(self, d=8, experts=6):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))
        self.out = nn.Linear(d, 1)

    def forward(self, x, route, y):
        h = torch.relu(self.inp(x))
        mixed = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            hit = route == e
            if not hit.any():
                continue
            mixed = mixed + torch.where(hit[:, None], expert(h), 0.0)
        return F.mse_loss(self.out(mixed).squeeze(-1), y)


class IndexedLoop(nn.Module):
    """Layers of six different shapes run in a loop with a data-dependent index in it (eager MoE
    code's ``nonzero`` over its experts): dynamo falls back to running the loop eagerly, so each
    layer's ``nn.Linear.forward`` reads its parameters from eager code inside the compiled call,
    more reads of distinct names and shapes than dynamo's recompile limit (8)."""

    WIDTHS = (8, 10, 12, 14, 16, 18, 8)

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(self.WIDTHS, self.WIDTHS[1:]))

    def forward(self, x, y):
        h = x
        for layer in self.layers:
            keep = (h[:, 0] > -1e9).nonzero(as_tuple=True)[0]  # every row: a graph break in the loop
            h = torch.tanh(layer(h[keep]))
        return F.mse_loss(h, y)


def indexed_loop():
    """``zerofx.testing.verify``'s factory for ``IndexedLoop``."""
    return IndexedLoop(), lambda n, gen: (torch.randn(n, 8, generator=gen), torch.randn(n, 8, generator=gen))


def routed_experts(experts=6):
    """``zerofx.testing.verify``'s factory for ``RoutedExperts``: each step routes the global
    batch's samples to consecutive experts from a random first one, so two ranks of two samples
    each use disjoint experts, and which ones changes from step to step."""

    def batch(n, gen):
        first = torch.randint(experts, (1,), generator=gen)
        route = (torch.arange(n) + first) % experts
        return torch.randn(n, 8, generator=gen), route, torch.randn(n, generator=gen)

    return RoutedExperts(experts=experts), batch


class FrozenBufferNet(nn.Module):
    """A frozen embedding and layer, a constant buffer, a non-persistent buffer, and a buffer
    mutated in forward (a step counter)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.emb.weight.requires_grad_(False)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(16, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))
        self.register_buffer("offset", torch.full((16,), 0.1), persistent=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x, y):
        self.calls += 1
        h = self.emb(x).mean(1) * self.scale + self.offset
        h = F.silu(self.frozen(h)) + h
        return F.mse_loss(self.head(h), y)


class UnevenNet(nn.Module):
    """Dim 0 of every parameter is indivisible by 2 and 4; with 4 ranks some shards are empty
    (5 rows over 4 ranks: 2, 2, 1, 0) and one parameter has fewer rows than ranks. A 0-dim
    temperature (CLIP's ``logit_scale``) has no dim 0 at all: zerofx keeps it whole."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(6, 7)  # weight (7, 6), bias (7,)
        self.l2 = nn.Linear(7, 5)  # weight (5, 7), bias (5,)
        self.l3 = nn.Linear(5, 3)  # weight (3, 5), bias (3,)
        self.gain = nn.Parameter(torch.ones(3, 1, 3))  # 3-D, fewer rows than 4 ranks
        self.log_temperature = nn.Parameter(torch.tensor(0.25))  # 0-dim

    def forward(self, x, y):
        h = F.gelu(self.l2(F.gelu(self.l1(x))))
        out = self.l3(h) * self.gain.sum(dim=(1, 2)) / 3 * self.log_temperature.exp()
        return F.mse_loss(out, y)


class ExpertsNet(nn.Module):
    """Stacked experts, as HF's mixture-of-experts layers hold them ([experts, ffn, d]), with
    fewer experts than 4 ranks (and a [1, ...] router bias, fewer rows than 2): zerofx splits
    those along another dim (zerofx/ir/layout.py, NOTE: the sharded dim). Every token goes
    through every expert, weighted by a softmax router: dense, so every rank runs the same graph."""

    def __init__(self, d: int = 8, ffn: int = 12, experts: int = 2):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)  # weight (2, 8)
        self.router_bias = nn.Parameter(torch.zeros(1, experts))  # (1, 2)
        self.w_in = nn.Parameter(torch.randn(experts, ffn, d) / d**0.5)  # (2, 12, 8)
        self.w_out = nn.Parameter(torch.randn(experts, d, ffn) / ffn**0.5)  # (2, 8, 12)
        self.head = nn.Linear(d, 4)

    def forward(self, x, y):
        weights = torch.softmax(self.router(x) + self.router_bias, dim=-1)  # [batch, experts]
        h = F.gelu(torch.einsum("bd,efd->bef", x, self.w_in))
        out = torch.einsum("bef,edf->bed", h, self.w_out)
        mixed = (weights.unsqueeze(-1) * out).sum(1)
        return F.mse_loss(self.head(mixed), y)


GPT_CFG = GPTConfig(vocab_size=96, seq_len=16, n_layer=2, n_head=4, d_model=32)


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    lr: float = 1e-2


def _dense(in_dim: int, out_dim: int, grad_input: bool = False):
    def make(n: int, g: torch.Generator):
        x = torch.randn(n, in_dim, generator=g)
        return x.requires_grad_(grad_input), torch.randn(n, out_dim, generator=g)

    return make


def _tokens(vocab: int, length: int, out_dim: int):
    def make(n: int, g: torch.Generator):
        return torch.randint(0, vocab, (n, length), generator=g), torch.randn(n, out_dim, generator=g)

    return make


# parameters each case keeps whole on every rank (0-dim ones): the backend's all-reduce sums their
# gradients in its own order, which over more than two ranks is not the reference's rank order
WHOLE: dict[str, tuple[str, ...]] = {"uneven": ("log_temperature",)}

CASES: dict[str, Case] = {
    "mlp": Case(MLP, _dense(16, 8, grad_input=True)),
    "gpt": Case(lambda: GPT(GPT_CFG), lambda n, g: random_batch(GPT_CFG, n, g), lr=3e-3),
    "graph_break": Case(GraphBreakNet, _dense(12, 4)),
    "frozen_buffers": Case(FrozenBufferNet, _tokens(20, 5, 4)),
    "uneven": Case(UnevenNet, _dense(6, 3)),
    "experts": Case(ExpertsNet, _dense(8, 4)),
}
