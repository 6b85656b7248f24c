"""Checkpoints users take anywhere, and generation (issue 18, items 4 and 5), on an HF Llama.

Two gloo runs at 2 ranks: train + save (stage 3), then, after a one-process export to HF
safetensors, load + generate at stages 1, 2 and 3. The rest runs in this process.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

# the hf extra, which tox installs with the test extra (pip install -e ".[test,hf]")
import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch import nn

import zerofx
import zerofx.checkpoint as ck
from tests import hf_scenarios as hs
from tests.multirank import run_ranks, scenario_results
from zerofx import ZeroFXError
from zerofx.cli import main as cli_main
from zerofx.cli import parse_size


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-rank stage-3 checkpoint of the tiny Llama, its trained whole parameters, and its
    export to HF safetensors in several files."""
    folder = tmp_path_factory.mktemp("hf")
    run_ranks(hs.train_and_save, 2, str(folder))
    ck.export(folder / "ckpt", folder / "hf", max_shard_bytes=40_000)
    return folder, torch.load(folder / "trained.pt")


def test_export_to_hf_loads_with_from_pretrained_and_safetensors(trained):
    folder, params = trained
    out = folder / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    assert set(index["weight_map"]) == set(params)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in params.values())
    from_files = {}
    for name in files:
        from_files.update(load_file(out / name))
    assert set(from_files) == set(params)
    assert all(torch.equal(from_files[k], params[k]) for k in params)

    config = json.loads((out / "config.json").read_text())  # recorded by checkpoint.save
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 32
    hf = transformers.LlamaForCausalLM.from_pretrained(out)
    loaded = hf.state_dict()
    assert set(loaded) == set(params)
    assert [k for k in params if not torch.equal(loaded[k], params[k])] == []


def test_export_to_torch_files_and_dtype(trained, tmp_path):
    folder, params = trained
    out = ck.export(folder / "ckpt", tmp_path / "pt", to="torch")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "pytorch_model.bin"]
    sd = torch.load(out / "pytorch_model.bin")
    assert [k for k in params if not torch.equal(sd[k], params[k])] == []
    hf = transformers.LlamaForCausalLM.from_pretrained(out)
    assert all(torch.equal(hf.state_dict()[k], params[k]) for k in params)

    bf16 = ck.export(folder / "ckpt", tmp_path / "bf16", dtype=torch.bfloat16)
    sd = load_file(bf16 / "model.safetensors")
    assert all(sd[k].dtype == torch.bfloat16 and torch.equal(sd[k], params[k].bfloat16()) for k in params)
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"


def test_load_hf_and_generate_at_every_stage(trained):
    folder, params = trained
    per_rank = run_ranks(hs.load_and_generate, 2, str(folder), [1, 2, 3], timeout=600)
    for r in per_rank:
        want = r["want_tokens"]
        assert len(want[0]) == hs.PROMPT.shape[1] + hs.NEW_TOKENS
    for stage in (1, 2, 3):
        for rank, got in enumerate(scenario_results(per_rank, f"stage{stage}")):
            where = f"stage {stage}, rank {rank}"
            assert got["params_equal"] == sorted(params), where  # every parameter, bit for bit
            assert got["per_step_tokens"] == per_rank[rank]["want_tokens"], where
            assert got["gathered_tokens"] == per_rank[rank]["want_tokens"], where
            assert got["gathered_logits_equal"], where
            assert got["grad_error"] is not None and "zerofx.gathered(model) is for inference" in got["grad_error"]
            # stage 3 holds the whole parameters while inside; stages 1 and 2 keep them anyway
            assert got["gathered_nbytes"] == (got["expected_nbytes"] if stage == 3 else 0), where
            if stage == 3:
                assert got["gathered_nbytes"] > 0


def test_load_hf_refuses_another_models_checkpoint_with_the_model_untouched(trained):
    folder, _ = trained
    other = hs.tiny_llama(seed=3, hidden=48)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ZeroFXError, match=r"does not fit this LlamaForCausalLM: model\.embed_tokens\.weight has shape"):
        ck.load_hf(folder / "hf", other)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    with pytest.raises(ZeroFXError, match="not a folder with .safetensors files"):
        ck.load_hf(folder / "ckpt", other)


def test_load_hf_into_an_unsharded_model(trained):
    folder, params = trained
    model = hs.tiny_llama(seed=11)
    ck.load_hf(folder / "hf", model)
    assert all(torch.equal(model.state_dict()[k], params[k]) for k in params)


def test_export_refuses_an_existing_folder_and_leaves_nothing_when_it_fails(trained, tmp_path, monkeypatch):
    folder, _ = trained
    (tmp_path / "taken").mkdir()
    with pytest.raises(ZeroFXError, match="already exists; choose a new folder"):
        ck.export(folder / "ckpt", tmp_path / "taken")
    with pytest.raises(ZeroFXError, match="to='onnx'"):
        ck.export(folder / "ckpt", tmp_path / "x", to="onnx")
    with pytest.raises(ZeroFXError, match="is incomplete|does not exist"):
        ck.export(folder / "hf", tmp_path / "x")  # not a zerofx checkpoint

    calls = []
    real = ck._write_file

    def fail_on_second(file, *args):
        calls.append(file)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(file, *args)

    monkeypatch.setattr(ck, "_write_file", fail_on_second)
    with pytest.raises(OSError, match="disk full"):
        ck.export(folder / "ckpt", tmp_path / "partial", max_shard_bytes=40_000)
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no output, no temporary folder


