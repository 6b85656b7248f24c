"""DeepSpeed configs translated into zerofx options (zerofx/ds_config.py): every key of a typical
HF-style config, "auto" resolution, keywords against the config, and bad configs."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import zerofx
from tests.multirank import one_rank_mesh
from zerofx import ZeroFXError
from zerofx.ds_config import from_deepspeed, hidden_size_of, merge_with_keywords
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
    }
    assert any("hysteresis" in w for w in fp16.warnings)
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
        (
            {"bf16": {"enabled": True, "check_grad_overflow": True}},
            "bf16.check_grad_overflow=true: zerofx does not skip",
        ),
        (
            {"bf16": {"enabled": "auto", "check_grad_overflow": True}},
            "bf16.check_grad_overflow=true: zerofx does not skip",
        ),
        ({"bf16": {"enabled": True, "immediate_grad_update": True}}, "bf16.immediate_grad_update has no effect"),
        ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "zerofx keeps fp32 master weights"),
        ({"zero_optimization": {"stage": 1, "reduce_bucket_size": 64}}, "reduce_bucket_size: at stage 1"),
    ],
    ids=[
        "check_grad_overflow",
        "check_grad_overflow_auto",
        "immediate_grad_update",
        "fp16_master_weights",
        "stage1_reduce_bucket",
    ],
)
def test_precision_and_bucket_keys_zerofx_does_not_follow_are_named(config, named):
    """Keys DeepSpeed acts on and zerofx does not (a bf16 step skipped on inf/NaN, fp16 masters,
    stage 1's reduce buckets) were taken without a word: each is named in a warning now."""
    t = from_deepspeed({"zero_optimization": {"stage": 3}, **config})
    assert any(named in w for w in t.warnings), t.warnings
    if "check_grad_overflow" in str(config):  # false is what zerofx does: nothing to say
        off = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True, "check_grad_overflow": False}}
        assert not any("check_grad_overflow" in w for w in from_deepspeed(off).warnings)


def test_zero_plus_plus_quantization_keys_map_to_the_quantize_options():
    t = from_deepspeed(
        {"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True}}
    )
    assert t.options == {"stage": 3, "quantize_weights": "int8", "quantize_grads": "int8"}
    assert any("quantize_grads='int4'" in w for w in t.warnings)
    off = from_deepspeed({"zero_optimization": {"stage": 3, "zero_quantized_weights": False}})
    assert off.options == {"stage": 3}


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


@pytest.fixture
def one_rank(tmp_path):
    with one_rank_mesh(str(tmp_path)) as mesh:
        yield mesh
