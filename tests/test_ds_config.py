"""DeepSpeed configs translated into zerofx options (zerofx/ds_config.py): every key of a typical
HF-style config, "auto" resolution, keywords against the config, and bad configs."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

import zerofx
from tests.multirank import one_rank_mesh
from zerofx import ZeroFXError
from zerofx.ds_config import from_deepspeed, hidden_size_of, merge_with_keywords
from zerofx.runtime.loss_scaling import HysteresisGradScaler, ZeroFXGradScaler, make_loss_scaler
from zerofx.runtime.params import runtime_of

# the shape of transformers' own ZeRO-3 example config (docs: "ZeRO-3 Example"), values as users set them
HF_ZERO3 = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def test_a_typical_hf_zero3_config_maps_every_key():
    t = from_deepspeed(HF_ZERO3, hidden_size=64)
    assert t.options == {
        "stage": 3,
        "offload_optimizer": "disk",
        "offload_dir": "/local_nvme",
        "bucket_bytes": 64 * 64 * 4,
        "prefetch_bytes": int(0.9 * 64 * 64) * 4,
        "persistence_threshold": 640,
    }
    assert t.from_auto == {"bucket_bytes", "prefetch_bytes", "persistence_threshold"}
    assert set(t.training) == {
        "gradient_accumulation_steps",
        "gradient_clipping",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "optimizer",
        "scheduler",
    }
    text = "\n".join(t.warnings)
    for key in (
        "bf16.enabled",
        "fp16.enabled",
        "sub_group_size",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "stage3_gather_16bit_weights_on_model_save",
        "steps_per_print",
        "wall_clock_breakdown",
        "gradient_clipping",
        "optimizer=AdamW",
    ):
        assert key in text, key  # every key with no effect here is named, none dropped silently


def test_deepspeeds_field_names_read_as_its_stage3_keys():
    """DeepSpeed's config model takes ``prefetch_bucket_size`` for ``stage3_prefetch_bucket_size``
    (and so on): both spellings give the same options and warnings; its NVMe ``aio`` section has
    no effect here and is named."""
    stage3 = {
        "stage": 3,
        "stage3_prefetch_bucket_size": 1000,
        "stage3_param_persistence_threshold": 10,
        "stage3_max_live_parameters": 5,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    fields = {k.removeprefix("stage3_"): v for k, v in stage3.items()}
    a = from_deepspeed({"zero_optimization": stage3})
    b = from_deepspeed({"zero_optimization": fields, "aio": {"block_size": 1048576}})
    assert a.options == b.options == {"stage": 3, "prefetch_bytes": 4000, "persistence_threshold": 10}
    assert "stage3_max_live_parameters" in "\n".join(b.warnings) and "aio" in "\n".join(b.warnings)


def test_precision_stage_and_communication_keys():
    t = from_deepspeed(
        {
            "zero_optimization": {
                "stage": 2,
                "reduce_bucket_size": 1000,
                "overlap_comm": False,
                "offload_optimizer": {"device": "cpu"},
            },
            "bf16": {"enabled": True},
            "communication_data_type": "fp32",
            "gradient_clipping": 1.0,
        }
    )
    assert t.options == {
        "stage": 2,
        "param_dtype": torch.bfloat16,
        "reduce_dtype": torch.float32,
        "disable_passes": ("schedule",),
        "offload_optimizer": "host",
        "bucket_bytes": 4000,
    }
    assert t.training == {"gradient_clipping": 1.0}
    fp16 = from_deepspeed(
        {
            "zero_optimization": {"stage": 1},
            "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 2},
        }
    )
    assert fp16.options == {
        "stage": 1,
        "param_dtype": torch.float16,
        "loss_scale": "dynamic",
        "initial_loss_scale": 4096.0,
        "loss_scale_window": 500,
        "loss_scale_hysteresis": 2,
        "min_loss_scale": 1.0,  # DeepSpeed's floor, the key being absent
    }
    assert fp16.from_auto == {"min_loss_scale"} and not any("hysteresis" in w for w in fp16.warnings)
    ac = from_deepspeed(
        {
            "zero_optimization": {"stage": 3},
            "activation_checkpointing": {"cpu_checkpointing": True, "partition_activations": True},
        }
    )
    assert ac.options == {"stage": 3, "checkpoint": "full", "offload_activations": "host"}
    assert any("partition_activations" in w for w in ac.warnings)


def test_newer_deepspeed_keys_map_or_say_they_have_no_effect():
    t = from_deepspeed(
        {
            "zero_optimization": {"stage": 3},
            "bf16": {"enabled": True},
            "data_types": {"grad_accum_dtype": "fp32"},
            "torch_autocast": {"enabled": False},
            "sparse_gradients": False,
            "compile": {"deepcompile": True},
        }
    )
    assert t.options == {"stage": 3, "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    assert any(w.startswith("compile") and "no effect" in w for w in t.warnings), t.warnings
    same = from_deepspeed(
        {
            "zero_optimization": {"stage": 3},
            "communication_data_type": "bf16",
            "data_types": {"grad_accum_dtype": "bf16"},
        }
    )
    assert same.options["reduce_dtype"] is torch.bfloat16
    fp16 = from_deepspeed({"zero_optimization": {"stage": 3}, "fp16": {"enabled": True, "auto_cast": False}})
    assert any("auto_cast" in w for w in fp16.warnings), fp16.warnings


@pytest.mark.parametrize(
    "config, named",
    [
        ({"bf16": {"enabled": True, "immediate_grad_update": True}}, "bf16.immediate_grad_update has no effect"),
        ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "zerofx keeps fp32 master weights"),
        ({"zero_optimization": {"stage": 1, "reduce_bucket_size": 64}}, "reduce_bucket_size: at stage 1"),
    ],
    ids=["immediate_grad_update", "fp16_master_weights", "stage1_reduce_bucket"],
)
def test_precision_and_bucket_keys_zerofx_does_not_follow_are_named(config, named):
    """Keys DeepSpeed acts on and zerofx does not (fp16 masters, stage 1's reduce buckets) were
    taken without a word: each is named in a warning now."""
    t = from_deepspeed({"zero_optimization": {"stage": 3}, **config})
    assert any(named in w for w in t.warnings), t.warnings


@pytest.mark.parametrize(
    "stage, bf16, named",
    [
        (2, {"enabled": True}, "bf16.check_grad_overflow (absent, DeepSpeed's default true): DeepSpeed skips"),
        (1, {"enabled": "auto"}, "bf16.check_grad_overflow (absent, DeepSpeed's default true): DeepSpeed skips"),
        (2, {"enabled": True, "check_grad_overflow": True}, "bf16.check_grad_overflow (true): DeepSpeed skips"),
        (2, {"enabled": True, "check_grad_overflow": False}, None),
        (2, {"enabled": True, "check_grad_overflow": 0}, None),  # DeepSpeed reads 0 as false
        (3, {"enabled": True, "check_grad_overflow": False}, "DeepSpeed's stage 3 skips a step whose gradient norm"),
        (3, {"enabled": True}, "DeepSpeed's stage 3 skips a step whose gradient norm"),
    ],
    ids=["absent", "absent_auto", "true", "false", "zero", "stage3_false", "stage3_absent"],
)
def test_bf16_steps_deepspeed_would_skip_are_named_unless_the_config_turns_skipping_off(stage, bf16, named):
    """DeepSpeed 0.19.8 skips a bf16 step whose gradients hold inf or NaN: at stages 1 and 2 when
    check_grad_overflow is true, its default (stage_1_and_2.py), at stage 3 always (its step skips
    on a non-finite gradient norm, whatever the key). zerofx warned only for a literal true: an
    absent key, DeepSpeed's skipping, was taken in silence. Now the warning goes unless the config
    turns skipping off where DeepSpeed reads the key (stages 1 and 2)."""
    t = from_deepspeed({"zero_optimization": {"stage": stage}, "bf16": bf16})
    said = [w for w in t.warnings + t.bf16_warnings if "check_grad_overflow" in w]
    if named is None:
        assert said == []
    else:
        assert len(said) == 1 and named in said[0], t.warnings


def test_zero_plus_plus_quantization_keys_map_to_the_quantize_options():
    t = from_deepspeed(
        {"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True}}
    )
    assert t.options == {"stage": 3, "quantize_weights": "int8", "quantize_grads": "int8"}
    assert any("quantize_grads='int4'" in w for w in t.int8_grad_warnings)  # said where int8 stays
    off = from_deepspeed({"zero_optimization": {"stage": 3, "zero_quantized_weights": False}})
    assert off.options == {"stage": 3, "quantize_weights": None}


def test_zero_plus_plus_switches_take_a_keyword_format_and_refuse_one_against_an_explicit_off():
    """The qgZ warning's own advice (``quantize_grads='int4'`` beside ``zero_quantized_gradients``)
    was refused as a contradiction; ZeRO++ switches and ``cpu_checkpointing`` written false, or
    ``zero_hpz_partition_size: 1``, let a keyword turn the feature on in silence."""
    on = from_deepspeed(
        {"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True}}
    )
    assert merge_with_keywords(on, {"quantize_grads": "int4"})["quantize_grads"] == "int4"
    assert merge_with_keywords(on, {"quantize_weights": "fp8"})["quantize_weights"] == "fp8"
    assert merge_with_keywords(on, {"quantize_grads": "int8", "quantize_weights": "int8"})
    for other in ({"quantize_grads": None}, {"quantize_weights": None}):
        with pytest.raises(ZeroFXError, match="contradicts the DeepSpeed config, which gives 'int8'"):
            merge_with_keywords(on, other)
    off = from_deepspeed(
        {
            "zero_optimization": {
                "stage": 3,
                "zero_quantized_weights": False,
                "zero_quantized_gradients": "false",
                "zero_hpz_partition_size": 1,
            },
            "activation_checkpointing": {"cpu_checkpointing": False},
        }
    )
    for keyword in (
        {"quantize_weights": "int8"},
        {"quantize_grads": "int4"},
        {"secondary_shard": True},
        {"offload_activations": "disk"},
    ):
        with pytest.raises(ZeroFXError, match=rf"option {next(iter(keyword))}=.* contradicts the DeepSpeed config"):
            merge_with_keywords(off, keyword)
    assert merge_with_keywords(off, {"quantize_weights": None, "secondary_shard": False, "offload_activations": "none"})
    silent = from_deepspeed({"zero_optimization": {"stage": 3}})  # said nothing: keywords decide
    assert merge_with_keywords(silent, {"quantize_grads": "int4", "secondary_shard": True})
    with pytest.raises(ZeroFXError, match=r"^DeepSpeed config: zero_optimization.zero_quantized_weights at stage 2"):
        from_deepspeed({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}})


def test_the_int4_advice_is_given_only_where_gradients_stay_int8(one_rank):
    """zerofx.compile warned "pass quantize_grads='int4'" to a user who had."""
    config = {"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}}
    for keywords, advised in (({}, True), ({"quantize_grads": "int4"}, False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            zerofx.compile(nn.Linear(4, 4), one_rank, config=config, **keywords)
        said = [str(w.message) for w in caught if "quantize_grads='int4' for half the bytes" in str(w.message)]
        assert len(said) == int(advised), (keywords, said)


def test_offload_tuning_keys_are_named_in_a_warning():
    """DeepSpeed's pinned and swap buffers and I/O pipelining keys under an offload section had no
    effect and no warning."""
    keys = ("pin_memory", "buffer_count", "buffer_size", "fast_init", "max_in_cpu", "pipeline_read", "pipeline_write")
    t = from_deepspeed(
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", **dict.fromkeys(keys, True)}}}
    )
    said = [w for w in t.warnings if "DeepSpeed keys zerofx does not follow" in w]
    assert len(said) == 1 and all(f"zero_optimization.offload_optimizer.{k}" in said[0] for k in keys), t.warnings
    off = from_deepspeed(
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none", "pin_memory": True}}}
    )
    assert not [w for w in off.warnings if "pin_memory" in w], off.warnings  # (HF's templates: no offload, no noise)


def test_auto_without_a_hidden_size_falls_back_to_zerofx_auto():
    t = from_deepspeed(HF_ZERO3)
    assert t.options["bucket_bytes"] == "auto" and t.options["prefetch_bytes"] == "auto"
    assert "persistence_threshold" not in t.options
    assert any("needs the model's hidden size" in w for w in t.warnings)


def test_hidden_size_comes_from_an_hf_style_config():
    class Config:
        hidden_size = 48

    model = nn.Linear(2, 2)
    assert hidden_size_of(model) is None
    model.config = Config()
    assert hidden_size_of(model) == 48
    Config.hidden_sizes = [16, 96]
    assert hidden_size_of(model) == 96


@pytest.mark.parametrize(
    "config,message",
    [
        ({"zero_optimisation": {"stage": 3}}, r"unknown key zero_optimisation \(did you mean 'zero_optimization'\?\)"),
        (
            {"zero_optimization": {"stage": 3, "reduce_bucket_sise": 5}},
            r"unknown key zero_optimization.reduce_bucket_sise \(did you mean 'reduce_bucket_size'\?\)",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
            r"offload_param.device=nvme needs nvme_path",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {"device": "cpu"},
                    "offload_optimizer": {"device": "nvme", "nvme_path": "/x"},
                }
            },
            "different devices",
        ),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "offload_param is for stage 3"),
        ({"zero_optimization": {"stage": 0}}, "plain data parallelism"),
        ({"bf16": {"enabled": True}}, r"stage is 0 \(or missing\)"),
        ({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both true"),
        ({"zero_optimization": {"stage": 3}, "fp16": {"enabled": True, "loss_scale": 128}}, "static loss scale"),
        (
            {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}},
            r"zero_hpz_partition_size=8: .*2-D mesh \(nodes, 8\) with secondary_shard=True",
        ),
        ({"zero_optimization": {"stage": 3, "reduce_bucket_size": -1}}, "number of elements"),
        ({"zero_optimization": {"stage": 3}, "gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
        (
            {"zero_optimization": {"stage": 3, "prefetch_bucket_size": 8, "stage3_prefetch_bucket_size": 8}},
            "both prefetch_bucket_size and stage3_prefetch_bucket_size",
        ),
        (
            {"zero_optimization": {"stage": 3}, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
            r"torch_autocast: zerofx does not wrap the model's forward",
        ),
        ({"zero_optimization": {"stage": 3}, "sparse_gradients": True}, "reduces dense gradients only"),
        ({"zero_optimization": {"stage": 1, "zero_quantized_gradients": True}}, "zero_quantized_gradients at stage 1"),
        ({"zero_optimization": {"stage": 3}, "data_types": {"grad_accum_dtype": "int8"}}, "choose one of"),
        (
            {"zero_optimization": {"stage": 3}, "data_types": {"grad_accum": "fp32"}},
            "unknown key data_types.grad_accum",
        ),
        (
            {
                "zero_optimization": {"stage": 3},
                "communication_data_type": "bf16",
                "data_types": {"grad_accum_dtype": "fp32"},
            },
            "reduces gradients in the dtype it accumulates",
        ),
    ],
)
def test_bad_configs_are_clear_errors(config, message):
    with pytest.raises(ZeroFXError, match=message):
        from_deepspeed(config)


def test_bad_paths_and_json(tmp_path):
    with pytest.raises(ZeroFXError, match="cannot read the DeepSpeed config"):
        from_deepspeed(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{stage: 3")
    with pytest.raises(ZeroFXError, match="is not valid JSON"):
        from_deepspeed(broken)
    with pytest.raises(ZeroFXError, match="a dict or the path of a JSON file"):
        from_deepspeed(3)


def test_keywords_override_auto_and_may_not_contradict_the_config():
    t = from_deepspeed(HF_ZERO3, hidden_size=64)
    merged = merge_with_keywords(t, {"bucket_bytes": 1 << 20, "param_dtype": torch.bfloat16})
    assert merged["bucket_bytes"] == 1 << 20 and merged["param_dtype"] is torch.bfloat16
    with pytest.raises(ZeroFXError, match=r"option stage=2 contradicts the DeepSpeed config, which gives 3"):
        merge_with_keywords(t, {"stage": 2})
    # switched off in so many words is a value too: a keyword switching it on contradicts
    off = from_deepspeed(
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}}, "bf16": {"enabled": False}}
    )
    with pytest.raises(ZeroFXError, match=r"option param_dtype=torch.bfloat16 contradicts .* gives None"):
        merge_with_keywords(off, {"param_dtype": torch.bfloat16})
    with pytest.raises(ZeroFXError, match=r"option offload_optimizer='host' contradicts .* gives 'none'"):
        merge_with_keywords(off, {"offload_optimizer": "host"})
    no_overlap = from_deepspeed({"zero_optimization": {"stage": 3, "overlap_comm": False}})
    assert merge_with_keywords(no_overlap, {"disable_passes": ("bucket",)})["disable_passes"] == ("schedule", "bucket")
    assert from_deepspeed({"zero_optimization": {"stage": 3.0}}).options["stage"] == 3
    assert type(from_deepspeed({"zero_optimization": {"stage": 3.0}}).options["stage"]) is int
    silent = from_deepspeed({"zero_optimization": {"stage": 3}})  # said nothing: a keyword decides
    assert merge_with_keywords(silent, {"param_dtype": torch.bfloat16})["param_dtype"] is torch.bfloat16
    partial = from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})
    assert partial.options["offload_optimizer"] == "host" and "ratio=0.3 (partial offload)" in "\n".join(
        partial.warnings
    )


def test_compile_takes_a_config_file(tmp_path, one_rank):
    path = tmp_path / "ds_config.json"
    path.write_text(
        json.dumps(
            {"zero_optimization": {"stage": 2, "overlap_comm": False}, "gradient_clipping": 1.0, "steps_per_print": 10}
        )
    )
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zerofx.compile(model, one_rank, config=str(path))
    runtime = runtime_of(model)
    assert runtime.options.stage == 2 and runtime.options.disable_passes == ("schedule",)
    assert runtime.training == {"gradient_clipping": 1.0}
    lines = [str(w.message) for w in caught if "DeepSpeed config" in str(w.message)]
    assert any("steps_per_print" in line for line in lines) and any("gradient_clipping" in line for line in lines)
    model(torch.randn(3, 4)).sum().backward()  # it trains
    with pytest.raises(ZeroFXError, match="contradicts the DeepSpeed config"):
        zerofx.compile(nn.Linear(2, 2), one_rank, config={"zero_optimization": {"stage": 3}}, stage=1)


# --- DeepSpeed's defaults and spellings (a reviewer's findings) --------------------------------------------


def test_fp16_takes_deepspeeds_hysteresis_and_floor_also_when_absent():
    """DeepSpeed's fp16 section defaults to hysteresis 2 and a floor of 1: zerofx took neither
    (torch's scaler halves at every overflow, without a floor) and warned only when the keys were
    written. They are options now, from DeepSpeed's defaults when absent or "auto" (which a
    keyword may override), and DeepSpeed's "auto" for the other scale keys is its default too."""
    t = from_deepspeed({"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}})
    assert t.options["loss_scale_hysteresis"] == 2 and t.options["min_loss_scale"] == 1.0
    assert t.from_auto == {"loss_scale_hysteresis", "min_loss_scale"}
    assert merge_with_keywords(t, {"loss_scale_hysteresis": 1})["loss_scale_hysteresis"] == 1
    given = from_deepspeed(
        {"zero_optimization": {"stage": 3}, "fp16": {"enabled": True, "hysteresis": 3.0, "min_loss_scale": 4}}
    )
    assert given.options["loss_scale_hysteresis"] == 3 and given.options["min_loss_scale"] == 4.0
    with pytest.raises(ZeroFXError, match=r"option loss_scale_hysteresis=1 contradicts .* gives 3"):
        merge_with_keywords(given, {"loss_scale_hysteresis": 1})
    auto = {key: "auto" for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis")}
    t = from_deepspeed({"zero_optimization": {"stage": 3}, "fp16": {"enabled": True, **auto, "min_loss_scale": "auto"}})
    assert {k: t.options[k] for k in t.from_auto} == {
        "initial_loss_scale": 2.0**16,
        "loss_scale_window": 1000,
        "loss_scale_hysteresis": 2,
        "min_loss_scale": 1.0,
    }
    assert t.options["loss_scale"] == "dynamic"


def _scales(scaler, overflows: list[bool]) -> tuple[list, list[bool]]:
    """The scale after each step of a one-parameter SGD loop (through the scaler: unscale, the inf
    check all-reduced over the group, step, update) whose gradients overflow where asked, and
    whether the parameter moved; "raise" where the update raised, and no steps after it."""
    param = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=1.0)
    scales, moved = [], []
    for overflow in overflows:
        scaler.scale(torch.ones(()))  # (starts the scale on its first call)
        param.grad = torch.full((2,), math.inf if overflow else 1.0)
        before = param.detach().clone()
        scaler.step(opt)
        moved.append(not torch.equal(before, param.detach()))
        try:
            scaler.update()
        except ZeroFXError as e:
            assert "at its floor" in str(e) and "\n" not in str(e)
            scales.append("raise")
            break
        scales.append(scaler.get_scale())
    return scales, moved


def test_a_deepspeed_config_scales_the_loss_as_deepspeed_does(one_rank):
    """The scales DeepSpeed 0.19.8 takes, step for step, from a config's fp16 section. The expected
    sequences were obtained from deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler (as its
    engine builds it from the config: init_scale=2**initial_scale_power, scale_window=
    loss_scale_window, min_scale=min_loss_scale, delayed_shift=hysteresis,
    consecutive_hysteresis=False) by calling update_scale(overflow) once per step and reading
    cur_scale ("raise": it raised "Current loss scale already at minimum")."""
    T, F = True, False
    cfg = {"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}}  # DeepSpeed's defaults: 2**16, 2, 1
    scaler = make_loss_scaler(zerofx.Options.from_kwargs(**from_deepspeed(cfg).options), one_rank)
    assert isinstance(scaler, HysteresisGradScaler)
    # the reviewer's pattern: torch's scaler gives [32768, 32768, 16384, 8192]
    assert _scales(scaler, [T, F, T, T]) == ([65536.0, 65536.0, 32768.0, 16384.0], [F, T, F, F])
    # hysteresis used up and refilled at a growth, the first growth after window + 1 good steps and
    # later ones after window, halving while none is left, the floor (4 -> 3), and the end at the floor
    cfg["fp16"].update(initial_scale_power=3, loss_scale_window=2, min_loss_scale=3)
    scaler = make_loss_scaler(zerofx.Options.from_kwargs(**from_deepspeed(cfg).options), one_rank)
    pattern = [T, F, F, F, T, T, T, F, F, F, F, F, T, T, T, T, T]
    deepspeed = [8.0, 8.0, 8.0, 16.0, 16.0, 8.0, 4.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0, 8.0, 4.0, 3.0, "raise"]
    scales, moved = _scales(scaler, pattern)
    assert scales == deepspeed
    assert moved == [not overflow for overflow in pattern]  # every overflow skips its step


def test_consecutive_hysteresis_refills_after_every_good_step_as_deepspeed_does(one_rank):
    """fp16.consecutive_hysteresis=true (refused until 2026-12-07): only overflows in a row use the
    hysteresis up. The expected scales are deepspeed 0.19.8's DynamicLossScaler(init_scale=8,
    scale_window=2, min_scale=1, delayed_shift=2, consecutive_hysteresis=True), update_scale once
    per step; without the key the same pattern halves at the third overflow, not in a row."""
    T, F = True, False
    fp16 = {"enabled": True, "initial_scale_power": 3, "loss_scale_window": 2, "consecutive_hysteresis": True}
    options = from_deepspeed({"zero_optimization": {"stage": 3}, "fp16": fp16}).options
    assert options["loss_scale_consecutive_hysteresis"] is True
    pattern = [T, F, T, F, T, T, F, F, F, T, F, T, F, F, F, F, T, T, T]
    deepspeed = [8.0, 8.0, 8.0, 8.0, 8.0, 4.0, 4.0, 4.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 16.0, 16.0, 16.0, 8.0, 4.0]
    scaler = make_loss_scaler(zerofx.Options.from_kwargs(**options), one_rank)
    scales, moved = _scales(scaler, pattern)
    assert scales == deepspeed
    assert moved == [not overflow for overflow in pattern]
    state = scaler.state_dict()
    assert state["consecutive"] is True
    options["loss_scale_consecutive_hysteresis"] = False
    plain = make_loss_scaler(zerofx.Options.from_kwargs(**options), one_rank)
    assert _scales(plain, pattern[:5])[0] == [8.0, 8.0, 4.0, 4.0, 2.0]


def test_plain_options_keep_torchs_scaler(one_rank):
    """Without hysteresis or a floor the scaler is torch's own ShardedGradScaler (the subclass only
    reshapes its inf flags), its schedule unchanged: every overflow halves, window good steps in a
    row double."""
    T, F = True, False
    scaler = make_loss_scaler(zerofx.Options(loss_scale="dynamic", loss_scale_window=2), one_rank)
    assert type(scaler) is ZeroFXGradScaler and isinstance(scaler, ShardedGradScaler)
    assert _scales(scaler, [T, F, T, T, F, F, F])[0] == [32768.0] * 2 + [16384.0, 8192.0, 8192.0, 16384.0, 16384.0]


def test_an_fp16_loss_is_warned_about_once_since_its_gradient_is_the_scale(one_rank):
    """An fp16 loss (a model taking cross-entropy on fp16 logits) starts the backward from the
    scale in fp16: 2^16 is inf there, so the first step and one after every growth past 2^15
    overflowed whatever the gradients were, silently. One warning says so and what to do; an
    fp32 loss gets none."""
    scaler = make_loss_scaler(zerofx.Options(loss_scale="dynamic"), one_rank)
    loss = torch.tensor(2.0, dtype=torch.float16, requires_grad=True)
    with pytest.warns(UserWarning, match=r"the loss is fp16.*a scale of 2\^16 or more is inf there.*in fp32"):
        scaler.scale(loss).backward()
    assert loss.grad.isinf()  # what the warning is about: 65536 in fp16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.scale(loss)  # once per scaler
        fresh = make_loss_scaler(zerofx.Options(loss_scale="dynamic"), one_rank)
        fresh.scale(torch.tensor(2.0, requires_grad=True))  # an fp32 loss


@pytest.mark.parametrize("hysteresis", [1, 2], ids=["torch_schedule", "deepspeed_schedule"])
def test_a_fused_adam_steps_after_unscale(one_rank, hysteresis):
    """scaler.unscale_ (before clipping), then scaler.step on AdamW(fused=True), the HF Trainer's
    default: torch's ShardedGradScaler left 1-element inf flags that the fused step cannot subtract
    from its 0-d step count (a RuntimeError). The step is taken, fused or not; an
    overflowing step is skipped by both, the fused optimizer's step not called (it was, changing
    nothing, and accelerate took that for a step taken).

    The step taken is compared with the same optimizer (fused or not) stepping a plain copy of
    the parameters with the gradients the scaler handed it, bit for bit: torch's fused CPU AdamW
    rounds otherwise than the unfused one on some CPUs (an AMD EPYC), so the two are not
    compared with each other; the unscaled gradients they were given are, exactly."""
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    given = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = zerofx.compile(
            nn.Linear(4, 8),
            one_rank,
            param_dtype=torch.float16,
            loss_scale="dynamic",
            loss_scale_hysteresis=hysteresis,
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        steps, seen = [], []
        opt.register_step_pre_hook(lambda *_: steps.append(1))
        opt.register_step_pre_hook(
            lambda o, *_: seen.append(
                [(local(p.detach()).clone(), local(p.grad).clone()) for p in o.param_groups[0]["params"]]
            )
        )
        scaler = zerofx.loss_scaler(model)
        x = torch.ones(2, 4)
        for factor in (1e-3, 1e6):  # the second overflows fp16 at the scale 2^16
            scaler.scale(model(x).float().sum() * factor).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert scaler.get_scale() == 2.0**16 / (2 if hysteresis == 1 else 1)  # the overflow was seen
        assert len(steps) == 1, fused  # not called on the overflow: the HF Trainer sees the skip
        stepped = [local(p.detach()).clone() for p in model.parameters()]
        (before,) = seen  # the one step taken
        replay = [value.clone().requires_grad_() for value, _ in before]
        for q, (_, grad) in zip(replay, before):
            q.grad = grad
        torch.optim.AdamW(replay, lr=1e-2, fused=fused).step()
        assert all(torch.equal(a, b.detach()) for a, b in zip(stepped, replay)), fused
        assert not any(torch.equal(a, value) for a, (value, _) in zip(stepped, before))  # it moved
        given.append([grad for _, grad in before])
    assert all(torch.equal(a, b) for a, b in zip(*given))  # the same unscaled gradients, fused or not


def test_the_hysteresis_scalers_state_round_trips_through_a_checkpoints_json(one_rank):
    """zerofx.checkpoint writes the scaler's state_dict into a JSON file: the hysteresis left and
    the growth count (-1 right after an overflow) come back, so a resumed run scales as the
    uninterrupted one; a torch scaler's state (no hysteresis in it) starts with all of it left."""
    T, F = True, False
    opts = zerofx.Options(loss_scale="dynamic", initial_loss_scale=8.0, loss_scale_window=2, loss_scale_hysteresis=3)
    first = make_loss_scaler(opts, one_rank)
    _scales(first, [T, F, T, T])
    saved = json.loads(json.dumps(first.state_dict()))
    assert saved["_hysteresis_left"] == 1 and saved["_growth_tracker"] == -1 and saved["hysteresis"] == 3
    resumed = make_loss_scaler(zerofx.Options(loss_scale="dynamic", loss_scale_hysteresis=2), one_rank)
    resumed.load_state_dict(saved)
    rest = [T, F, F, F, T, T]
    assert _scales(resumed, rest) == _scales(first, rest)
    plain = make_loss_scaler(zerofx.Options(loss_scale="dynamic", initial_loss_scale=8.0), one_rank)
    _scales(plain, [F])
    from_torch = make_loss_scaler(opts, one_rank)
    from_torch.load_state_dict(plain.state_dict())
    assert from_torch.state_dict()["_hysteresis_left"] == 3


@pytest.mark.parametrize(
    "options, message",
    [
        ({"loss_scale_hysteresis": 0}, r"option loss_scale_hysteresis=0: give a number of overflows >= 1"),
        ({"loss_scale_hysteresis": True}, r"option loss_scale_hysteresis=True"),
        ({"loss_scale_hysteresis": 1.5}, r"option loss_scale_hysteresis=1.5"),
        ({"min_loss_scale": 0}, r"option min_loss_scale=0: give a number > 0, or None"),
        ({"min_loss_scale": "1"}, r"option min_loss_scale='1'"),
        ({"min_loss_scale": 2.0**17}, r"option initial_loss_scale=65536.0 is below min_loss_scale"),
    ],
)
def test_the_loss_scale_options_are_validated(options, message):
    with pytest.raises(ZeroFXError, match=message):
        zerofx.Options(loss_scale="dynamic", **options)


@pytest.mark.parametrize(
    "fp16, message",
    [
        ({"hysteresis": 0}, r"fp16.hysteresis=0: give a number of overflows >= 1"),
        ({"hysteresis": 2.5}, r"fp16.hysteresis=2.5: give a number of overflows"),
        ({"min_loss_scale": 0.5}, r"fp16.min_loss_scale=0.5: give an integer >= 1"),
        ({"loss_scale_window": True}, r"fp16.loss_scale_window=true: give a number of good steps >= 1"),
        ({"consecutive_hysteresis": "maybe"}, r"fp16.consecutive_hysteresis"),
        ({"initial_scale_power": 0, "min_loss_scale": 2}, r"fp16.initial_scale_power=0 starts the scale at 1, below"),
    ],
)
def test_bad_fp16_scale_keys_are_errors_naming_the_key(fp16, message):
    with pytest.raises(ZeroFXError, match=message):
        from_deepspeed({"zero_optimization": {"stage": 3}, "fp16": {"enabled": True, **fp16}})


def test_switches_are_read_as_deepspeed_reads_them():
    """DeepSpeed's config model reads 1 / 0 and "true" / "false" as booleans: ``"enabled": 1``
    trained in fp32 here without a word and ``"overlap_comm": 0`` kept overlapping (the code asked
    ``is True`` / ``is False``)."""
    z = {"zero_optimization": {"stage": 2}}
    assert from_deepspeed({**z, "bf16": {"enabled": 1}}).options["param_dtype"] is torch.bfloat16
    assert from_deepspeed({**z, "bf16": {"enabled": "true"}}).options["param_dtype"] is torch.bfloat16
    assert from_deepspeed({**z, "fp16": {"enabled": 1}}).options["param_dtype"] is torch.float16
    assert from_deepspeed({**z, "fp16": {"enabled": 0}}).options["param_dtype"] is None  # off in so many words
    for off in (0, "false", "off"):
        t = from_deepspeed({"zero_optimization": {"stage": 2, "overlap_comm": off}})
        assert t.options["disable_passes"] == ("schedule",), off
    t = from_deepspeed({"zero_optimization": {"stage": 3, "cpu_offload_param": 1}})
    assert t.options["offload_optimizer"] == "host"
    with pytest.raises(ZeroFXError, match=r'bf16.enabled=2: give true, false or "auto"'):
        from_deepspeed({**z, "bf16": {"enabled": 2}})
    with pytest.raises(ZeroFXError, match=r"zero_optimization.overlap_comm=\"sometimes\": give true or false"):
        from_deepspeed({"zero_optimization": {"stage": 2, "overlap_comm": "sometimes"}})


def test_keywords_spelled_differently_from_the_config_are_no_contradiction():
    """``param_dtype="bf16"`` is what ``bf16.enabled`` says, ``reduce_dtype="fp32"`` what
    ``communication_data_type: "fp32"`` says, ``"/x/nv/"`` the folder ``"/x/nv"``: each was
    refused as a contradiction; a keyword that does say otherwise still is."""
    t = from_deepspeed(
        {
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x/nv"}},
            "bf16": {"enabled": True},
            "communication_data_type": "fp32",
        }
    )
    for same in ({"param_dtype": "bf16"}, {"reduce_dtype": "fp32"}, {"reduce_dtype": "float32"}):
        assert merge_with_keywords(t, same)
    assert merge_with_keywords(t, {"offload_dir": "/x/nv/"})["offload_dir"] == "/x/nv/"
    assert merge_with_keywords(t, {"offload_dir": "/x/../x/nv"})
    for other in ({"param_dtype": "fp16"}, {"reduce_dtype": "bf16"}, {"offload_dir": "/x/nv2"}):
        with pytest.raises(ZeroFXError, match="contradicts the DeepSpeed config"):
            merge_with_keywords(t, other)
    off = from_deepspeed({"zero_optimization": {"stage": 3}, "bf16": {"enabled": False}})
    assert merge_with_keywords(off, {"param_dtype": torch.float32})  # fp32 compute is no param_dtype (None)


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"fp16": {"enabled": True, "initial_scale_power": 2000}},
            r"^DeepSpeed config: fp16.initial_scale_power=2000: give an integer from 0 to 127",
        ),
        ({"fp16": {"enabled": True, "initial_scale_power": "big"}}, r"^DeepSpeed config: fp16.initial_scale_power="),
        ({"fp16": {"enabled": True, "loss_scale": "dynamic"}}, r'^DeepSpeed config: fp16.loss_scale="dynamic": give 0'),
        ({"fp16": {"enabled": True, "loss_scale": -1}}, r"^DeepSpeed config: fp16.loss_scale=-1: give 0"),
        ({"zero_optimization": None}, r"^DeepSpeed config: zero_optimization must be an object, got null$"),
        ({"zero_optimization": True}, r"^DeepSpeed config: zero_optimization must be an object, got true$"),
        ({"fp16": None}, r"^DeepSpeed config: fp16 must be an object, got null$"),
    ],
    ids=["power_2000", "power_text", "loss_scale_text", "loss_scale_negative", "zero_null", "zero_bool", "fp16_null"],
)
def test_bad_values_are_one_line_errors_naming_the_key(config, message):
    """These raised TypeError / OverflowError from deep inside, or called "auto" a static scale."""
    config = {"zero_optimization": {"stage": 3}, **config}
    with pytest.raises(ZeroFXError, match=message) as caught:
        from_deepspeed(config)
    assert "\n" not in str(caught.value)


def test_json_text_is_not_taken_for_a_file_name():
    text = json.dumps({"zero_optimization": {"stage": 3}})
    with pytest.raises(ZeroFXError, match=r"is JSON text, not a file: pass a dict \(json.loads of the text\)"):
        from_deepspeed(text)
    with pytest.raises(ZeroFXError, match="is JSON text"):
        zerofx.compile(nn.Linear(2, 2), None, config=text)


def test_bf16_notes_under_auto_are_said_only_when_the_run_trains_in_bf16(one_rank):
    """bf16.enabled="auto" is off unless a keyword (or the HF Trainer's --bf16) turns it on: what
    DeepSpeed does differently in bf16 (skipping non-finite steps, keys zerofx does not follow) was
    warned about in an fp32 run too. It is said when param_dtype makes the run bf16, not otherwise."""
    config = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto", "immediate_grad_update": True}}
    for keywords, said in (({}, False), ({"param_dtype": torch.bfloat16}, True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            zerofx.compile(nn.Linear(2, 2), one_rank, config=config, **keywords)
        lines = [str(w.message) for w in caught]
        for name in ("DeepSpeed's stage 3 skips a step", "bf16.immediate_grad_update has no effect"):
            assert any(name in line for line in lines) is said, (keywords, lines)


def test_the_persistence_threshold_keeps_parameters_of_exactly_that_size_whole(one_rank):
    """DeepSpeed keeps a parameter whole when numel <= stage3_param_persistence_threshold; zerofx
    sharded one of exactly the threshold's size (it compared with <)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 5))  # weights of 16 and 20 elements
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 16}, "bf16": {"enabled": True}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zerofx.compile(model, one_rank, config=config)  # bf16: one rank still shards
    placements = {n: p.placements[-1] for n, p in model.named_parameters()}
    assert placements["0.weight"].is_replicate() and placements["0.bias"].is_replicate()
    assert placements["1.weight"].is_shard()


@pytest.mark.parametrize(
    "config, said",
    [
        ({"zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": 0}}, "stage3_module_granularity"),
        ({"zero_optimization": {"stage": 3, "module_granularity_threshold": 10}}, "stage3_module_granularity"),
        (
            {"zero_optimization": {"stage": 3, "stage3_use_all_reduce_for_fetch_params": True}},
            "stage3_use_all_reduce_for_fetch_params",
        ),
        ({"zero_optimization": {"stage": 3, "cpu_offload_use_pin_memory": True}}, "cpu_offload_use_pin_memory"),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}},
            "zero_optimization.offload_optimizer.super_offload",
        ),
        ({"zero_optimization": {"stage": 3}, "log_level": "info", "timers": {}}, "log_level, timers"),
    ],
)
def test_deepspeed_keys_that_only_tune_deepspeed_are_named_not_taken_for_typos(config, said):
    """Keys DeepSpeed 0.19.8 documents were "unknown" with a wrong "did you mean" (the module
    granularity threshold as stage3_model_persistence_threshold)."""
    lines = [w for w in from_deepspeed(config).warnings if "DeepSpeed keys zerofx does not follow" in w]
    assert len(lines) == 1 and said in lines[0], lines


@pytest.mark.parametrize(
    "config, message",
    [
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "zerofx keeps fp32 master weights"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": "true"}}, "keeps optimizer state in the master"),
        ({"zero_optimization": {"stage": 3, "zenflow": {"topk_ratio": 0.1}}}, "ZenFlow applies the updates"),
        ({"gradient_allreduce_op": "sum"}, "'sum' would step on their sum"),
        ({"tensor_parallel": {"autotp_size": 2}}, "AutoTP"),
        ({"expert_parallel": {"enabled": True}}, "AutoEP"),
        ({"data_types": {"buffer_dtype": "bf16"}}, "never casts buffers"),
    ],
)
def test_deepspeed_keys_that_would_change_the_arithmetic_are_refused(config, message):
    config = {"zero_optimization": {"stage": 3}, **config}
    with pytest.raises(ZeroFXError, match=f"a DeepSpeed key zerofx does not follow: .*{message}"):
        from_deepspeed(config)


def test_deepspeed_keys_at_the_value_zerofx_computes_are_accepted():
    t = from_deepspeed(
        {
            "zero_optimization": {"stage": 3, "zenflow": None},
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": False},
            "gradient_allreduce_op": "MEAN",
            "tensor_parallel": {"autotp_size": 1},
            "data_types": {"param_dtype": "bf16"},
        }
    )
    assert t.options == {"stage": 3, "param_dtype": torch.bfloat16}
    with pytest.raises(ZeroFXError, match=r"data_types.param_dtype='fp16' but the enabled precision"):
        from_deepspeed(
            {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "data_types": {"param_dtype": "fp16"}}
        )


def test_inconsistent_batch_sizes_are_refused_where_the_world_size_is_known(one_rank):
    """DeepSpeed asserts train_batch_size = micro batch x accumulation steps x data-parallel size;
    zerofx.compile took 64 = 4 x 3 x N on any N."""
    sizes = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}
    z = {"zero_optimization": {"stage": 3}}
    assert from_deepspeed({**z, **sizes, "train_batch_size": 24}, data_parallel_size=2).training["train_batch_size"]
    with pytest.raises(ZeroFXError, match=r"train_batch_size=64 is not .* x the data-parallel size \(2\)"):
        from_deepspeed({**z, **sizes, "train_batch_size": 64}, data_parallel_size=2)
    assert from_deepspeed({**z, **sizes, "train_batch_size": "auto"}, data_parallel_size=2)
    with pytest.raises(ZeroFXError, match=r"train_batch_size=24 is not .* x the data-parallel size \(1\)"):
        zerofx.compile(nn.Linear(2, 2), one_rank, config={**z, **sizes, "train_batch_size": 24})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = zerofx.compile(nn.Linear(2, 2), one_rank, config={**z, **sizes, "train_batch_size": 12})
    assert runtime_of(model).training["train_batch_size"] == 12


@pytest.fixture
def one_rank(tmp_path):
    with one_rank_mesh(str(tmp_path)) as mesh:
        yield mesh


def test_compile_checks_batch_sizes_against_the_meshs_data_parallel_size():
    """zerofx.compile knows the mesh: 16 = 4 x 2 x 2 fits a divisor of 4 ranks, but over a 4-rank
    data-parallel mesh DeepSpeed asserts 16 == 4 x 2 x 4 (refused); on the whole (dp, tp) mesh with
    ``tp_dim`` the data-parallel size is 2 (accepted, then the fake group stops the compile)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    config = {
        "zero_optimization": {"stage": 3},
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "train_batch_size": 16,
    }
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        with pytest.raises(ZeroFXError, match=r"x the data-parallel size \(4\)"):
            zerofx.compile(nn.Linear(2, 2), init_device_mesh("cpu", (4,)), config=config)
        whole = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(Exception) as later:  # past the batch check: a plain model has no TP plan
            zerofx.compile(nn.Linear(2, 2), whole, config=config, tp_dim="tp")
        assert "data-parallel size" not in str(later.value)
    finally:
        dist.destroy_process_group()