def test_convert_command_line(trained, tmp_path, capsys):
    folder, params = trained
    assert cli_main(["convert", str(folder / "ckpt"), str(tmp_path / "out"), "--max-shard-size", "50KB"]) == 0
    assert "zerofx convert: wrote" in capsys.readouterr().out
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(files) == 2  # ~75 kB of fp32 parameters in files of at most 50 kB
    assert cli_main(["convert", str(folder / "ckpt"), str(tmp_path / "out")]) == 1
    assert "already exists" in capsys.readouterr().err
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 << 20 and parse_size("1024") == 1024
    with pytest.raises(ValueError, match="is not a size"):
        parse_size("5 parsecs")


_RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from torch import nn
    import zerofx.checkpoint as ck
    from zerofx.measure.allocations import peak_rss_bytes, reset_peak_rss
    folder, shard = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(16)])  # 64 MiB fp32
    ck.save(folder + "/ckpt", model)
    ck.export(folder + "/ckpt", folder + "/warm", to="torch")  # the first load imports DCP's reader side
    del model
    import gc; gc.collect()
    reset_peak_rss()
    import zerofx.measure.allocations as a
    base = a.rss_bytes()
    ck.export(folder + "/ckpt", folder + "/out", max_shard_bytes=shard)
    print(json.dumps({"base": base, "peak": peak_rss_bytes()}))
    """
)


def test_export_memory_stays_near_one_output_file(tmp_path):
    """64 MiB of parameters (4 MiB tensors) exported in 16 MiB files: the process's resident
    memory grows by less than two files' worth, and by less than half the model (a whole-model
    export, as zero_to_fp32 does, needs all 64 MiB). Export holds one tensor at a time, so the
    growth follows the largest tensor (its copy, DCP's read of it, what the allocator keeps)."""
    shard = 16 << 20
    run = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(tmp_path), str(shard)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # not the checkout: its zerofx/ (without passes/, codegen/) would shadow the installed one
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(list((tmp_path / "out").glob("*.safetensors"))) == 4
    assert got["peak"] - got["base"] < 2 * shard, got  # 32 MiB: also half the model


@pytest.mark.parametrize("stage", [3, 1])
def test_clip_with_a_0_dim_temperature_trains_bit_for_bit(stage):
    """HF CLIPModel keeps its temperature in a 0-dim parameter (``logit_scale``): no rows to
    shard, so zerofx keeps it whole on every rank and all-reduces its gradient, at every stage;
    training matches the unsharded model bit for bit, clipping included."""
    from zerofx.testing import verify_ranks

    reports = verify_ranks("tests.hf_scenarios:tiny_clip", 2, steps=2, max_grad_norm=0.5, stage=stage)
    for r in reports:
        assert r["ok"], (r["problem"], r["first_divergence"])
        assert len(r["steps"]) == 2


@pytest.mark.parametrize("stage", [3, 1])
def test_mixtral_stacked_experts_over_more_ranks_than_experts_train_bit_for_bit(stage):
    """transformers stacks Mixtral's experts ([2, 96, 32] and [2, 32, 48] here); over 4 ranks
    zerofx splits them along dim 1 (zerofx/ir/layout.py, NOTE: the sharded dim), and training
    matches the unsharded model bit for bit."""
    from torch.distributed.tensor import Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zerofx.testing import verify_ranks

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        model = zerofx.shard(hs.tiny_mixtral()[0], torch.distributed.device_mesh.init_device_mesh("cpu", (4,)))
        placements = {n.rsplit(".", 1)[-1]: p.placements for n, p in model.named_parameters() if "experts" in n}
        assert placements == {"gate_up_proj": (Shard(1),), "down_proj": (Shard(1),)}
    finally:
        torch.distributed.destroy_process_group()
    reports = verify_ranks("tests.hf_scenarios:tiny_mixtral", 4, steps=2, stage=stage)
    for r in reports:
        assert r["ok"], (r["problem"], r["first_divergence"])
        assert len(r["steps"]) == 2


@pytest.mark.parametrize("factory", ["tiny_gpt2", "tiny_t5", "tiny_bert", "tiny_deepseek_v3"])
def test_other_hf_architectures_train_bit_for_bit(factory):
    """Architectures whose parameters differ in kind from Llama's (tests/hf_scenarios.py says how
    each does): two steps at stage 3 on 2 ranks match the unsharded model bit for bit, every
    loss, gradient shard and parameter shard."""
    from zerofx.testing import verify_ranks

    reports = verify_ranks(f"tests.hf_scenarios:{factory}", 2, steps=2)
    for r in reports:
        assert r["ok"], (r["problem"], r["first_divergence"])
        assert len(r["steps"]) == 2


@pytest.mark.parametrize("entry", ["zerofx.compile", "torch.compile"])
def test_gpt2_compiles_to_one_graph_with_transformers_own_loss(tmp_path, entry):
    """GPT-2's class name maps to no loss in transformers, whose ``loss_function`` then logs a
    notice on every lookup; dynamo cannot trace a logger call and would break the forward in
    two there. zerofx.shard keeps the loss transformers picks (zerofx/sharding.py,
    ``_settle_hf_loss_functions``): through ``zerofx.compile`` and through
    ``torch.compile(backend="zerofx")`` on a sharded model, one graph, no break, and the same
    loss as eager."""
    from torch._dynamo.utils import counters
    from transformers.loss.loss_utils import ForCausalLMLoss

    from tests.multirank import one_rank_mesh

    model, batch_fn = hs.tiny_gpt2()
    lm = model.model
    assert lm.loss_type is None and "_loss_function" not in vars(lm)
    batch = batch_fn(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(*batch)
    with one_rank_mesh(str(tmp_path)) as mesh:
        torch._dynamo.reset()
        counters.clear()
        if entry == "zerofx.compile":
            zerofx.compile(model, mesh)
            run = model
        else:
            zerofx.shard(model, mesh)
            run = torch.compile(model, backend="zerofx")
        loss = run(*batch)
        loss.backward()
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] == 1
    assert "_loss_function" in vars(lm) and lm.loss_function is ForCausalLMLoss
    assert torch.equal(loss.detach(), eager)


@pytest.mark.parametrize("factory", ["tiny_llama_checkpointed", "tiny_t5_checkpointed"])
def test_models_that_checkpoint_their_own_layers_train_bit_for_bit(factory):
    """transformers' activation checkpointing under torch.compile rounds otherwise than the eager
    model; taken over by zerofx.compile (zerofx/layer_checkpointing.py), two steps at stage 3
    on 2 ranks match the unsharded model bit for bit."""
    from zerofx.testing import verify_ranks

    reports = verify_ranks(f"tests.hf_scenarios:{factory}", 2, steps=2)
    for r in reports:
        assert r["ok"], (r["problem"], r["first_divergence"])


def _layer_flags(model) -> list[str]:
    return sorted(n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False))


