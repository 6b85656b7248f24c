"""Recurrent modules (nn.LSTM, nn.GRU) in a sharded, compiled model.

dynamo does not trace torch's RNN modules (``torch._dynamo.config.allow_rnn`` is off): the
LSTM's forward runs eagerly, and each read of one of its weights (the sharded class's property,
zerofx/sharding.py) reaches ``ParamState.forward_value`` from that eager frame, which dynamo
then compiles as a frame of its own, once per parameter layout. There the ParamState is a frame
local, not an attribute of a module, so under the default ``dynamic="auto"`` its ``full_rows``
and its shard's sizes became size symbols at the first recompile, and the gather pass met a
graph value where the marker's row count belongs (a TypeError in ``padded_rows``). Two gloo
ranks train a small LSTM model at each stage (and a GRU one at stage 3) for three AdamW steps
against the ShardedReference (zerofx.testing; bit for bit in fp32: losses, gradients and
parameters, every step), over sequence lengths that change between steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.multirank import attempt, run_ranks, scenario_results

LENGTHS = (3, 5, 4)  # one per step: input shapes change between steps
PER_RANK = 2


class LSTMNet(nn.Module):
    def __init__(self, cell: type[nn.Module] = nn.LSTM) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.rnn = cell(8, 8, batch_first=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(torch.tanh(self.embed(x)))
        return F.mse_loss(self.head(h[:, -1]), y)


def train(rank: int, world: int, stage: int, cell: type[nn.Module] = nn.LSTM) -> dict:
    """Three AdamW steps of zerofx (default dynamic shapes) and the ShardedReference side by side."""
    from torch.distributed.device_mesh import init_device_mesh

    import zerofx
    from tests.parity import step_against_reference
    from zerofx.ir.meta import ROLE
    from zerofx.runtime.params import runtime_of
    from zerofx.testing import ShardedReference

    torch.manual_seed(0)
    model = LSTMNet(cell)
    replica = copy.deepcopy(model)
    zerofx.compile(model, init_device_mesh("cpu", (world,)), stage=stage)
    compiled = runtime_of(model).compiled
    compiled.graphs = {}  # keep the final graphs (as zerofx.plan does)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = ShardedReference(replica, model, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    failures: list[str] = []
    losses = []
    for step, length in enumerate(LENGTHS):
        gen = torch.Generator().manual_seed(100 * step + rank)  # this rank's own data
        x, y = torch.randn(PER_RANK, length, 6, generator=gen), torch.randn(PER_RANK, 4, generator=gen)
        loss = model(x, y)
        loss.backward()
        failures += step_against_reference(model, opt, ref, step, loss, lambda m: m(x, y))
        losses.append(loss.item())
    # the frames whose forward gathers a parameter, and the size symbols of their inputs
    gathering = {
        graph: compiled.size_symbols[graph]
        for (graph, kind), gm in compiled.graphs.items()
        if kind == "forward" and any(n.meta.get(ROLE) == "gather" for n in gm.graph.nodes)
    }
    return {"failures": failures, "losses": losses, "size_symbols": dict(compiled.size_symbols), "gathering": gathering}


def scenarios(rank: int, world: int) -> dict:
    out: dict = {}
    for stage in (3, 2, 1):
        attempt(out, f"lstm_stage{stage}", lambda stage=stage: train(rank, world, stage))
    attempt(out, "gru_stage3", lambda: train(rank, world, 3, nn.GRU))
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(scenarios, 2, timeout=400)


@pytest.mark.parametrize("name", ["lstm_stage3", "lstm_stage2", "lstm_stage1", "gru_stage3"])
def test_rnn_trains_bit_for_bit_under_default_dynamic_shapes(runs, name):
    for rank, r in enumerate(scenario_results(runs, name)):
        assert not r["failures"], f"rank {rank}: " + "\n".join(r["failures"][:10])
        assert len(r["losses"]) == len(LENGTHS)
        assert r["size_symbols"], r  # the backend compiled frames


def test_frames_gathering_parameters_are_static(runs):
    """The frames dynamo compiles for one parameter read each (``forward_value``, called from the
    LSTM's eager forward) gather with static layouts: parameters never get size symbols (docs/
    architecture.md, Dynamic shapes), even where dynamo recompiled such a frame for another
    parameter's layout."""
    for name in ("lstm_stage3", "gru_stage3"):
        for rank, r in enumerate(scenario_results(runs, name)):
            assert len(r["gathering"]) >= 4, f"rank {rank}: {r['gathering']}"  # a frame per layout at least
            assert not any(r["gathering"].values()), f"{name}, rank {rank}: {r['gathering']}"


def test_gather_refuses_a_symbolic_layout_with_a_zerofx_error():
    """Were a marker's row count ever a graph value again, the gather pass says so, with the
    workaround, instead of failing in its padding arithmetic with a bare TypeError."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from zerofx.errors import ZeroFXError
    from zerofx.passes.contract import PassContext
    from zerofx.passes.gather import gather_pass

    unshard = torch.ops.zerofx.unshard
    gm = make_fx(lambda s: unshard(s, 2, "g", s.shape[0] * 2) * 2, tracing_mode="symbolic")(torch.randn(3, 5))
    with pytest.raises(ZeroFXError, match=r"row count and shard's rows reached the gather pass.*dynamic=False"):
        gather_pass(gm, PassContext("test", "forward"))
