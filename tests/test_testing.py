"""zerofx.testing: the oracle the parity tests rest on, and the verify tool users get.

* The arithmetic the oracle reproduces: zerofx's local sum of N chunks is a rank-ordered
  sequential sum, bit for bit; the any-order summation bound holds for every order.
* On 2 and 4 gloo ranks: a model that trains the same sharded is reported bit-identical; the
  smallest change zerofx could make (one ulp in one element of one gradient or parameter shard)
  is found, on the rank that made it, by name and index; a dropout model's first divergence is
  its first loss; a factory that builds other weights on each call, or per rank, is refused.
* ``zerofx verify`` on the command line: exit status and report, no traceback.
"""

from __future__ import annotations

import copy
import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.multirank import run_ranks, scenario_results
from tests.oracle_scenarios import scenarios
from zerofx.testing import load_factory, summation_bound

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("ranks", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("shape", [(1,), (7,), (33, 5), (1000,), (3, 4, 5)])
def test_local_chunk_sum_is_a_rank_ordered_sequential_sum(ranks, shape):
    """zerofx sums the N received chunks in rank order (eager_buckets.rank_ordered_sum; the transport
    pass emits the same chain of adds, tests/test_passes.py), as ShardedReference does; not
    ``sum(0)``, whose association ATen picks (on torch 2.13 it differs from 5 rows on)."""
    from zerofx.runtime.eager_buckets import rank_ordered_sum

    g = torch.Generator().manual_seed(ranks * 100 + len(shape))
    chunks = torch.randn(ranks, *shape, generator=g) * torch.logspace(-6, 6, ranks).view(-1, *[1] * len(shape))
    total = chunks[0].clone()
    for c in chunks[1:]:
        total += c
    assert torch.equal(rank_ordered_sum(chunks), total)
    assert torch.equal(rank_ordered_sum(chunks.reshape(ranks, -1)).view(shape), total)


def test_summation_bound_holds_for_every_order_and_catches_more():
    g = torch.Generator().manual_seed(0)
    terms = [torch.randn(4096, generator=g) * s for s in (1.0, -3e3, 1e-4, 7.0)]
    exact = torch.stack([t.double() for t in terms]).sum(0)
    bound = summation_bound(terms)
    worst = 0.0
    for order in itertools.permutations(range(4)):
        total = terms[order[0]].clone()
        for i in order[1:]:
            total += terms[i]
        err = (total.double() - exact).abs()
        assert bool((err <= bound).all()), order
        worst = max(worst, float((err / bound).nan_to_num(0).max()))
    assert worst > 0.01  # the bound is not vacuous: some order comes within 100x of it
    wrong = exact + 2 * bound + 1e-30
    assert not bool(((wrong - exact).abs() <= bound).all())


@pytest.fixture(scope="module")
def runs():
    cache: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            cache[world] = run_ranks(scenarios, world, timeout=420)
        return cache[world]

    return get


@pytest.mark.parametrize("name", ["mlp", "mlp_stage1_clip", "cond", "cond_stage1"])
def test_a_model_that_trains_the_same_is_reported_bit_identical(runs, name):
    """cond: a torch.cond in forward, whose branch graphs the backward reads again (the activation
    plan took them for values it could neither save nor recompute, and raised)."""
    for r in scenario_results(runs(2), name):
        assert r["ok"] and r["problem"] == "" and len(r["steps"]) == 3
        assert all(s["divergences"] == [] and s["loss_diff"] == 0.0 and s["bounded"] == [] for s in r["steps"])


def test_one_ulp_in_one_shard_is_found_by_name_on_its_rank(runs):
    """Step 1 of each run changes one element on one rank; step 0 and every other rank's step 1
    are clean (from step 2 on the ranks' models differ, so everything may)."""
    rank0, rank1 = scenario_results(runs(2), "grad_perturbed")
    assert rank0["found"][:2] == [[], []] and rank1["found"][0] == []
    # one gradient element moved by one ulp on rank 1: found there, by name and index (AdamW's
    # update of that element may round the change away or not: the parameter is not asserted)
    grads = [d for d in rank1["found"][1] if d["kind"] == "grad"]
    assert grads == [dict(kind="grad", name="layers.0.weight", count=1, index=[0, 0], note="")]
    assert all(d["index"] == [0, 0] for d in rank1["found"][1])
    rank0, rank1 = scenario_results(runs(2), "param_perturbed")
    assert rank0["found"][0] == [] and rank1["found"][:2] == [[], []]
    # one parameter element moved after the step on rank 0: found at that index, nothing else
    assert rank0["found"][1] == [dict(kind="param", name="layers.0.weight", count=1, index=[1, 1], note="")]
    assert all(b == [] for r in (rank0, rank1) for b in r["bounded"])


def test_dropout_diverges_at_the_first_loss(runs):
    for r in scenario_results(runs(2), "noisy"):
        assert not r["ok"] and r["problem"] == ""
        first = r["first_divergence"]
        assert (first["step"], first["kind"]) == (0, "loss")


def test_a_factory_that_is_not_deterministic_is_refused(runs):
    for r in scenario_results(runs(2), "drifting"):
        assert not r["ok"] and "not deterministic" in r["problem"] and "layers.0.weight" in r["problem"]
        assert r["steps"] == []
    for r in scenario_results(runs(2), "rank_init"):
        assert not r["ok"] and "depends on the rank" in r["problem"]


def test_backend_ordered_reductions_are_bounded_and_teacher_forced(runs):
    """At 4 ranks gloo all-reduces whole parameters in its own order: within the any-order
    bound, zerofx's sum is adopted and the parameters stay bit-identical."""
    for r in scenario_results(runs(4), "persist"):
        assert r["ok"], r["first_divergence"]
        assert all(s["divergences"] == [] for s in r["steps"])
        assert {n for s in r["steps"] for n in s["bounded"]} == {
            "layers.0.weight",
            "layers.1.weight",
            "layers.2.weight",
        }
    per_rank = scenario_results(runs(4), "persist_perturbed")
    for rank, r in enumerate(per_rank):
        grads = [d for d in r["found"][1] if d["kind"] == "grad"]
        if rank == 3:  # 1e-3 of the largest entry is far beyond the bound
            assert [(d["name"], d["index"], d["note"]) for d in grads] == [
                ("layers.0.weight", [0, 0], "beyond the any-order summation bound")
            ]
        else:
            assert grads == []


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The installed ``zerofx`` command, run from the repository root (where tests.verify_models
    is found) as a user runs it; ``python -m`` would put the source tree's zerofx/, which lacks
    zerofx.passes and zerofx.codegen, ahead of the installed package."""
    command = shutil.which("zerofx", path=str(Path(sys.executable).parent)) or shutil.which("zerofx")
    assert command, "the zerofx console script is not installed next to this Python"
    return subprocess.run([command, "verify", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_cli_reports_bit_identical_training(tmp_path):
    out = _cli("tests.verify_models:mlp", "--steps", "2", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("matches the unsharded model bit for bit") == 2
    assert [r["ok"] for r in json.loads((tmp_path / "r.json").read_text())] == [True, True]


def test_cli_names_the_first_divergence_without_a_traceback():
    out = _cli("tests.verify_models:noisy_mlp", "--steps", "2")
    assert out.returncode == 1
    assert "FIRST DIVERGENCE: step 0 loss" in out.stdout and "Traceback" not in out.stdout + out.stderr
    out = _cli("tests.verify_models:drifting_mlp", "--steps", "2")
    assert out.returncode == 2 and "not deterministic" in out.stdout and "Traceback" not in out.stdout


def test_bad_factory_specs_are_clear_errors():
    for spec, words in [
        ("nocolon", "MODULE:FACTORY"),
        ("tests.verify_models:nope", "no attribute"),
        ("no_such_module_zfx:f", "cannot import"),
    ]:
        with pytest.raises(ValueError, match=words):
            load_factory(spec)
    out = _cli("tests.verify_models:nope")
    assert out.returncode == 2 and "no attribute" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "options", [{"param_dtype": torch.bfloat16}, {"reduce_dtype": torch.bfloat16}, {"quantize_weights": "int8"}]
)
def test_verify_refuses_options_that_change_the_arithmetic(options):
    """Mixed precision and quantized transfers round by design: a bit-for-bit verdict would call
    that a divergence, so verify refuses them before it builds or communicates anything."""
    from zerofx.testing import verify

    name = next(iter(options))
    with pytest.raises(ValueError, match=f"{name}=.*changes the arithmetic"):
        verify(lambda: None, None, **options)


_drift = iter(range(1_000_000))


def _drifting_on_cpu():
    """A factory that builds other weights on each call, on the CPU explicitly (whatever the
    default device): verify's verdict collectives run, then it stops before compiling."""
    model = torch.nn.Linear(2, 2, device="cpu")
    with torch.no_grad():
        model.bias.add_(next(_drift))
    return model, lambda n, gen: (torch.zeros(n, 2),)


def _bookkeeping_devices(rank: int, world: int) -> dict:
    """verify's and reduce_gradients' own small tensors, made while the default device is not
    the mesh's (meta stands in for the CPU that an NCCL group has no backend for)."""
    from torch.distributed.device_mesh import init_device_mesh

    import zerofx
    from zerofx.testing import ShardedReference, verify

    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        problem = verify(_drifting_on_cpu, mesh, steps=1).problem
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    replica = copy.deepcopy(model)
    zerofx.compile(model, mesh)
    ref = ShardedReference(replica, model, lambda ps: torch.optim.SGD(ps, lr=0.1))
    x = torch.randn(2, 4)
    model(x).sum().backward()
    ref.backward(lambda m: m(x).sum())
    with torch.device("meta"):
        ref.reduce_gradients()
    return {"problem": problem, "divergences": len(ref.check_gradients(model, 0))}


def test_bookkeeping_collectives_use_the_mesh_device_not_the_default_one():
    """On a GPU an NCCL group has no backend for CPU tensors ("No backend type associated with
    device type cpu"): the oracle's own verdict and has-a-gradient collectives must travel on the
    mesh's (the parameters') device, not wherever the default device puts a new tensor."""
    for r in run_ranks(_bookkeeping_devices, 2, timeout=240):
        assert "not deterministic" in r["problem"] and r["divergences"] == 0, r


class _Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.register_buffer("scale", torch.arange(4.0))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.b(torch.tanh(self.a(x))) * self.scale, y)