def test_layer_checkpointing_is_taken_over_only_where_zerofx_can_do_it():
    """``take_over``: transformers' plain checkpointing (every layer, every other layer, with
    offload) becomes checkpoint_modules (and offload_activations='host'), every flag off, and
    again on a second call (compiling the model again); a selective policy (``context_fn``)
    stays the model's, flags and options untouched."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from zerofx.layer_checkpointing import take_over

    model = hs.tiny_llama()
    assert take_over(model, zerofx.Options()) == (zerofx.Options(), None)
    model.activation_checkpointing_enable()
    opts, line = take_over(model, zerofx.Options(checkpoint_modules=("lm_head",)))
    assert opts.checkpoint_modules == ("lm_head", "model.layers.0", "model.layers.1")
    assert opts.offload_activations == "none" and "2 layer(s)" in line and _layer_flags(model) == []
    assert take_over(model, zerofx.Options(checkpoint_modules=("lm_head",))) == (opts, line)

    every_other = hs.tiny_llama()
    every_other.activation_checkpointing_enable(every_n_layers=2)
    opts, _ = take_over(every_other, zerofx.Options())
    assert opts.checkpoint_modules == ("model.layers.0",) and _layer_flags(every_other) == []

    offloaded = hs.tiny_llama()
    offloaded.activation_checkpointing_enable(offload=True)
    opts, line = take_over(offloaded, zerofx.Options())
    assert opts.offload_activations == "host" and "offload_activations='host'" in line

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    selective = hs.tiny_llama()
    selective.activation_checkpointing_enable(
        activation_checkpointing_kwargs={
            "use_reentrant": False,
            "context_fn": functools.partial(create_selective_checkpoint_contexts, policy),
        }
    )
    flagged = _layer_flags(selective)
    opts, line = take_over(selective, zerofx.Options())
    assert opts == zerofx.Options() and "keep their own activation checkpointing" in line
    assert _layer_flags(selective) == flagged and "model.layers.0" in flagged


def test_a_taken_over_model_builds_no_kv_cache_in_training(tmp_path):
    """transformers skips the KV cache in a training forward of a checkpointed model (its decoder
    stack's flag says so); taking the layers over turned every flag off, and a training forward
    then returned every layer's keys and values, alive through the backward (about 20% of a
    4-layer Llama's peak). Without gradients (evaluation, generation) the cache is built as before."""
    from tests.multirank import one_rank_mesh

    model = hs.tiny_llama()
    model.activation_checkpointing_enable()
    with one_rank_mesh(str(tmp_path)) as mesh:
        zerofx.compile(model, mesh)
        tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        model.train()
        out = model(input_ids=tokens, labels=tokens)
        out.loss.backward()
        assert out.past_key_values is None
        with torch.no_grad():
            assert model(input_ids=tokens).past_key_values is not None
        # use_cache given positionally (input_ids, attention_mask, position_ids, past_key_values,
        # inputs_embeds, labels, use_cache): replaced where it is, not given twice
        assert model(tokens, None, None, None, None, tokens, True).past_key_values is None

    class Wrapper(nn.Module):  # a user's module around the transformers model
        def __init__(self):
            super().__init__()
            self.lm = hs.tiny_llama()

        def forward(self, tokens):
            return self.lm(input_ids=tokens, labels=tokens)

    wrapped = Wrapper()
    wrapped.lm.activation_checkpointing_enable()
    with one_rank_mesh(str(tmp_path / "wrapped")) as mesh:
        zerofx.compile(wrapped, mesh)
        out = wrapped.train()(tokens)
        out.loss.backward()
        assert out.past_key_values is None


def _saved_after_compile(mesh, enable: str) -> int:
    """Bytes the forward of a small Llama (2 layers, width 128, 48 tokens) leaves saved for its
    backward under zerofx, with transformers' activation checkpointing set ``enable``: "never",
    "before" zerofx.compile (taken over) or "after" it (torch.utils.checkpoint calls)."""
    model = hs.tiny_llama(hidden=128).train()
    if enable == "before":
        model.activation_checkpointing_enable()
    zerofx.compile(model, mesh)
    if enable == "after":
        model.activation_checkpointing_enable()
    x = torch.randint(0, hs.VOCAB, (4, 48), generator=torch.Generator().manual_seed(1))
    try:
        with zerofx.MemoryTracker() as mem:
            model(input_ids=x, labels=x).loss.backward()
    finally:
        torch._dynamo.reset()
    return max(mem.summary()["saved_at_boundary"])


def test_layer_checkpointing_frees_the_layers_activations_whether_taken_over_or_not(tmp_path):
    """transformers' activation checkpointing lowers what the forward saves under zerofx, set
    before zerofx.compile (its checkpoint pass recomputes the layers) or after it (the model's
    torch.utils.checkpoint calls are regions of the plan): it used to save as much as without."""
    from tests.multirank import one_rank_mesh

    with one_rank_mesh(str(tmp_path)) as mesh:  # its own group: other tests here make theirs
        never, before, after = (_saved_after_compile(mesh, e) for e in ("never", "before", "after"))
    assert before < 0.25 * never and after < 0.25 * never, (never, before, after)


def test_gathered_needs_a_sharded_model():
    with pytest.raises(ZeroFXError, match="not sharded by zerofx"):
        with zerofx.gathered(nn.Linear(2, 2)):
            pass


@pytest.mark.parametrize("optim", ["adamw_torch", "adafactor"])
def test_hf_trainer_trains_like_the_unsharded_trainer(tmp_path, optim):
    """ZeroFXTrainer on 2 ranks started by torchrun's launcher (zerofx.launch.local_ranks), 3
    steps of 2 accumulated micro-batches of 2 per rank, against the plain Trainer in one process
    with micro-batches of 4: the same 8 samples per step. The two sum each step's token losses
    and gradients in another association (per rank, then across ranks), so fp32 results differ
    by rounding only: measured 1e-7 relative on losses and grad norms and 8e-7 absolute on the
    parameters after 3 AdamW steps (lr 1e-2); the tolerances below are ten times that. With
    ``optim="adafactor"`` the Trainer builds transformers' Adafactor, which zerofx steps over
    whole tensors (zerofx/runtime/whole_step.py), within the same tolerances."""
    from zerofx.launch import local_ranks

    reference = hs.unsharded_trainer(str(tmp_path / "ref"), 2, optim)
    per_rank = local_ranks(hs.zerofx_trainer, 2, str(tmp_path / "zerofx"), 3, optim)
    want = reference["history"]
    assert len(want) == hs.TRAINER_STEPS
    for rank, got in enumerate(per_rank):
        assert len(got["history"]) == hs.TRAINER_STEPS, rank
        for step, (g, w) in enumerate(zip(got["history"], want)):
            for key in ("loss", "grad_norm"):
                assert abs(g[key] - w[key]) <= 1e-6 * abs(w[key]), (rank, step, key, g[key], w[key])
    saved = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "zerofx" / "saved").state_dict()
    assert set(saved) == set(reference["params"])
    for k, v in reference["params"].items():
        torch.testing.assert_close(saved[k], v, rtol=0, atol=1e-5, msg=k)
    assert not any(p.name.startswith(".") for p in (tmp_path / "zerofx").iterdir())  # staging removed


