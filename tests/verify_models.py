"""Model factories for ``zerofx verify`` and ``zerofx.testing.verify`` tests: MODULE:FACTORY
targets that return ``(model, batch_fn)``, one that trains the same sharded, and ones that do
not or cannot be compared."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from tests.models import GPT_CFG, MLP
from zerofx.models import GPT, random_batch


def _dense(n: int, g: torch.Generator):
    return torch.randn(n, 16, generator=g), torch.randn(n, 8, generator=g)


def mlp():
    """Trains the same sharded: bit for bit."""
    return MLP(), _dense


def gpt():
    return GPT(GPT_CFG), lambda n, g: random_batch(GPT_CFG, n, g)


class CondMLP(MLP):
    """A ``torch.cond`` in forward, on a parameter: its branches are subgraphs the traced graph
    holds as module attributes, which the backward's cond reads too."""

    def forward(self, x, y):
        h = F.gelu(self.layers[0](x))
        second = self.layers[1]
        h = torch.cond(second.weight.sum() > 0, lambda t: torch.tanh(second(t)), lambda t: F.gelu(second(t)) * 2, (h,))
        return F.mse_loss(self.layers[2](h), y)


def cond_mlp():
    return CondMLP(), _dense


class NoisyMLP(MLP):
    """Dropout in forward: the compiled graph and the replica draw different random masks (and
    each rank its own), so sharded training differs from the first loss on."""

    def forward(self, x, y):
        return super().forward(F.dropout(x, 0.5, training=True), y)


def noisy_mlp():
    return NoisyMLP(), _dense


_builds = itertools.count()


def drifting_mlp():
    """Not deterministic: every call builds other weights, whatever the seed."""
    model = MLP()
    with torch.no_grad():
        model.layers[0].weight.add_(next(_builds))
    return model, _dense


def rank_init_mlp():
    """Deterministic per process but initialized from the rank: the ranks start apart."""
    import torch.distributed as dist

    model = MLP()
    with torch.no_grad():
        model.layers[0].weight.mul_(1 + dist.get_rank())
    return model, _dense


def not_a_workload():
    return nn.Linear(2, 2)