def _regression_batch(n, gen):
    return torch.randn(n, 8, generator=gen), torch.randn(n, 4, generator=gen)


def _differing_by_rank(change):
    """A factory whose model ``change`` alters on rank 1 only (the same on each call)."""

    def build():
        torch.manual_seed(0)
        model = _Regression()
        if torch.distributed.get_rank() == 1:
            with torch.no_grad():
                change(model)
        return model, _regression_batch

    return build


def _verify_refusals(rank: int, world: int) -> dict:
    """verify's refusals, on ``world`` ranks: factories whose ranks build other values that keep
    every tensor's sum (rows in another order, a buffer's elements swapped), and a batch_fn that
    returns a bare tensor."""
    from torch.distributed.device_mesh import init_device_mesh

    from zerofx.testing import verify

    mesh = init_device_mesh("cpu", (world,))
    got = {}
    if world > 1:
        got["rows"] = verify(_differing_by_rank(lambda m: m.a.weight.copy_(m.a.weight.flip(0))), mesh, steps=1).problem
        got["buffer"] = verify(_differing_by_rank(lambda m: m.scale.copy_(m.scale.flip(0))), mesh, steps=1).problem
    try:
        got["bare_tensor"] = verify(
            lambda: (_Regression(), lambda n, gen: torch.randn(n, 8, generator=gen)), mesh
        ).problem
    except TypeError as e:
        got["bare_tensor"] = f"TypeError: {e}"
    return got