def test_hf_trainer_activation_checkpointing_is_done_by_zerofx(tmp_path):
    """``TrainingArguments(activation_checkpointing=True)``: ZeroFXTrainer sets it on the layers
    as the Trainer would and zerofx.compile takes it over (zerofx/layer_checkpointing.py): its
    checkpoint pass recomputes both decoder layers, no layer runs torch.utils.checkpoint (the
    Trainer does not set it again), the user's arguments are left as they were, and training
    follows the plain Trainer with checkpointing within the tolerances of the test above."""
    from zerofx.launch import local_ranks

    reference = hs.unsharded_trainer(str(tmp_path / "ref"), 2, checkpointing=True)
    per_rank = local_ranks(hs.zerofx_trainer, 2, str(tmp_path / "zerofx"), 3, "adamw_torch", True, name="hf-ac")
    for rank, got in enumerate(per_rank):
        assert got["checkpoint_modules"] == ("model.layers.0", "model.layers.1"), got
        assert "done by zerofx's checkpoint pass" in got["checkpoint_report"]
        assert got["layers_flagged"] == [] and got["args_kept"] is True
        assert len(got["history"]) == hs.TRAINER_STEPS, rank
        for step, (g, w) in enumerate(zip(got["history"], reference["history"])):
            for key in ("loss", "grad_norm"):
                assert abs(g[key] - w[key]) <= 1e-6 * abs(w[key]), (rank, step, key, g[key], w[key])


