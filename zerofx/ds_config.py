"""DeepSpeed configs: ``zerofx.compile(model, mesh, config="ds_config.json")`` (a path or a dict).

``from_deepspeed(config, hidden_size=...)`` translates the keys DeepSpeed users set into zerofx
options, and says what it did with every other key: each key either becomes an option, is
returned as a training-loop setting (``training``: clipping, accumulation, batch sizes, the
optimizer and scheduler, which a loop or trainer applies, not the engine), is named in a
one-line warning (a key with no effect here), or raises a ``ZeroFXError`` (a typo, a
contradiction, a feature zerofx does not have). Nothing is dropped silently.

    DeepSpeed                                           zerofx
    zero_optimization.stage 1 | 2 | 3                   stage
    zero_optimization.offload_optimizer.device          offload_optimizer: cpu -> "host", nvme -> "disk"
      (and offload_param.device, stage 3)                 (one tier holds master shards and optimizer state)
    ...offload_*.nvme_path                              offload_dir
    zero_optimization.stage3_param_persistence_threshold persistence_threshold (elements)
    zero_optimization.reduce_bucket_size (elements)     bucket_bytes (elements x the reduce dtype's size;
                                                          stage 1's end-of-backward reduce: 32 MiB buckets, warned)
    zero_optimization.stage3_prefetch_bucket_size       prefetch_bytes (elements x the compute dtype's size)
    zero_optimization.overlap_comm = false              disable_passes += ("schedule",)
    bf16.enabled                                        param_dtype=torch.bfloat16
    fp16.enabled (+ initial_scale_power, loss_scale_window)  param_dtype=torch.float16, loss_scale="dynamic"
    communication_data_type                             reduce_dtype
    data_types.grad_accum_dtype                         reduce_dtype (zerofx accumulates and reduces in one dtype)
    activation_checkpointing (+ cpu_checkpointing)      checkpoint="full" (+ offload_activations="host")

DeepSpeed's field names for its ``stage3_*`` keys (``prefetch_bucket_size``,
``param_persistence_threshold``, ``max_live_parameters``, ...), which its config model takes as
well, read as those keys; both spellings of one key is an error.

``"auto"`` values are resolved as the HF transformers integration resolves them: bucket sizes
and the persistence threshold from the model's hidden size (``hidden_size**2``,
``0.9 * hidden_size**2``, ``10 * hidden_size``), or zerofx's own ``"auto"`` when the hidden size
is unknown; ``bf16`` / ``fp16`` ``"auto"`` is resolved from ``--bf16`` / ``--fp16`` by
``zerofx.hf.ZeroFXTrainer`` (as HF's integration resolves it) and is off elsewhere unless a
keyword argument of ``zerofx.compile`` says otherwise. Options that
came from ``"auto"`` yield to keyword arguments; an explicit config value that a keyword argument
contradicts is an error naming both, an explicit "off" too (``bf16.enabled: false`` and no fp16,
an offload ``device: "none"``). A partial offload (``ratio`` below 1) offloads all of it, with a
warning.

Not in zerofx, so an error when switched on: ``torch_autocast`` (zerofx does not wrap the
forward: run it under ``torch.autocast`` yourself, or use ``bf16``), ``sparse_gradients``.
DeepSpeed's ``compile`` section has no effect (zerofx always compiles, with its own passes).
Precision keys zerofx does not follow are warned about: ``bf16.check_grad_overflow`` (zerofx does
not skip a bf16 step on inf/NaN gradients), ``bf16.immediate_grad_update`` (gradients accumulate in
the reduce dtype anyway), ``fp16.fp16_master_weights_and_grads`` (masters stay fp32).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from zerofx.errors import ZeroFXError
from zerofx.options import closest

__all__ = ["DeepSpeedTranslation", "from_deepspeed", "hidden_size_of", "merge_with_keywords"]

_TIERS = {"none": "none", "cpu": "host", "nvme": "disk"}
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_SIZES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}

# keys a training loop applies (returned in ``training``); one warning names them
_TRAINING = (
    "gradient_clipping",
    "gradient_accumulation_steps",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "optimizer",
    "scheduler",
)
# keys with no effect on what zerofx computes: logging, monitoring, DeepSpeed-internal switches
_NO_EFFECT = (
    "steps_per_print",
    "wall_clock_breakdown",
    "dump_state",
    "memory_breakdown",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comms_logger",
    "aio",  # the NVMe tier's async-I/O tuning: zerofx's disk tier maps files instead
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "prescale_gradients",
    "checkpoint",
    "data_efficiency",
    "elasticity",
    "compile",  # DeepSpeed's own compile switches (deepcompile): zerofx always compiles, its own way
)
_TOP = {
    "zero_optimization",
    "bf16",
    "bfloat16",
    "fp16",
    "communication_data_type",
    "activation_checkpointing",
    "gradient_predivide_factor",
    "amp",
    "torch_autocast",
    "data_types",
    "sparse_gradients",
    *_TRAINING,
    *_NO_EFFECT,
}

_ZERO_MAPPED = {
    "stage",
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "offload_optimizer",
    "offload_param",
    "stage3_param_persistence_threshold",
    "reduce_bucket_size",
    "stage3_prefetch_bucket_size",
    "allgather_bucket_size",
    "overlap_comm",
    "cpu_offload",
}
# zero_optimization keys zerofx honours by construction (its collectives already behave so)
_ZERO_BUILT_IN = {"contiguous_gradients": True, "reduce_scatter": True, "allgather_partitions": True}
_ZERO_NO_EFFECT = {
    "sub_group_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "round_robin_gradients",
    "elastic_checkpoint",
    "load_from_fp32_weights",
    "ignore_unused_parameters",
    "legacy_stage1",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_model_persistence_threshold",
    "stage3_gather_fp16_weights_on_model_save",
    "memory_efficient_linear",
    "use_multi_rank_bucket_allreduce",
    "log_trace_cache_warnings",
}
# not in zerofx (yet): an error when switched on
_ZERO_UNSUPPORTED = {
    "zero_quantized_nontrainable_weights": "quantized frozen weights (ZeRO++)",
    "mics_shard_size": "MiCS sub-group sharding",
    "mics_hierarchical_params_gather": "MiCS hierarchical gathers",
}
# DeepSpeed's own field names for its stage3_* keys (its config model takes either spelling)
_STAGE3_FIELDS = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}


def _stage3_spellings(zero: dict) -> dict:
    """``zero_optimization`` with DeepSpeed's field names spelled as its ``stage3_`` keys."""
    out = dict(zero)
    for name, key in _STAGE3_FIELDS.items():
        if name in out:
            if key in out:
                raise ZeroFXError(f"DeepSpeed config: zero_optimization has both {name} and {key}: give one")
            out[key] = out.pop(name)
    return out