def test_verify_refuses_ranks_with_other_values_and_a_batch_that_is_not_a_tuple():
    """Before: ranks' parameters were compared by their float64 sums (rows in another order were
    reported as a divergence, exit 1, not as the factory's fault; buffers were not compared), and
    a bare tensor from batch_fn was iterated row by row into forward's arguments ("forward() takes
    3 positional arguments but 5 were given")."""
    for r in run_ranks(_verify_refusals, 2, timeout=300):
        assert "ranks built different initial parameters" in r["rows"], r
        assert "'a.weight' differs between rank 0 and rank 1" in r["rows"], r
        assert "'scale' differs between rank 0 and rank 1" in r["buffer"], r
        assert r["bare_tensor"].startswith("TypeError: batch_fn(n, generator) must return a tuple"), r
        assert "got Tensor: wrap it as (x,)" in r["bare_tensor"], r


def _one_rank_report(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from tests import verify_models
    from zerofx.testing import verify

    report = verify(verify_models.mlp, init_device_mesh("cpu", (world,)), steps=2)
    return {"ok": report.ok, "sharded": report.sharded, "text": report.format()}


def test_verify_on_one_rank_says_nothing_is_sharded():
    """Before: "sharded training matches the unsharded model bit for bit", where zerofx keeps a
    one-rank model whole and nothing was sharded. It still compares (zerofx's compiled training
    of the whole model: the GPU check's world-1 parity), and says what it compared."""
    (r,) = run_ranks(_one_rank_report, 1, timeout=300)
    assert r["ok"] and not r["sharded"], r
    assert "at world size 1 zerofx shards nothing (the model stays whole): its compiled training" in r["text"], r
    assert "sharded training matches" not in r["text"], r
    out = _cli("tests.verify_models:mlp", "--world-size", "1", "--steps", "1")  # the CLI's text too
    assert out.returncode == 0, out.stdout + out.stderr
    assert "at world size 1 zerofx shards nothing" in out.stdout, out.stdout
    assert "sharded training matches" not in out.stdout, out.stdout


def test_the_replica_builds_the_causal_mask_the_compiled_graph_does():
    """transformers' masking skips its causal mask when run eagerly (SDPA's is_causal kernel)
    and builds it when traced (an explicit mask): two kernels that round otherwise on some CPUs
    (an AMD EPYC). Inside ``branches_as_traced`` the eager model takes the traced branch: its
    gradients equal torch.compile's (aot_eager) bit for bit, and ``is_tracing`` is put back,
    after an error too."""
    import transformers.masking_utils as masking

    from tests.hf_scenarios import tiny_llama
    from zerofx.testing import branches_as_traced

    asked = masking.is_tracing
    with pytest.raises(RuntimeError, match="inside"):
        with branches_as_traced():
            assert masking.is_tracing() is True
            raise RuntimeError("inside")
    assert masking.is_tracing is asked and masking.is_tracing() is False

    model = tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    eager, compiled = copy.deepcopy(model), copy.deepcopy(model)
    with branches_as_traced():
        eager_loss = eager(input_ids=ids, labels=ids, use_cache=False).loss
    eager_loss.backward()
    torch._dynamo.reset()
    compiled_loss = torch.compile(compiled, backend="aot_eager")(input_ids=ids, labels=ids, use_cache=False).loss
    compiled_loss.backward()
    assert torch.equal(eager_loss, compiled_loss)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(a.grad, b.grad), name