def test_hf_trainer_trains_and_saves_a_peft_lora_model_as_the_plain_trainer_does(tmp_path):
    """A PEFT LoRA model (the base frozen, adapters on q and v) in ZeroFXTrainer on 2 ranks,
    against the plain Trainer in one process, as above. ZeroFXTrainer refused PEFT models
    ("needs transformers >= 5": the check read the wrapper's class), and its save_model wrote
    the whole model under PEFT's key names, which neither from_pretrained loads. It now writes
    what the plain Trainer writes, the adapters (adapter_config.json, adapter_model.safetensors,
    the same keys and values up to rounding), and loads them back as a checkpoint."""
    from zerofx.launch import local_ranks

    reference = hs.unsharded_lora_trainer(str(tmp_path / "ref"), 2)
    per_rank = local_ranks(hs.zerofx_lora_trainer, 2, str(tmp_path / "zerofx"), name="hf-lora")
    for rank, got in enumerate(per_rank):
        assert len(got["history"]) == hs.TRAINER_STEPS, rank
        for step, (g, w) in enumerate(zip(got["history"], reference["history"])):
            for key in ("loss", "grad_norm"):
                assert abs(g[key] - w[key]) <= 1e-6 * abs(w[key]), (rank, step, key, g[key], w[key])
        assert got["moved_by_load"] > 1e-3 and got["loaded_vs_trained"] == 0.0, got
    ours, theirs = tmp_path / "zerofx" / "saved", tmp_path / "ref" / "saved"
    configs = [json.loads((folder / "adapter_config.json").read_text()) for folder in (ours, theirs)]
    for config in configs:  # PEFT keeps them as a set: their order follows each process's hash seed
        config["target_modules"] = sorted(config["target_modules"])
    assert configs[0] == configs[1]
    saved, want = load_file(ours / "adapter_model.safetensors"), load_file(theirs / "adapter_model.safetensors")
    assert set(saved) == set(want) and len(want) == 8, sorted(saved)
    for k, v in want.items():
        torch.testing.assert_close(saved[k], v, rtol=0, atol=1e-5, msg=k)
    assert not any(ours.glob("model*.safetensors"))


def test_hf_trainer_resumes_from_its_checkpoints_exactly(tmp_path):
    """ZeroFXTrainer saving resumable checkpoints on 2 torchrun-launched ranks: a second launch
    resumed from checkpoint-2 logs steps 3 and 4 exactly as the uninterrupted run did and ends
    with the same parameters, bit for bit (the same world size runs the same collectives on the
    same values, so nothing may differ: a missing optimizer moment, scheduler step or data
    position would). Resumed from the same checkpoint without its zerofx_state/ (what
    save_only_model writes), the model comes from the safetensors: step 3's loss and gradient
    norm, computed before any optimizer step, are again exactly the first run's, and step 4's
    differ, its AdamW moments starting from zero. With load_best_model_at_end (and "best" the
    highest evaluation loss, so checkpoint-2 rather than the last), the model evaluated after
    training is checkpoint-2's: its evaluation loss is exactly the one logged at step 2."""
    from zerofx.hf import STATE_DIR
    from zerofx.launch import local_ranks

    first = local_ranks(hs.trainer_checkpoints, 2, str(tmp_path), name="hf-save")
    files = first[0]["files"]
    assert STATE_DIR in files and "model.safetensors" in files and "scheduler.pt" in files, files
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= set(files), files
    assert (tmp_path / "run" / "checkpoint-4" / STATE_DIR / ck.COMPLETE_MARKER).is_file()
    # each checkpoint's parameters written once: its zerofx_state (with the optimizer) is also
    # what its safetensors are exported from
    assert first[0]["io"] == [("save", "checkpoint-2", True, True), ("save", "checkpoint-4", True, True)], first[0][
        "io"
    ]
    for rank, got in enumerate(first):
        assert got["best_checkpoint"] == "checkpoint-2" and len(got["evals"]) == 2, (rank, got["best_checkpoint"])
        assert got["evals"][0] > got["evals"][1], (rank, got["evals"])
        assert got["final_eval"] == got["evals"][0], (rank, got["final_eval"], got["evals"])
    resumed = local_ranks(hs.trainer_resumed, 2, str(tmp_path), name="hf-resume")
    # the model read once: before the optimizer exists, then only the optimizer's state
    assert resumed[0]["io"] == [("load", "checkpoint-2", False, True), ("load", "checkpoint-2", True, False)]
    for rank in range(2):
        whole, again = first[rank], resumed[rank]
        assert len(whole["history"]) == hs.RESUME_STEPS, rank
        # steps 1-2 come back with trainer_state.json; steps 3-4 are the resumed run's own
        assert again["history"] == whole["history"], (rank, again["history"], whole["history"])
        assert [k for k in whole["params"] if not torch.equal(again["params"][k], whole["params"][k])] == [], rank
        model_only = again["model_only"]
        assert len(model_only) == hs.RESUME_STEPS and model_only[2] == whole["history"][2], (rank, model_only)
        assert model_only[3]["loss"] != whole["history"][3]["loss"], (rank, model_only, whole["history"])