_ZERO = _ZERO_MAPPED | set(_ZERO_BUILT_IN) | _ZERO_NO_EFFECT | set(_ZERO_UNSUPPORTED) | {"zero_hpz_partition_size"}
_OFFLOAD_KEYS = {
    "device",
    "nvme_path",
    "pin_memory",
    "buffer_count",
    "buffer_size",
    "fast_init",
    "ratio",
    "max_in_cpu",
    "pipeline",
    "pipeline_read",
    "pipeline_write",
}
_FP16_KEYS = {
    "enabled",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "auto_cast",
    "fp16_master_weights_and_grads",
}
_AC_KEYS = {
    "partition_activations",
    "cpu_checkpointing",
    "contiguous_memory_optimization",
    "number_checkpoints",
    "synchronize_checkpoint_boundary",
    "profile",
}


@dataclass
class DeepSpeedTranslation:
    """What a DeepSpeed config means for zerofx (see the module docstring)."""

    options: dict[str, Any] = field(default_factory=dict)  # zerofx.compile keywords
    from_auto: set[str] = field(default_factory=set)  # options resolved from "auto": keywords override them
    training: dict[str, Any] = field(default_factory=dict)  # for the training loop (clipping, accumulation, ...)
    warnings: list[str] = field(default_factory=list)  # one line per key with no effect, for warnings.warn


def hidden_size_of(model: torch.nn.Module) -> int | None:
    """The hidden size HF's DeepSpeed integration sizes "auto" buckets by (``config.hidden_size``,
    or the largest of ``config.hidden_sizes``), or None."""
    config = getattr(model, "config", None)
    sizes = getattr(config, "hidden_sizes", None)
    if sizes:
        return int(max(sizes))
    size = getattr(config, "hidden_size", None)
    return int(size) if isinstance(size, int) else None


