"""Changing sequence lengths without recompiles (docs/architecture.md, Dynamic shapes).

Two gloo ranks train the test GPT over 8 sequence lengths, one per step, against the
ShardedReference (bit for bit, every step): at most two compiles in all (the first at exact
shapes, the second with the sequence length as a symbol that every later length reuses), at
ZeRO-3 with the same lengths on both ranks and at ZeRO-2 with different lengths per rank; and
``dynamic=True`` with an activation budget, one compile, ranks changing length at different
steps. Rank side: tests/shapes_scenarios.py.
"""

from __future__ import annotations

import pytest
import torch

import zerofx
from tests.multirank import run_ranks, scenario_results
from tests.shapes_scenarios import LENGTHS, scenarios
from zerofx.errors import ZeroFXError


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(scenarios, 2, timeout=300)


@pytest.mark.parametrize("name", ["stage3", "stage2_skewed"])
def test_eight_lengths_compile_at_most_twice_and_train_bit_for_bit(runs, name):
    for rank, r in enumerate(scenario_results(runs, name)):
        assert not r["failures"], f"rank {rank}: " + "\n".join(r["failures"][:10])
        assert r["unique_graphs"] <= 2, r
        frames = list(r["size_symbols"].values())
        assert len(frames) == len(r["backward_frames"]) <= 2, r
        # the first frame at exact shapes, the one every later length reuses with a symbol
        assert frames[0] == () and len(frames[-1]) >= 1, r
        assert r["gathers"]["out_of_place"] == 0, r["gathers"]  # gloo: NOTE: gloo all-gathers in flight
        if name == "stage3":
            assert r["gathers"]["pair"] > 0, r["gathers"]  # the profiler does see them (two ranks: exchanges)
    assert len(LENGTHS) == 8


def test_dynamic_true_compiles_once_with_a_plan_agreed_across_ranks(runs):
    """The checkpoint plan is agreed by a collective at compile time: with ``dynamic=True``
    every rank compiles once, at step 0, even though rank 1 changes length a step later."""
    for rank, r in enumerate(scenario_results(runs, "budget_dynamic_late")):
        assert not r["failures"], f"rank {rank}: " + "\n".join(r["failures"][:10])
        assert r["unique_graphs"] == 1 and len(r["size_symbols"]) == 1, r
        assert len(next(iter(r["size_symbols"].values()))) >= 1, r


def test_a_plan_agrees_when_a_ranks_batch_is_a_view_at_an_offset(runs):
    """Each rank's batch its rows of one global batch: rank 1's storage offset is a size symbol
    nothing reads, which only its graphs have. The plan agreement compared graphs by node names,
    which that symbol renumbers, and refused a second length as "structurally different" graphs."""
    for rank, r in enumerate(scenario_results(runs, "checkpoint_full_rows")):
        assert not r["failures"], f"rank {rank}: " + "\n".join(r["failures"][:10])
        assert r["unique_graphs"] <= 2, r


def test_a_rank_recompiling_alone_under_a_plan_is_an_error_on_every_rank_not_a_hang(runs):
    """Rank 0 recompiles (a batch of one sequence, a size torch specializes) while rank 1 runs
    its graph: the compile joins rank 1's lockstep check, and both ranks raise, naming what each
    was about to do, instead of waiting out the process group's timeout. At stage 2 nothing is
    agreed at compile time, and such a recompile is fine."""
    for rank, message in enumerate(scenario_results(runs, "one_rank_recompiles")):
        assert "rank(s) [0]: compiling a new graph" in message, f"rank {rank}: {message}"
        assert "rank(s) [1]: the forward graph of" in message, f"rank {rank}: {message}"
        assert "torch specializes a size of 1" in message
    # stage 2 agrees on nothing at compile time: a rank recompiling alone trains on
    assert scenario_results(runs, "one_rank_recompiles_stage2") == ["trained", "trained"]


def test_dynamic_option_values():
    assert zerofx.Options().codegen.dynamic == "auto"
    assert zerofx.Options(dynamic=True).codegen.dynamic is True
    assert zerofx.Options(dynamic=False).codegen.dynamic is False
    for bad in (1, "yes", None):
        with pytest.raises(ZeroFXError, match=r"option dynamic=.*: choose 'auto', True or False"):
            zerofx.Options(dynamic=bad)


def test_backend_entry_point_sends_dynamic_to_torch_compile():
    from zerofx.backend import zerofx_backend

    with pytest.raises(ZeroFXError, match=r"torch.compile\(\.\.\., dynamic=True\)"):
        zerofx_backend(None, [], options={"dynamic": True})


def test_each_compiled_model_has_its_own_recompile_limit(tmp_path):
    """dynamo counts recompiles per code object: two models compiled in one process must not
    share one cache, else the second model's shapes push the first into eager execution."""
    import torch

    from tests.models import MLP
    from tests.multirank import one_rank_mesh
    from zerofx.runtime.params import runtime_of

    limit = torch._dynamo.config.recompile_limit
    with one_rank_mesh(str(tmp_path)) as mesh:
        models = [zerofx.compile(MLP(), mesh, dynamic=False) for _ in range(2)]
        for rows in range(2, 2 + limit):
            for model in models:
                model(torch.randn(rows, 16), torch.randn(rows, 8)).backward()
        assert [len(runtime_of(m).compiled.size_symbols) for m in models] == [limit, limit]


def test_a_second_model_compiled_in_the_process_starts_with_static_shapes(tmp_path):
    """Every model's entry shared one (file, line, name), under which dynamo's automatic dynamic
    shapes remember what changed: a GPT compiled after an MLP (other input sizes) had its first
    compile made symbolic, though its shapes never changed (its dump said "dynamic sizes")."""
    from tests.multirank import one_rank_mesh
    from zerofx.models import GPT, GPTConfig
    from zerofx.sharding import runtime_of

    with one_rank_mesh(str(tmp_path)) as mesh:
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
        first = zerofx.compile(mlp, mesh, param_dtype=torch.bfloat16)
        first(torch.randn(3, 4)).float().sum().backward()
        cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=32)
        second = zerofx.compile(GPT(cfg), mesh, param_dtype=torch.bfloat16)
        x = torch.randint(0, 64, (2, 16))
        second(x, x).float().backward()
        symbols = [runtime_of(m).compiled.size_symbols for m in (first, second)]
    assert [list(s.values()) for s in symbols] == [[()], [()]], symbols


def test_explain_compiles_what_a_model_with_changing_shapes_runs(tmp_path):
    """Explain compiles the model's call again; with an entry of its own name it compiled static
    graphs where the model, whose sizes had changed, runs symbolic ones."""
    from tests.multirank import one_rank_mesh

    with one_rank_mesh(str(tmp_path)) as mesh:
        torch.manual_seed(0)
        model = zerofx.compile(torch.nn.Linear(8, 8), mesh, param_dtype=torch.bfloat16)
        for length in (4, 6):
            model(torch.randn(2, length, 8)).float().relu().sum().backward()
        report = zerofx.explain(model, torch.randn(2, 10, 8))
    assert "dynamic sizes" in report, report