def test_accelerate_loop_trains_like_the_plain_loop(tmp_path):
    """A custom accelerate loop (Accelerator, accumulate(), backward, clip_grad_norm_) on a zerofx
    model prepared with zerofx.hf.prepare, 2 torchrun-launched ranks, 3 steps of 2 accumulated
    micro-batches: the ranks' mean losses and the clipped gradient norms match the plain loop in
    one process on the whole micro-batches to rounding (another summation order: the Trainer
    test's tolerances), and so do the parameters. accumulate() found model.no_sync: the first
    micro-batch of each step ran no reduce-scatter, the second ran them."""
    from zerofx.launch import local_ranks

    want = hs.accelerate_reference(2)
    per_rank = local_ranks(hs.accelerate_loop, 2, 2, name="accelerate")
    micro = hs.ACCELERATE_STEPS * hs.TRAINER_ACCUMULATION
    assert [len(r["losses"]) for r in per_rank] == [micro, micro]
    for j in range(micro):
        mean = sum(r["losses"][j] for r in per_rank) / 2
        assert abs(mean - want["losses"][j]) <= 1e-6 * want["losses"][j], (j, mean, want["losses"][j])
    for rank, got in enumerate(per_rank):
        assert len(got["norms"]) == hs.ACCELERATE_STEPS, rank
        for step, (g, w) in enumerate(zip(got["norms"], want["norms"])):
            assert abs(g - w) <= 1e-6 * w, (rank, step, g, w)
        assert got["reduces"][0::2] == [0] * hs.ACCELERATE_STEPS, (rank, got["reduces"])
        assert all(n > 0 for n in got["reduces"][1::2]), (rank, got["reduces"])
        for k, v in want["params"].items():
            torch.testing.assert_close(got["params"][k], v, rtol=0, atol=1e-5, msg=k)
    # rank-0 saving paths: accelerate's save_state / load_state would write and hand every rank
    # rank 0's shards, save_pretrained of the shards failed on rank 0 alone; whole tensors save
    for rank, got in enumerate(per_rank):
        saving = got["saving"]
        for name in ("save_state", "load_state"):
            assert "from the main process only" in saving[name] and "zerofx.checkpoint.save" in saving[name], saving
        assert "the parameters are zerofx shards" in saving["save_pretrained"], saving
    assert per_rank[0]["saving"]["whole_written"]
    # accelerate's get_state_dict / save_model: the whole tensors on every rank, and in the file
    for rank, got in enumerate(per_rank):
        assert got["saving"]["get_state_dict_whole"], (rank, got["saving"])
    assert per_rank[0]["saving"]["save_model_written"], per_rank[0]["saving"]


def test_accelerate_prepare_needs_a_zerofx_model():
    from zerofx.hf import prepare

    with pytest.raises(ZeroFXError, match="none of the objects is a model zerofx compiled"):
        prepare(object(), nn.Linear(2, 2))


def test_hf_trainer_refuses_deepspeed_or_fsdp_in_the_same_run(tmp_path):
    from zerofx.hf import ZeroFXTrainer

    args = hs.trainer_args(str(tmp_path), 2)
    args.fsdp = "full_shard"
    with pytest.raises(ZeroFXError, match="drop TrainingArguments' deepspeed / fsdp"):
        ZeroFXTrainer(model=hs.tiny_llama(), args=args, train_dataset=hs.TokenDataset())


def test_hf_trainer_refuses_a_deepspeed_config_that_contradicts_training_arguments(tmp_path):
    from tests.multirank import one_rank_mesh
    from zerofx.hf import ZeroFXTrainer

    config = {"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 8, "gradient_clipping": "auto"}
    with one_rank_mesh(str(tmp_path / "pg")) as mesh:
        args = hs.trainer_args(str(tmp_path / "run"), 2)  # accumulation 2
        with pytest.raises(ZeroFXError, match=r"gradient_accumulation_steps=8 but TrainingArguments give 2"):
            ZeroFXTrainer(
                model=hs.tiny_llama(), args=args, train_dataset=hs.TokenDataset(), mesh=mesh, zerofx_config=config
            )


def test_hf_trainer_refuses_optimizer_and_scheduler_sections_that_train_otherwise(tmp_path):
    """HF's DeepSpeed integration trains with the config's optimizer and scheduler and refuses
    explicit values TrainingArguments contradict; the Trainer here builds both from the
    arguments, so such a section used to be a warning and a run with another learning rate,
    betas, weight decay and schedule (zerofx/hf.py, NOTE: the config's optimizer and scheduler)."""
    from tests.multirank import one_rank_mesh
    from zerofx.hf import ZeroFXTrainer

    optimizer = {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}
    scheduler = {
        "type": "WarmupDecayLR",
        "params": {"warmup_max_lr": 3e-4, "warmup_num_steps": 10, "warmup_type": "linear"},
    }
    with one_rank_mesh(str(tmp_path / "pg")) as mesh:

        def trainer(config, **arguments):
            args = hs.trainer_args(str(tmp_path / "run"), 1, **arguments)
            config = {"zero_optimization": {"stage": 3}, **config}
            return ZeroFXTrainer(
                model=hs.tiny_llama(), args=args, train_dataset=hs.TokenDataset(), mesh=mesh, zerofx_config=config
            )

        with pytest.raises(ZeroFXError) as refused:
            trainer({"optimizer": optimizer, "scheduler": scheduler})
        said = str(refused.value)
        for part in ("optimizer.params.lr=0.0003", "betas=[0.9, 0.95]", "weight_decay=0.1", "warmup_max_lr=0.0003"):
            assert part in said, said
        with pytest.raises(ZeroFXError, match=r"scheduler.type='WarmupLR' but .* lr_scheduler_type='constant'"):
            trainer({"scheduler": {"type": "WarmupLR", "params": {}}})
        with pytest.raises(ZeroFXError, match=r"optimizer.type='Lamb'"):
            trainer({"optimizer": {"type": "Lamb", "params": {}}})
        with pytest.raises(ZeroFXError, match=r"adam_w_mode=false"):
            trainer(
                {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}}, weight_decay=0.1
            )
        linear = {"type": "WarmupLR", "params": {"warmup_type": "linear"}}
        with pytest.raises(ZeroFXError, match=r"warmup_type='log' \(DeepSpeed's default: log\)"):
            trainer(
                {"scheduler": {"type": "WarmupLR", "params": {}}},
                lr_scheduler_type="constant_with_warmup",
                warmup_steps=5,
            )
        with pytest.raises(ZeroFXError, match=r"warmup_num_steps=100 but TrainingArguments give 1"):
            trainer(
                {"scheduler": {**linear, "params": {"warmup_num_steps": 100}}}, lr_scheduler_type="constant_with_warmup"
            )
        decay = {"type": "WarmupDecayLR", "params": {"total_num_steps": 1000, "warmup_type": "linear"}}
        with pytest.raises(ZeroFXError, match=r"total_num_steps=1000 but TrainingArguments give"):
            trainer({"scheduler": decay}, lr_scheduler_type="linear")
        # what the arguments give (or "auto") is what HF would fill in: accepted, with one warning
        with pytest.warns(UserWarning, match="sections are not used"):
            trainer(
                {"optimizer": optimizer, "scheduler": scheduler},
                learning_rate=3e-4,
                adam_beta2=0.95,
                weight_decay=0.1,
                warmup_steps=10,
                lr_scheduler_type="linear",
            )
        with pytest.warns(UserWarning, match="sections are not used"):
            trainer({"optimizer": {"type": "Adam", "params": dict.fromkeys(optimizer["params"], "auto")}})