def _load(config: Any) -> dict:
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                config = json.load(f)
        except OSError as e:
            raise ZeroFXError(f"config={str(config)!r}: cannot read the DeepSpeed config ({e.strerror or e})") from None
        except json.JSONDecodeError as e:
            raise ZeroFXError(f"config={str(config)!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ZeroFXError(
            f"config must be a DeepSpeed config: a dict or the path of a JSON file, got {type(config).__name__}"
        )
    return config


def _check_keys(section: dict, valid: set[str], where: str) -> None:
    if not isinstance(section, dict):
        raise ZeroFXError(f"DeepSpeed config: {where} must be an object, got {section!r}")
    for key in section:
        if key not in valid:
            raise ZeroFXError(
                f"DeepSpeed config: unknown key {where + '.' if where else ''}{key}"
                f"{closest(key, valid)}; zerofx reads the keys DeepSpeed documents "
                "(see zerofx/ds_config.py)"
            )


def _enabled(section: dict, where: str) -> bool | str:
    value = section.get("enabled", False)
    if value not in (True, False, "auto"):
        raise ZeroFXError(f'DeepSpeed config: {where}.enabled={value!r}: give true, false or "auto"')
    return value


def _elements(value: Any, where: str) -> int | str:
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
        raise ZeroFXError(f'DeepSpeed config: {where}={value!r}: give a number of elements >= 0 or "auto"')
    return int(value)


