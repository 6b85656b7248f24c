"""Rank-side half of tests/test_dynamic_shapes.py: training over changing sequence lengths.

Every scenario trains the test GPT (seq_len 64) with zerofx and, next to it, the
ShardedReference (zerofx.testing; bit for bit in fp32) over one sequence length per step, and
returns what the test asserts on: each step's divergences, how often zerofx compiled (dynamo's
unique graphs and zerofx's own frames), the size symbols of every compiled frame, and the
all-gather ops the last step (a symbolic graph) issued.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

import zerofx
from tests.multirank import attempt
from tests.parity import step_against_reference
from zerofx.models import GPT, GPTConfig
from zerofx.runtime.params import runtime_of
from zerofx.testing import ShardedReference

CFG = GPTConfig(vocab_size=96, seq_len=64, n_layer=1, n_head=4, d_model=32)
LENGTHS = (8, 16, 24, 32, 40, 48, 56, 64)  # 8 distinct lengths, one per step
PER_RANK = 2
# the all-gather ops torch's profiler names (tests/test_heap_regression.py): on gloo only the out= form may run
GATHER_OPS = {
    "out_of_place": "_c10d_functional::all_gather_into_tensor",
    "out_form": "_c10d_functional::all_gather_into_tensor_out",
    "pair": "zerofx::all_gather_pair_out",  # two gloo ranks: passes/exchange.py
}


def train_lengths(
    rank: int, world: int, lengths: list[int], options: dict, profile_last: bool = False, rows: bool = False
) -> dict:
    """One step per entry of ``lengths`` (this rank's sequence length at that step); with
    ``rows``, each rank's batch is its rows of one global batch (a view at an offset: rank 1's
    storage offset becomes a size symbol of its own graphs only)."""
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    model = GPT(CFG)
    replica = copy.deepcopy(model)
    zerofx.compile(model, init_device_mesh("cpu", (world,)), **options)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref = ShardedReference(replica, model, lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    failures: list[str] = []
    for step, length in enumerate(lengths):
        if rows:
            gen = torch.Generator().manual_seed(1000 * step)  # one global batch, this rank's rows of it
            data = torch.randint(0, CFG.vocab_size, (PER_RANK * world, length + 1), generator=gen)
            data = data[rank * PER_RANK : (rank + 1) * PER_RANK]
        else:
            gen = torch.Generator().manual_seed(1000 * step + rank)  # this rank's own data
            data = torch.randint(0, CFG.vocab_size, (PER_RANK, length + 1), generator=gen)
        x, y = data[:, :-1], data[:, 1:]
        last = profile_last and step == len(lengths) - 1  # the symbolic graph: which all-gathers run?
        with profile(activities=[ProfilerActivity.CPU]) if last else contextlib.nullcontext() as prof:
            loss = model(x, y)
            loss.backward()
        failures += step_against_reference(model, opt, ref, step, loss, lambda m: m(x, y))
    state = runtime_of(model).compiled
    names = [e.name for e in prof.events()] if profile_last else []
    return {
        "gathers": {form: names.count(op) for form, op in GATHER_OPS.items()},
        "failures": failures,
        "unique_graphs": counters["stats"]["unique_graphs"],
        "size_symbols": dict(state.size_symbols),
        "backward_frames": state.frames(),
    }


def one_rank_recompiles(rank: int, world: int, stage: int = 3) -> str:
    """``dynamic=True`` with a budget, rank 0's second batch a single sequence: torch specializes
    a size of 1, so rank 0 alone recompiles, and at stage 3 its compile-time plan agreement would
    meet rank 1's collectives (a wait until the process group's timeout). Every rank's error
    message; at stage 2, which agrees on nothing at compile time, "trained"."""
    torch.manual_seed(0)
    model = GPT(CFG)
    zerofx.compile(model, init_device_mesh("cpu", (world,)), dynamic=True, activation_budget=0.5, stage=stage)
    try:
        for step in range(2):
            batch = 1 if rank == 0 and step == 1 else PER_RANK
            data = torch.randint(0, CFG.vocab_size, (batch, 17), generator=torch.Generator().manual_seed(step))
            model(data[:, :-1], data[:, 1:]).backward()
    except (zerofx.ZeroFXError, torch._dynamo.exc.BackendCompilerFailed) as e:  # rank 0's: raised in its compile
        return str(e)
    return "trained"


def scenarios(rank: int, world: int) -> dict:
    skewed = [LENGTHS[(i + rank) % len(LENGTHS)] for i in range(len(LENGTHS))]  # ranks differ every step
    late = [LENGTHS[0]] * (1 + rank) + list(LENGTHS[1 : len(LENGTHS) - rank])  # rank 1 recompiles a step later
    out: dict = {}
    attempt(out, "stage3", lambda: train_lengths(rank, world, list(LENGTHS), {}, profile_last=True))
    attempt(out, "stage2_skewed", lambda: train_lengths(rank, world, skewed, {"stage": 2}))
    attempt(
        out,
        "budget_dynamic_late",
        lambda: train_lengths(rank, world, late, {"dynamic": True, "activation_budget": 0.5}),
    )
    attempt(
        out,
        "checkpoint_full_rows",
        lambda: train_lengths(rank, world, [16, 12, 8], {"checkpoint": "full"}, rows=True),
    )
    attempt(out, "one_rank_recompiles", lambda: one_rank_recompiles(rank, world))
    attempt(out, "one_rank_recompiles_stage2", lambda: one_rank_recompiles(rank, world, stage=2))
    return out