def test_hf_trainer_fills_deepspeed_precision_auto_from_its_flags(tmp_path):
    """bf16.enabled="auto" under --bf16 is bf16 training (bf16 parameters, fp32 master weights),
    as HF's DeepSpeed integration resolves it; without the flag it is fp32; an explicit value the
    flag contradicts is an error naming both. The bf16 run trains: finite losses, bf16 gathers."""
    from tests.multirank import one_rank_mesh
    from zerofx.hf import ZeroFXTrainer
    from zerofx.sharding import runtime_of

    config = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}
    with one_rank_mesh(str(tmp_path / "pg")) as mesh:
        for bf16, want in ((True, torch.bfloat16), (False, None)):
            args = hs.trainer_args(str(tmp_path / f"run{bf16}"), 2, bf16=bf16, max_steps=2)
            trainer = ZeroFXTrainer(
                model=hs.tiny_llama(), args=args, train_dataset=hs.TokenDataset(), mesh=mesh, zerofx_config=config
            )
            assert runtime_of(trainer.model).options.param_dtype is want, bf16
            if bf16:
                trainer.train()
                losses = [h["loss"] for h in hs.trainer_history(trainer)]
                assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), losses
                assert all(p.dtype is torch.float32 for p in trainer.model.parameters())  # the master copy
        args = hs.trainer_args(str(tmp_path / "keyword"), 2)  # no --bf16: "auto" yields to a keyword
        trainer = ZeroFXTrainer(
            model=hs.tiny_llama(),
            args=args,
            train_dataset=hs.TokenDataset(),
            mesh=mesh,
            zerofx_config=config,
            zerofx_options={"param_dtype": torch.bfloat16},
        )
        assert runtime_of(trainer.model).options.param_dtype is torch.bfloat16
        args = hs.trainer_args(str(tmp_path / "clash"), 2)
        # DeepSpeed reads "true" as on: that clashes with no --bf16 as True does
        for enabled in (True, "true"):
            explicit = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": enabled}}
            with pytest.raises(ZeroFXError, match=rf"bf16\.enabled={enabled!r} but TrainingArguments give bf16=False"):
                ZeroFXTrainer(
                    model=hs.tiny_llama(), args=args, train_dataset=hs.TokenDataset(), mesh=mesh, zerofx_config=explicit
                )