def from_deepspeed(config: Any, *, hidden_size: int | None = None) -> DeepSpeedTranslation:
    """Translate a DeepSpeed config (a dict or a JSON file's path); raises on what it cannot honour."""
    cfg = _load(config)
    _check_keys(cfg, _TOP, "")
    out = DeepSpeedTranslation()
    opts, notes = out.options, out.warnings

    # -- precision ---------------------------------------------------------------------------------
    bf16 = cfg.get("bf16", cfg.get("bfloat16", {}))
    if "bf16" in cfg and "bfloat16" in cfg:
        raise ZeroFXError("DeepSpeed config: both bf16 and bfloat16 are given; keep one")
    _check_keys(bf16, {"enabled", "immediate_grad_update", "check_grad_overflow"}, "bf16")
    fp16 = cfg.get("fp16", {})
    _check_keys(fp16, _FP16_KEYS, "fp16")
    if "amp" in cfg and _enabled(cfg["amp"], "amp") is True:
        raise ZeroFXError("DeepSpeed config: amp (NVIDIA apex) is not supported; use bf16 or fp16")
    b, f = _enabled(bf16, "bf16"), _enabled(fp16, "fp16")
    if b is True and f is True:
        raise ZeroFXError("DeepSpeed config: bf16.enabled and fp16.enabled are both true; choose one")
    for name, value in (("bf16", b), ("fp16", f)):
        if value == "auto":
            notes.append(
                f'{name}.enabled="auto" is resolved by the HF Trainer from --{name}; here it is off '
                f"unless zerofx.compile(..., param_dtype=...) says otherwise"
            )
    if b is False and f is False and ("enabled" in bf16 or "enabled" in fp16):
        opts["param_dtype"] = None  # switched off in so many words: a keyword turning it on contradicts
    if b is True:
        opts["param_dtype"] = torch.bfloat16
    # keys zerofx does not follow, also under "auto" (the HF Trainer's configs, precision from --bf16)
    if b in (True, "auto") and bf16.get("check_grad_overflow") is True:
        notes.append(
            "bf16.check_grad_overflow=true: zerofx does not skip a bf16 step whose gradients hold inf or "
            "NaN; to skip such steps, check torch.isfinite(torch.nn.utils.clip_grad_norm_(...)) before "
            "optimizer.step()"
        )
    if b in (True, "auto") and "immediate_grad_update" in bf16:
        notes.append(
            "bf16.immediate_grad_update has no effect: zerofx accumulates gradients in the reduce dtype "
            "(fp32 unless reduce_dtype / communication_data_type says otherwise)"
        )
    if f is True:
        opts["param_dtype"] = torch.float16
        scale = fp16.get("loss_scale", 0)
        if scale not in (0, 0.0):
            raise ZeroFXError(
                f"DeepSpeed config: fp16.loss_scale={scale!r} is a static loss scale; zerofx scales "
                "dynamically: set loss_scale to 0"
            )
        opts["loss_scale"] = "dynamic"
        if "initial_scale_power" in fp16:
            opts["initial_loss_scale"] = 2.0 ** fp16["initial_scale_power"]
        if "loss_scale_window" in fp16:
            opts["loss_scale_window"] = fp16["loss_scale_window"]
        if fp16.get("auto_cast") is False:
            notes.append("fp16.auto_cast=false has no effect: zerofx casts floating inputs to param_dtype")
        ignored = sorted(set(fp16) & {"hysteresis", "consecutive_hysteresis", "min_loss_scale"})
        if ignored:
            notes.append(
                f"fp16.{', fp16.'.join(ignored)}: zerofx's dynamic scaling (torch's ShardedGradScaler) backs "
                "off at every overflow, with no hysteresis or floor"
            )
    if f in (True, "auto") and fp16.get("fp16_master_weights_and_grads") is True:
        notes.append(
            "fp16.fp16_master_weights_and_grads=true: zerofx keeps fp32 master weights and gradient "
            "shards (param_dtype is the compute dtype only)"
        )
    if "communication_data_type" in cfg:
        name = cfg["communication_data_type"]
        if name not in _DTYPES:
            raise ZeroFXError(f"DeepSpeed config: communication_data_type={name!r}: choose one of {sorted(_DTYPES)}")
        opts["reduce_dtype"] = _DTYPES[name]
    data_types = cfg.get("data_types", {})
    _check_keys(data_types, {"grad_accum_dtype"}, "data_types")
    if data_types.get("grad_accum_dtype") is not None:
        name = data_types["grad_accum_dtype"]
        if name not in _DTYPES:
            raise ZeroFXError(
                f"DeepSpeed config: data_types.grad_accum_dtype={name!r}: choose one of {sorted(_DTYPES)}"
            )
        if "reduce_dtype" in opts and opts["reduce_dtype"] is not _DTYPES[name]:
            raise ZeroFXError(
                f"DeepSpeed config: data_types.grad_accum_dtype={name!r} but communication_data_type="
                f"{cfg['communication_data_type']!r}: zerofx reduces gradients in the dtype it accumulates "
                "them in (reduce_dtype); give one dtype"
            )
        opts["reduce_dtype"] = _DTYPES[name]
    autocast = cfg.get("torch_autocast", {})
    _check_keys(autocast, {"enabled", "dtype", "lower_precision_safe_modules"}, "torch_autocast")
    if _enabled(autocast, "torch_autocast") is not False:
        raise ZeroFXError(
            "DeepSpeed config: torch_autocast: zerofx does not wrap the model's forward in torch.autocast; "
            "remove the section and run the forward under torch.autocast(device_type, dtype=...) yourself, "
            "or train with bf16 parameters and fp32 master weights (bf16.enabled=true)"
        )
    if cfg.get("sparse_gradients", False) not in (False, None):
        raise ZeroFXError(
            f"DeepSpeed config: sparse_gradients={cfg['sparse_gradients']!r}: zerofx reduces dense gradients "
            "only (nn.Embedding(sparse=True) is not supported); remove the key or set it false"
        )
    factor = cfg.get("gradient_predivide_factor", 1.0)
    if factor != 1.0:
        raise ZeroFXError(
            f"DeepSpeed config: gradient_predivide_factor={factor!r}: zerofx averages gradients in "
            "one division after the reduction; remove the key (or set 1.0)"
        )

    # -- ZeRO --------------------------------------------------------------------------------------
    zero = _stage3_spellings(cfg.get("zero_optimization", {}))
    _check_keys(zero, _ZERO, "zero_optimization")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ZeroFXError(f"DeepSpeed config: zero_optimization.stage={stage!r}: choose 1, 2 or 3")
    stage = int(stage)  # (3.0 from a JSON writer that prints floats)
    if stage == 0:
        raise ZeroFXError(
            "DeepSpeed config: zero_optimization.stage is 0 (or missing): that is plain data "
            "parallelism (use torch DDP); zerofx runs ZeRO stages 1, 2 and 3"
        )
    opts["stage"] = stage
    hpz = zero.get("zero_hpz_partition_size", 1)
    if hpz not in (0, 1):  # hpZ's group is the mesh's inner dimension, which a config cannot give
        raise ZeroFXError(
            f"DeepSpeed config: zero_optimization.zero_hpz_partition_size={hpz!r}: zerofx's hpZ takes its "
            f"group from the mesh: compile on a 2-D mesh (nodes, {hpz}) with secondary_shard=True, and "
            "remove the key"
        )
    for key, what in _ZERO_UNSUPPORTED.items():
        if zero.get(key):
            raise ZeroFXError(f"DeepSpeed config: zero_optimization.{key}={zero[key]!r}: {what} is not in zerofx yet")
    if zero.get("zero_quantized_weights"):  # ZeRO++ qwZ: int8 blocks, as DeepSpeed's default
        opts["quantize_weights"] = "int8"
    if zero.get("zero_quantized_gradients") and stage == 1:
        raise ZeroFXError(
            "DeepSpeed config: zero_optimization.zero_quantized_gradients at stage 1: zerofx quantizes the "
            "gradient reduce-scatters of stages 2 and 3 (stage 1 reduces once, after the backward); use stage 2 "
            "or 3, or drop the key"
        )
    if zero.get("zero_quantized_gradients"):  # ZeRO++ qgZ
        opts["quantize_grads"] = "int8"
        notes.append(
            "zero_quantized_gradients: zerofx sends int8 gradient blocks on every hop "
            "(quantize_grads='int8'); pass quantize_grads='int4' for half the bytes"
        )
    for key, default in _ZERO_BUILT_IN.items():
        if zero.get(key, default) != default:
            notes.append(
                f"zero_optimization.{key}={zero[key]!r} has no effect: zerofx's collectives always behave "
                f"as {key}={str(default).lower()}"
            )
    no_effect = sorted(set(zero) & _ZERO_NO_EFFECT)
    if no_effect:
        notes.append(f"zero_optimization.{', zero_optimization.'.join(no_effect)}: no effect in zerofx")
    if zero.get("overlap_comm", True) is False:
        opts["disable_passes"] = ("schedule",)
    _offload(zero, stage, opts, notes)

    compute = opts.get("param_dtype") or torch.float32
    reduce = opts.get("reduce_dtype") or torch.float32
    auto_sizes = {
        "reduce_bucket_size": (lambda h: h * h, "bucket_bytes", _SIZES[reduce]),
        "stage3_prefetch_bucket_size": (lambda h: int(0.9 * h * h), "prefetch_bytes", _SIZES[compute]),
        "stage3_param_persistence_threshold": (lambda h: 10 * h, "persistence_threshold", None),
    }
    for key, (from_hidden, option, element_bytes) in auto_sizes.items():
        if key not in zero:
            continue
        if key.startswith("stage3_") and stage != 3:
            notes.append(f"zero_optimization.{key} applies to stage 3 only: no effect at stage {stage}")
            continue
        value = _elements(zero[key], f"zero_optimization.{key}")
        if value == "auto":
            out.from_auto.add(option)
            if hidden_size is None:
                if option == "persistence_threshold":
                    notes.append(
                        f'zero_optimization.{key}="auto" needs the model\'s hidden size (config.hidden_size); '
                        "none found: no parameter is kept whole"
                    )
                    continue
                opts[option] = "auto"  # zerofx's own: the cost model's saturating size / one block
                continue
            value = from_hidden(hidden_size)
        opts[option] = value if element_bytes is None else value * element_bytes
    if "reduce_bucket_size" in zero and stage == 1:
        notes.append(
            "zero_optimization.reduce_bucket_size: at stage 1 zerofx reduces at the end of the backward in "
            "32 MiB flat buckets (zerofx/runtime/eager_buckets.py) whatever it says"
        )
    if "allgather_bucket_size" in zero and stage in (1, 2):
        notes.append(
            "zero_optimization.allgather_bucket_size: zerofx buckets the post-step all-gather in 32 MiB "
            "flat buckets (zerofx/runtime/eager_buckets.py) whatever it says"
        )
    elif "allgather_bucket_size" in zero:
        notes.append("zero_optimization.allgather_bucket_size applies to stages 1 and 2 only: no effect at stage 3")

    # -- activation checkpointing -----------------------------------------------------------------
    if "activation_checkpointing" in cfg:
        ac = cfg["activation_checkpointing"]
        _check_keys(ac, _AC_KEYS, "activation_checkpointing")
        opts["checkpoint"] = "full"
        if ac.get("cpu_checkpointing"):
            opts["offload_activations"] = "host"
        ignored = sorted(k for k in set(ac) - {"cpu_checkpointing"} if ac[k])
        if ignored:
            notes.append(
                f"activation_checkpointing.{', activation_checkpointing.'.join(ignored)}: no effect (zerofx "
                "checkpoints every transformer block of the traced graph; nothing is partitioned)"
            )

    # -- the training loop's and nobody's ---------------------------------------------------------
    out.training = {k: cfg[k] for k in _TRAINING if k in cfg}
    if out.training:
        listed = ", ".join(
            f"{k}={v!r}" if not isinstance(v, dict) else f"{k}={v.get('type', '?')}" for k, v in out.training.items()
        )
        notes.append(
            f"training-loop settings zerofx leaves to the loop ({listed}): clip with "
            "torch.nn.utils.clip_grad_norm_ (global norm over the shards), accumulate with zerofx.no_sync, "
            "build the optimizer over model.parameters() after compile"
        )
    quiet = sorted(set(cfg) & set(_NO_EFFECT))
    if quiet:
        notes.append(f"{', '.join(quiet)}: no effect in zerofx")
    return out


def _offload(zero: dict, stage: int, opts: dict, notes: list[str]) -> None:
    sections = {}
    switched_off = False
    for key in ("offload_optimizer", "offload_param"):
        if key in zero:
            _check_keys(zero[key], _OFFLOAD_KEYS, f"zero_optimization.{key}")
            device = zero[key].get("device", "none")
            if device not in _TIERS:
                raise ZeroFXError(
                    f"DeepSpeed config: zero_optimization.{key}.device={device!r}: choose none, cpu or nvme"
                )
            if device == "nvme" and not zero[key].get("nvme_path"):
                raise ZeroFXError(
                    f"DeepSpeed config: zero_optimization.{key}.device=nvme needs nvme_path (a folder on a local disk)"
                )
            if device != "none":
                sections[key] = zero[key]
            else:
                switched_off = switched_off or "device" in zero[key]
            ratio = zero[key].get("ratio", 1.0)
            if device != "none" and ratio != 1.0:
                notes.append(
                    f"zero_optimization.{key}.ratio={ratio!r} (partial offload): zerofx offloads all of it "
                    "(less device memory than asked, more host traffic)"
                )
    if zero.get("cpu_offload"):  # DeepSpeed's old spelling of offload_optimizer.device=cpu
        sections.setdefault("offload_optimizer", {"device": "cpu"})
    if "offload_param" in sections and stage != 3:
        raise ZeroFXError(
            f"DeepSpeed config: zero_optimization.offload_param is for stage 3 (parameters are whole "
            f"at stage {stage}); use offload_optimizer"
        )
    devices = {s["device"] for s in sections.values()}
    if len(devices) > 1:
        raise ZeroFXError(
            "DeepSpeed config: offload_optimizer and offload_param name different devices; zerofx keeps "
            "parameter shards and optimizer state in one tier: give both the same device"
        )
    paths = {s.get("nvme_path") for s in sections.values() if s["device"] == "nvme"}
    if len(paths) > 1:
        raise ZeroFXError(
            "DeepSpeed config: offload_optimizer and offload_param name different nvme_path folders; "
            "zerofx keeps both in one folder: give the same nvme_path"
        )
    if devices:
        opts["offload_optimizer"] = _TIERS[devices.pop()]
    elif switched_off:  # device "none" in so many words: a keyword offloading contradicts
        opts["offload_optimizer"] = "none"
    if paths:
        opts["offload_dir"] = paths.pop()


def merge_with_keywords(translation: DeepSpeedTranslation, keywords: dict[str, Any]) -> dict[str, Any]:
    """The config's options overridden by ``zerofx.compile``'s keyword arguments where the config
    said "auto" (or nothing); a keyword that contradicts an explicit config value raises."""
    merged = dict(translation.options)
    for name, value in keywords.items():
        if name == "disable_passes" and name in merged:  # passes turned off: both lists' (overlap_comm=false adds one)
            merged[name] = tuple(dict.fromkeys((*merged[name], *((value,) if isinstance(value, str) else value))))
            continue
        if name in merged and name not in translation.from_auto and merged[name] != value:
            raise ZeroFXError(
                f"option {name}={value!r} contradicts the DeepSpeed config, which gives "
                f"{merged[name]!r}; change one of them"
            )
        merged[name] = value
    return merged