def test_hf_trainer_scales_an_fp16_loss_and_skips_overflowing_steps(tmp_path, monkeypatch):
    """--fp16 with a DeepSpeed fp16 config: the Trainer backpropagates the loss scaled by zerofx's
    scaler, unscales before it clips, and skips a step whose gradients overflow (parameters and the
    schedule untouched, the scale lowered), as DeepSpeed does. Nothing used the scaler before: an
    unscaled fp16 backward, whose small gradients underflow, and no step was ever skipped. From
    2^40 every scaled gradient overflows fp16; from DeepSpeed's 2^16 the run trains, every step
    after the first on the local shards (accelerate's wrapper used to put the DTensor step back)."""
    from tests.multirank import one_rank_mesh
    from zerofx.hf import ZeroFXTrainer
    from zerofx.runtime import local_step

    local_steps = []
    step_locally = local_step._local_step
    monkeypatch.setattr(local_step, "_local_step", lambda *a, **k: local_steps.append(1) or step_locally(*a, **k))

    fp16 = {"enabled": "auto", "hysteresis": 1}
    with one_rank_mesh(str(tmp_path / "pg")) as mesh:
        for power, steps in ((40, 2), (16, 3)):
            config = {"zero_optimization": {"stage": 3}, "fp16": {**fp16, "initial_scale_power": power}}
            args = hs.trainer_args(
                str(tmp_path / f"p{power}"), 2, fp16=True, max_steps=steps, max_grad_norm=1.0, warmup_steps=steps
            )
            trainer = ZeroFXTrainer(
                model=hs.tiny_llama(), args=args, train_dataset=hs.TokenDataset(), mesh=mesh, zerofx_config=config
            )
            before = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}
            trainer.train()
            after = {n: p.full_tensor() for n, p in trainer.model.named_parameters()}
            scaler, history = zerofx.loss_scaler(trainer.model), hs.trainer_history(trainer)
            if power == 40:
                assert scaler.get_scale() == 2.0**38, scaler.get_scale()  # halved at each overflow
                assert all(torch.equal(before[n], after[n]) for n in before)
                assert trainer.lr_scheduler.last_epoch == 0  # the Trainer skipped the schedule too
                assert all(not math.isfinite(h["grad_norm"]) for h in history), history
            else:
                assert scaler.get_scale() == 2.0**16, scaler.get_scale()
                assert trainer.lr_scheduler.last_epoch == steps
                assert not all(torch.equal(before[n], after[n]) for n in before)
                # measured on the unscaled gradients (scaled, they would read 65536x larger)
                assert all(0 < h["grad_norm"] < 100 for h in history), history
                assert len(local_steps) == steps - 1, local_steps  # the first adopts the optimizer
                trainer.args.max_steps = 1  # two more runs of one step: each counts its step from 0
                for more in range(2):
                    trainer.train()
                    again = hs.trainer_history(trainer)  # (the new run's state and log)
                    assert len(again) == 1 and 0 < again[0]["grad_norm"] < 100, again  # unscaled as before
                    assert len(local_steps) == steps + more, local_steps


def test_hf_trainer_full_eval_flags_evaluate_at_the_param_dtype(tmp_path):
    """--bf16_full_eval: the Trainer casts the whole model for evaluation (model.to(dtype=...)),
    which failed on a zerofx model (and so did its move to args.device before training: under
    torchrun that is .to("cpu:0"), a copy of a CPU tensor, tests/test_api.py; here args.device is
    "cpu"). The model computes in bf16 already: evaluation
    before and after training runs, at the eval loss of the same bf16 model without the flag. A
    flag the model's param_dtype does not match is an error before training."""
    from tests.multirank import one_rank_mesh
    from zerofx.hf import ZeroFXTrainer

    config = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}
    with one_rank_mesh(str(tmp_path / "pg")) as mesh:
        losses = {}
        for full in (True, False):
            args = hs.trainer_args(str(tmp_path / f"full{full}"), 2, bf16=True, bf16_full_eval=full, max_steps=1)
            trainer = ZeroFXTrainer(
                model=hs.tiny_llama(),
                args=args,
                train_dataset=hs.TokenDataset(),
                eval_dataset=hs.TokenDataset(n=8),
                mesh=mesh,
                zerofx_config=config,
            )
            first = trainer.evaluate()["eval_loss"]
            trainer.train()
            losses[full] = (first, trainer.evaluate()["eval_loss"])
        assert losses[True] == losses[False] and all(math.isfinite(x) for x in losses[True]), losses
        args = hs.trainer_args(str(tmp_path / "fp32"), 2, bf16_full_eval=True)
        with pytest.raises(
            ZeroFXError, match=r"--bf16_full_eval casts the model .* param_dtype \(torch.float32 here\)"
        ):
            ZeroFXTrainer(
                model=hs.tiny_llama(), args=args, train_dataset=hs.TokenDataset(), mesh=mesh, zerofx_options={}
            )


def test_a_model_built_on_meta_is_never_whole_on_any_rank(trained):
    """Built under torch.device("meta"), compiled on 2 ranks: at stage 3 sharding allocates each
    rank's rows only (half the model, plus uneven rows) and load_hf reads exactly those rows out
    of the files, no more; a forward before loading is refused by name; HF's own init recomputes
    the rotary buffers no checkpoint holds. Stage 2 keeps whole copies by design, so there only
    the loading is checked."""
    folder, params = trained
    per_rank = run_ranks(hs.meta_load_and_generate, 2, str(folder), [3, 2], timeout=600)
    for stage in (3, 2):
        for rank, got in enumerate(scenario_results(per_rank, f"stage{stage}")):
            where = f"stage {stage}, rank {rank}"
            assert "built on the meta device" in got["refused"] and "never loaded" in got["refused"], where
            assert got["unloaded"] == [] and got["rotary_equal"], where
            assert got["params_equal"] == sorted(params), where
            assert got["tokens"] == per_rank[rank]["want_tokens"], where
            assert got["read_bytes"] == got["local_bytes"], (where, got["read_bytes"], got["local_bytes"])
            if stage == 3:
                whole = per_rank[rank]["whole_bytes"]
                assert got["local_bytes"] <= 0.55 * whole, (where, got["local_bytes"], whole)
                assert got["shard_peak"] <= 0.55 * whole, (where, got["shard_peak"], whole)


def test_mixing_meta_and_real_tensors_is_refused(tmp_path):
    from tests.multirank import one_rank_mesh

    model = hs.tiny_llama()
    with torch.device("meta"):
        model.lm_head = nn.Linear(32, hs.VOCAB, bias=False)
    with one_rank_mesh(str(tmp_path / "pg")) as mesh:
        with pytest.raises(ZeroFXError, match=r"lm_head\.weight is on the meta device but .* is not"):
            zerofx.compile(model, mesh)
