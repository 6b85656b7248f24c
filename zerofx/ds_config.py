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
      (and offload_param.device, stage 3;                 (one tier holds master shards and optimizer state)
      the old cpu_offload / cpu_offload_param)
    ...offload_*.nvme_path                              offload_dir
    zero_optimization.stage3_param_persistence_threshold persistence_threshold (elements; at most it: whole)
    zero_optimization.reduce_bucket_size (elements)     bucket_bytes (elements x the reduce dtype's size;
                                                          stage 1's end-of-backward reduce: 32 MiB buckets, warned)
    zero_optimization.stage3_prefetch_bucket_size       prefetch_bytes (elements x the compute dtype's size)
    zero_optimization.overlap_comm = false              disable_passes += ("schedule",)
    bf16.enabled                                        param_dtype=torch.bfloat16
    fp16.enabled (+ initial_scale_power, loss_scale_window)  param_dtype=torch.float16, loss_scale="dynamic"
    fp16.hysteresis, fp16.min_loss_scale,               loss_scale_hysteresis, min_loss_scale,
      fp16.consecutive_hysteresis                        loss_scale_consecutive_hysteresis (DeepSpeed's
                                                          2 and 1 when absent: its scale schedule, step for step)
    communication_data_type                             reduce_dtype
    data_types.grad_accum_dtype                         reduce_dtype (zerofx accumulates and reduces in one dtype)
    activation_checkpointing (+ cpu_checkpointing)      checkpoint="full" (+ offload_activations="host")
    zero_optimization.zero_quantized_weights            quantize_weights="int8" (stage 3; a keyword may say "fp8")
    zero_optimization.zero_quantized_gradients          quantize_grads="int8" (stages 2-3; a keyword may say "int4")

DeepSpeed's field names for its ``stage3_*`` keys (``prefetch_bucket_size``,
``param_persistence_threshold``, ``max_live_parameters``, ...), which its config model takes as
well, read as those keys; both spellings of one key is an error. Switches are read as DeepSpeed's
config model reads them: ``1`` / ``0`` and ``"true"`` / ``"false"`` (``"yes"``, ``"on"``, ...) are
true and false.

``"auto"`` values are resolved as the HF transformers integration resolves them: bucket sizes
and the persistence threshold from the model's hidden size (``hidden_size**2``,
``0.9 * hidden_size**2``, ``10 * hidden_size``), or zerofx's own ``"auto"`` when the hidden size
is unknown; ``bf16`` / ``fp16`` ``"auto"`` is resolved from ``--bf16`` / ``--fp16`` by
``zerofx.hf.ZeroFXTrainer`` (as HF's integration resolves it) and is off elsewhere unless a
keyword argument of ``zerofx.compile`` says otherwise; the fp16 loss-scale keys' ``"auto"`` is
DeepSpeed's default, as DeepSpeed reads it. Options that came from ``"auto"`` (or from DeepSpeed's
default for an absent fp16 key) yield to keyword arguments; an explicit config value that a
keyword argument contradicts is an error naming both, an explicit "off" too (``bf16.enabled:
false`` and no fp16, an offload ``device: "none"``, ``zero_quantized_weights`` /
``zero_quantized_gradients`` / ``cpu_checkpointing: false``, ``zero_hpz_partition_size: 1``). A
keyword may pick the format of a ZeRO++ switch that is on (``quantize_weights="fp8"``,
``quantize_grads="int4"``). A partial offload (``ratio`` below 1)
offloads all of it, with a warning. ``train_batch_size`` must be ``train_micro_batch_size_per_gpu
x gradient_accumulation_steps x`` the data-parallel size when all three are numbers (DeepSpeed
asserts it).

Not in zerofx, so an error when switched on: ``torch_autocast`` (zerofx does not wrap the
forward: run it under ``torch.autocast`` yourself, or use ``bf16``), ``sparse_gradients``.
DeepSpeed's ``compile`` section has no effect (zerofx always compiles, with its own passes).
Precision keys zerofx does not follow are warned about: ``bf16.check_grad_overflow`` (zerofx does
not skip a bf16 step on inf/NaN gradients; DeepSpeed does at stages 1 and 2 unless the key is
false, and always at stage 3), ``bf16.immediate_grad_update`` (gradients accumulate in the reduce
dtype anyway), ``fp16.fp16_master_weights_and_grads`` (masters stay fp32).
Other keys DeepSpeed documents and zerofx does not follow (the ``_NOT_FOLLOWED`` tables) are named
in a warning when they only tune how DeepSpeed runs, and are an error when they would change
what is computed (``bf16.bf16_master_weights_and_grads``, ``zero_optimization.zenflow``, ...);
only a key DeepSpeed does not know gets a "did you mean".
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zerofx.errors import ZeroFXError
from zerofx.options import _dtype, closest

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
    "comet",
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

# NOTE: DeepSpeed keys zerofx does not follow. Keys DeepSpeed 0.19.8's config documents that zerofx
# has no counterpart for. _TUNING: the key only tunes how DeepSpeed runs (its fetching, logging,
# engines zerofx does not have): named in one warning. Otherwise the entry is (keeps, why): the
# value (or a test of it) that leaves DeepSpeed's arithmetic what zerofx computes, and why any other
# value would not; another value is an error. A key missing from every table is unknown, and only
# an unknown key gets a "did you mean".
_TUNING = None
_NOT_FOLLOWED: dict[str, Any] = {
    "disable_python_gc": _TUNING,
    "log_level": _TUNING,
    "timers": _TUNING,
    "autotuning": _TUNING,
    "datastates_ckpt": _TUNING,
    "dataloader_drop_last": _TUNING,  # DeepSpeed's data loader: the loop builds its own
    "use_data_before_expert_parallelism": _TUNING,
    "disable_allgather": _TUNING,  # read, and used nowhere, by DeepSpeed 0.19.8
    "hybrid_engine": _TUNING,  # DeepSpeed's RLHF generation engine
    "managed_gradient_accumulation": _TUNING,  # the loop owns the accumulation boundary (zerofx.no_sync)
    "seq_parallel_communication_data_type": _TUNING,  # DeepSpeed's sequence-parallel groups
    "pipeline": _TUNING,  # DeepSpeed's pipeline engine (a PipelineModule)
    "gradient_allreduce_op": (
        lambda v: isinstance(v, str) and v.lower() == "mean",
        "zerofx averages gradients over the ranks ('mean', DeepSpeed's default); 'sum' would step on their sum",
    ),
    "weight_quantization": (None, "DeepSpeed's quantized weights change what the forward computes"),
    "tensor_parallel": (
        lambda v: v is None or isinstance(v, dict) and v.get("autotp_size", 0) in (0, 1),
        "DeepSpeed's AutoTP (autotp_size > 1) is not zerofx's tensor parallelism: parallelize the model "
        "on a (dp, tp) mesh and pass tp_dim",
    ),
    "expert_parallel": (
        lambda v: v is None or isinstance(v, dict) and not _flag(v.get("enabled", False), "expert_parallel.enabled"),
        "DeepSpeed's AutoEP swaps the model's expert layers for its own",
    ),
}
_ZERO_NOT_FOLLOWED: dict[str, Any] = {
    "stage3_module_granularity_threshold": _TUNING,  # zerofx buckets gathers by transformer block
    "stage3_use_all_reduce_for_fetch_params": _TUNING,
    "stage3_allgather_sequential": _TUNING,
    "compute_grad_norm": _TUNING,  # zerofx computes no norm in the engine: clip_grad_norm_ is the loop's
    "parameter_alignment": _TUNING,
    "pipeline_loading_checkpoint": _TUNING,
    "override_module_apply": _TUNING,
    "enable_sanity_checks": _TUNING,
    "save_muon_momentum_buffer_in_memory": _TUNING,
    "leaf_module": _TUNING,
    "cpu_offload_use_pin_memory": _TUNING,
    "zenflow": (
        None,
        "ZenFlow applies the updates of the less important gradients asynchronously, steps late, "
        "where zerofx steps every parameter on its own gradient",
    ),
}
_BF16_NOT_FOLLOWED: dict[str, Any] = {
    "bf16_master_weights_and_grads": (False, "zerofx keeps fp32 master weights and gradient shards"),
    "bf16_optimizer_states": (False, "zerofx keeps optimizer state in the master weights' dtype (fp32)"),
}
_OFFLOAD_NOT_FOLLOWED: dict[str, Any] = {
    "super_offload": _TUNING,  # SuperOffload's speculative CPU step, rolled back on overflow: same updates
    "cpuadam_cores_perc": _TUNING,
    # DeepSpeed's own pinned buffers, swap buffers and I/O pipelining: zerofx stages through its own
    # (zerofx/runtime/offload_store.py)
    "pin_memory": _TUNING,
    "buffer_count": _TUNING,
    "buffer_size": _TUNING,
    "fast_init": _TUNING,
    "max_in_cpu": _TUNING,
    "pipeline": _TUNING,
    "pipeline_read": _TUNING,
    "pipeline_write": _TUNING,
}
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
    *_NOT_FOLLOWED,
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
    "cpu_offload_param",
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
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
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


_ZERO = (
    _ZERO_MAPPED
    | set(_ZERO_BUILT_IN)
    | _ZERO_NO_EFFECT
    | set(_ZERO_UNSUPPORTED)
    | set(_ZERO_NOT_FOLLOWED)
    | {"zero_hpz_partition_size"}
)
_OFFLOAD_KEYS = {"device", "nvme_path", "ratio", *_OFFLOAD_NOT_FOLLOWED}
_BF16_KEYS = {"enabled", "immediate_grad_update", "check_grad_overflow", *_BF16_NOT_FOLLOWED}
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
_DATA_TYPES_KEYS = {"grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules"}
# DeepSpeed's fp16 loss-scale defaults (its DeepSpeedFP16Config), what "auto" or an absent key means there
_FP16_DEFAULTS = {"initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}


@dataclass
class DeepSpeedTranslation:
    """What a DeepSpeed config means for zerofx (see the module docstring)."""

    options: dict[str, Any] = field(default_factory=dict)  # zerofx.compile keywords
    # options resolved from "auto" (or DeepSpeed's default for an absent key): keywords override them
    from_auto: set[str] = field(default_factory=set)
    training: dict[str, Any] = field(default_factory=dict)  # for the training loop (clipping, accumulation, ...)
    warnings: list[str] = field(default_factory=list)  # one line per key with no effect, for warnings.warn
    # lines that hold only if the run trains in bf16: from bf16.enabled="auto", which a keyword
    # (param_dtype=torch.bfloat16) or the HF Trainer's --bf16 turns on; zerofx.compile warns them then
    bf16_warnings: list[str] = field(default_factory=list)
    # lines that hold only if gradients stay int8 (no quantize_grads='int4' keyword)
    int8_grad_warnings: list[str] = field(default_factory=list)


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
    if isinstance(config, str) and config.lstrip().startswith("{") and not os.path.exists(config):
        # DeepSpeed takes a dict, a file or base64 text; JSON text read as a path would say "no such file"
        raise ZeroFXError(
            f"config={config[:40]!r}... is JSON text, not a file: pass a dict (json.loads of the text) or the "
            "path of a JSON file"
        )
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


def _shown(value: Any) -> str:
    """``value`` as the JSON file spells it (null, true), for messages."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _check_keys(section: dict, valid: set[str], where: str) -> None:
    if not isinstance(section, dict):
        raise ZeroFXError(f"DeepSpeed config: {where} must be an object, got {_shown(section)}")
    for key in section:
        if key not in valid:
            raise ZeroFXError(
                f"DeepSpeed config: unknown key {where + '.' if where else ''}{key}"
                f"{closest(key, valid)}; zerofx reads the keys DeepSpeed documents "
                "(see zerofx/ds_config.py)"
            )


def _not_followed(section: dict, table: dict[str, Any], where: str, notes: list[str]) -> None:
    """Name ``section``'s keys from ``table`` that only tune DeepSpeed in one warning, and refuse
    those set to change what is computed (NOTE: DeepSpeed keys zerofx does not follow)."""
    tuning = []
    for key, entry in table.items():
        if key not in section:
            continue
        if entry is _TUNING:
            tuning.append(f"{where}{key}")
            continue
        keeps, why = entry
        value = section[key]
        if callable(keeps):
            same = keeps(value)
        elif isinstance(keeps, bool):
            same = _flag(value, f"{where}{key}") is keeps
        else:
            same = value == keeps
        if not same:
            raise ZeroFXError(
                f"DeepSpeed config: {where}{key}={_shown(value)} is a DeepSpeed key zerofx does not follow: {why}; "
                "remove it"
            )
    if tuning:
        notes.append(
            f"{', '.join(tuning)}: DeepSpeed keys zerofx does not follow; they tune how DeepSpeed runs, not what "
            "it computes: no effect here"
        )


_TRUE = {"true", "t", "yes", "y", "on", "1"}
_FALSE = {"false", "f", "no", "n", "off", "0"}


def _flag(value: Any, where: str) -> bool:
    """A DeepSpeed switch as its config model (pydantic's bool) reads it: true / false, 1 / 0, and
    the strings true / false, yes / no, on / off, 1 / 0 in any case. A switch read with ``is True``
    would take DeepSpeed's ``1`` for off."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise ZeroFXError(f"DeepSpeed config: {where}={_shown(value)}: give true or false")


def _enabled(section: dict, where: str) -> bool | str:
    value = section.get("enabled", False)
    if value == "auto":
        return value
    try:
        return _flag(value, f"{where}.enabled")
    except ZeroFXError:
        raise ZeroFXError(f'DeepSpeed config: {where}.enabled={_shown(value)}: give true, false or "auto"') from None


def _elements(value: Any, where: str) -> int | str:
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
        raise ZeroFXError(f'DeepSpeed config: {where}={value!r}: give a number of elements >= 0 or "auto"')
    return int(value)


def _fp16_integer(fp16: dict, key: str, low: int, high: float, what: str) -> tuple[int, bool]:
    """``fp16.<key>`` as DeepSpeed reads it (an integer; 16.0 is 16), and whether it is DeepSpeed's
    default because the key is absent or ``"auto"`` (which DeepSpeed's config model drops)."""
    value = fp16.get(key, "auto")
    if value == "auto":
        return _FP16_DEFAULTS[key], True
    whole = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and value == int(value)
        and low <= value <= high
    )
    if not whole:
        raise ZeroFXError(f"DeepSpeed config: fp16.{key}={_shown(value)}: give {what}")
    return int(value), False


def _fp16_scaling(fp16: dict, opts: dict, from_auto: set[str]) -> None:
    """fp16's dynamic loss scaling, DeepSpeed's schedule included: its hysteresis (2) and floor (1)
    apply when the keys are absent, so they become options either way (NOTE: DeepSpeed's scale
    schedule, zerofx/runtime/loss_scaling.py)."""
    scale = fp16.get("loss_scale", 0)
    if scale != "auto":
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale >= 0:
            raise ZeroFXError(f'DeepSpeed config: fp16.loss_scale={_shown(scale)}: give 0 (dynamic scaling) or "auto"')
        if scale != 0:
            raise ZeroFXError(
                f"DeepSpeed config: fp16.loss_scale={scale!r} is a static loss scale; zerofx scales "
                "dynamically: set loss_scale to 0"
            )
    opts["loss_scale"] = "dynamic"
    power, auto = _fp16_integer(
        fp16, "initial_scale_power", 0, 127, "an integer from 0 to 127 (the first scale is 2**initial_scale_power)"
    )
    if "initial_scale_power" in fp16:
        opts["initial_loss_scale"] = 2.0**power
        if auto:
            from_auto.add("initial_loss_scale")
    window, auto = _fp16_integer(fp16, "loss_scale_window", 1, math.inf, "a number of good steps >= 1")
    if "loss_scale_window" in fp16:
        opts["loss_scale_window"] = window
        if auto:
            from_auto.add("loss_scale_window")
    hysteresis, auto = _fp16_integer(
        fp16, "hysteresis", 1, math.inf, "a number of overflows >= 1 (with 0 DeepSpeed never lowers the scale)"
    )
    opts["loss_scale_hysteresis"] = hysteresis
    if auto:
        from_auto.add("loss_scale_hysteresis")
    floor, auto = _fp16_integer(fp16, "min_loss_scale", 1, math.inf, "an integer >= 1 (DeepSpeed's floor is whole)")
    opts["min_loss_scale"] = float(floor)
    if auto:
        from_auto.add("min_loss_scale")
    if 2.0**power < floor:
        raise ZeroFXError(
            f"DeepSpeed config: fp16.initial_scale_power={power} starts the scale at {2.0**power:g}, below "
            f"fp16.min_loss_scale={floor}: start at or above the floor"
        )
    consecutive = fp16.get("consecutive_hysteresis", False)
    if consecutive == "auto":
        from_auto.add("loss_scale_consecutive_hysteresis")
    elif _flag(consecutive, "fp16.consecutive_hysteresis"):
        opts["loss_scale_consecutive_hysteresis"] = True


def from_deepspeed(
    config: Any, *, hidden_size: int | None = None, data_parallel_size: int | None = None
) -> DeepSpeedTranslation:
    """Translate a DeepSpeed config (a dict or a JSON file's path); raises on what it cannot honour.
    ``data_parallel_size`` (the ranks a batch is split over) checks the batch sizes as DeepSpeed
    does; without it they are checked against the process group's world size (``_check_batch_sizes``)."""
    cfg = _load(config)
    _check_keys(cfg, _TOP, "")
    out = DeepSpeedTranslation()
    opts, notes = out.options, out.warnings
    _not_followed(cfg, _NOT_FOLLOWED, "", notes)

    # -- the stage first: what DeepSpeed does with some precision keys depends on it -------------------
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ZeroFXError(f"DeepSpeed config: zero_optimization must be an object, got {_shown(zero)}")
    zero = _stage3_spellings(zero)
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

    # -- precision ---------------------------------------------------------------------------------
    bf16 = cfg.get("bf16", cfg.get("bfloat16", {}))
    if "bf16" in cfg and "bfloat16" in cfg:
        raise ZeroFXError("DeepSpeed config: both bf16 and bfloat16 are given; keep one")
    _check_keys(bf16, _BF16_KEYS, "bf16")
    fp16 = cfg.get("fp16", {})
    _check_keys(fp16, _FP16_KEYS, "fp16")
    if "amp" in cfg:
        if not isinstance(cfg["amp"], dict):
            raise ZeroFXError(f"DeepSpeed config: amp must be an object, got {_shown(cfg['amp'])}")
        if _enabled(cfg["amp"], "amp") is True:
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
    # keys zerofx does not follow, also under "auto" (the HF Trainer's configs, precision from --bf16),
    # where they are said only if the run does train in bf16
    if b in (True, "auto"):
        bf16_notes = notes if b is True else out.bf16_warnings
        _not_followed(bf16, _BF16_NOT_FOLLOWED, "bf16.", bf16_notes)
        _bf16_overflow_note(bf16, stage, bf16_notes)
        if "immediate_grad_update" in bf16:
            bf16_notes.append(
                "bf16.immediate_grad_update has no effect: zerofx accumulates gradients in the reduce dtype "
                "(fp32 unless reduce_dtype / communication_data_type says otherwise)"
            )
    if f is True:
        opts["param_dtype"] = torch.float16
        _fp16_scaling(fp16, opts, out.from_auto)
        if fp16.get("auto_cast", "auto") != "auto" and not _flag(fp16["auto_cast"], "fp16.auto_cast"):
            notes.append("fp16.auto_cast=false has no effect: zerofx casts floating inputs to param_dtype")
    master = fp16.get("fp16_master_weights_and_grads", False)
    if f in (True, "auto") and master != "auto" and _flag(master, "fp16.fp16_master_weights_and_grads"):
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
    _check_keys(data_types, _DATA_TYPES_KEYS, "data_types")
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
    _data_types(data_types, b, f, notes)
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
    opts["stage"] = stage
    _not_followed(zero, _ZERO_NOT_FOLLOWED, "zero_optimization.", notes)
    hpz = zero.get("zero_hpz_partition_size", 1)
    if "zero_hpz_partition_size" in zero and hpz in (0, 1):  # hpZ off in so many words: secondary_shard contradicts
        opts["secondary_shard"] = False
    if hpz not in (0, 1):  # hpZ's group is the mesh's inner dimension, which a config cannot give
        raise ZeroFXError(
            f"DeepSpeed config: zero_optimization.zero_hpz_partition_size={hpz!r}: zerofx's hpZ takes its "
            f"group from the mesh: compile on a 2-D mesh (nodes, {hpz}) with secondary_shard=True, and "
            "remove the key"
        )
    for key, what in _ZERO_UNSUPPORTED.items():
        if bool(zero.get(key)) if key == "mics_shard_size" else _switch(zero, key, False):
            raise ZeroFXError(f"DeepSpeed config: zero_optimization.{key}={zero[key]!r}: {what} is not in zerofx yet")
    # ZeRO++ switches: on is int8 blocks, as DeepSpeed's default (a keyword may refine it: _same);
    # off in so many words, a keyword quantizing contradicts it
    quantized_weights = _switch(zero, "zero_quantized_weights", False)
    if "zero_quantized_weights" in zero:
        opts["quantize_weights"] = "int8" if quantized_weights else None
    if quantized_weights and stage != 3:
        raise ZeroFXError(
            f"DeepSpeed config: zero_optimization.zero_quantized_weights at stage {stage}: ZeRO++'s qwZ quantizes "
            "stage 3's parameter all-gathers (stages 1 and 2 gather none); use stage 3, or drop the key"
        )
    quantized_grads = _switch(zero, "zero_quantized_gradients", False)
    if "zero_quantized_gradients" in zero and not quantized_grads:
        opts["quantize_grads"] = None
    if quantized_grads and stage == 1:
        raise ZeroFXError(
            "DeepSpeed config: zero_optimization.zero_quantized_gradients at stage 1: zerofx quantizes the "
            "gradient reduce-scatters of stages 2 and 3 (stage 1 reduces once, after the backward); use stage 2 "
            "or 3, or drop the key"
        )
    if quantized_grads:  # ZeRO++ qgZ
        opts["quantize_grads"] = "int8"
        out.int8_grad_warnings.append(  # said only where no keyword picked int4 (zerofx.compile)
            "zero_quantized_gradients: zerofx sends int8 gradient blocks on every hop "
            "(quantize_grads='int8'); pass quantize_grads='int4' for half the bytes"
        )
    for key, default in _ZERO_BUILT_IN.items():
        if _switch(zero, key, default) != default:
            notes.append(
                f"zero_optimization.{key}={zero[key]!r} has no effect: zerofx's collectives always behave "
                f"as {key}={str(default).lower()}"
            )
    no_effect = sorted(set(zero) & _ZERO_NO_EFFECT)
    if no_effect:
        notes.append(f"zero_optimization.{', zero_optimization.'.join(no_effect)}: no effect in zerofx")
    if _switch(zero, "overlap_comm", True) is False:
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
        if _switch(ac, "cpu_checkpointing", False, where="activation_checkpointing"):
            opts["offload_activations"] = "host"
        elif "cpu_checkpointing" in ac:  # off in so many words: a keyword offloading activations contradicts
            opts["offload_activations"] = "none"
        ignored = sorted(k for k in set(ac) - {"cpu_checkpointing"} if ac[k])
        if ignored:
            notes.append(
                f"activation_checkpointing.{', activation_checkpointing.'.join(ignored)}: no effect (zerofx "
                "checkpoints every transformer block of the traced graph; nothing is partitioned)"
            )

    # -- the training loop's and nobody's ---------------------------------------------------------
    out.training = {k: cfg[k] for k in _TRAINING if k in cfg}
    _check_batch_sizes(out.training, data_parallel_size)
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


def _switch(section: dict, key: str, default: bool, where: str = "zero_optimization") -> bool:
    """``section[key]`` read as DeepSpeed reads a switch (``_flag``), ``default`` when absent."""
    return _flag(section[key], f"{where}.{key}") if key in section else default


def _bf16_overflow_note(bf16: dict, stage: int, notes: list[str]) -> None:
    """DeepSpeed skips an optimizer step whose gradients hold inf or NaN in bf16 too: at stages 1
    and 2 unless ``check_grad_overflow`` is false (its default is true), at stage 3 always (its
    stage 3 skips a step whose gradient norm is not finite, whatever the key says). zerofx steps
    on: say so unless the config asks DeepSpeed for what zerofx does."""
    check = _switch(bf16, "check_grad_overflow", True, where="bf16")
    skip = "check torch.isfinite(torch.nn.utils.clip_grad_norm_(...)) before optimizer.step() to skip such steps"
    if stage == 3:
        notes.append(
            "bf16: DeepSpeed's stage 3 skips a step whose gradient norm is inf or NaN (whatever "
            f"bf16.check_grad_overflow says); zerofx does not skip a bf16 step: {skip}"
        )
    elif check:
        given = "true" if "check_grad_overflow" in bf16 else "absent, DeepSpeed's default true"
        notes.append(
            f"bf16.check_grad_overflow ({given}): DeepSpeed skips a bf16 step whose gradients hold inf or NaN, "
            f"zerofx does not skip it: {skip}; or set check_grad_overflow false"
        )


def _data_types(data_types: dict, b: bool | str, f: bool | str, notes: list[str]) -> None:
    """``data_types``' keys besides ``grad_accum_dtype``: ``param_dtype`` must name the precision
    bf16 / fp16 turn on (DeepSpeed asserts it); zerofx never casts buffers, so ``buffer_dtype`` is
    an error and ``keep_in_fp32_modules`` has nothing to keep."""
    name = data_types.get("param_dtype")
    if name is not None:
        dtype = _DTYPES.get(name)
        if dtype is None:
            raise ZeroFXError(f"DeepSpeed config: data_types.param_dtype={name!r}: choose one of {sorted(_DTYPES)}")
        mode = torch.float16 if f is True else torch.bfloat16 if b is True else torch.float32
        if "auto" not in (b, f) and dtype is not mode:
            raise ZeroFXError(
                f"DeepSpeed config: data_types.param_dtype={name!r} but the enabled precision is {mode} "
                "(bf16.enabled / fp16.enabled): set the matching enabled flag or drop data_types.param_dtype"
            )
    if data_types.get("buffer_dtype") is not None:
        raise ZeroFXError(
            f"DeepSpeed config: data_types.buffer_dtype={data_types['buffer_dtype']!r} is a DeepSpeed key zerofx "
            "does not follow: zerofx never casts buffers (BatchNorm's running stats stay fp32); remove it"
        )
    if data_types.get("keep_in_fp32_modules", "auto") != "auto":
        notes.append("data_types.keep_in_fp32_modules: no effect in zerofx, which never casts buffers")


def _check_batch_sizes(training: dict, data_parallel_size: int | None) -> None:
    """DeepSpeed asserts train_batch_size = train_micro_batch_size_per_gpu x
    gradient_accumulation_steps x the data-parallel size; a loop reading two of them would train
    another batch than the third says. Checked when all three are numbers: against
    ``data_parallel_size`` when the caller knows it, else against the process group's world size,
    which the data-parallel size divides (tensor parallelism takes the rest): then an error only
    when no divisor fits. Nothing to check without a process group."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    values = [training.get(k) for k in keys]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return
    for key, value in zip(keys, values):
        if not value > 0:
            raise ZeroFXError(f'DeepSpeed config: {key}={value!r}: give a number > 0 (or "auto")')
    batch, micro, steps = values
    said = (
        f"train_batch_size={batch!r} is not train_micro_batch_size_per_gpu={micro!r} x "
        f"gradient_accumulation_steps={steps!r} x the data-parallel size"
    )
    if data_parallel_size is not None:
        if batch != micro * steps * data_parallel_size:
            raise ZeroFXError(
                f"DeepSpeed config: {said} ({data_parallel_size}), as DeepSpeed requires; fix one of them or set one "
                'to "auto"'
            )
        return
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    if not any(world % size == 0 and batch == micro * steps * size for size in range(1, world + 1)):
        raise ZeroFXError(
            f"DeepSpeed config: {said} (the world size {world}, or a divisor of it with tensor parallelism), as "
            'DeepSpeed requires; fix one of them or set one to "auto"'
        )


def _offload(zero: dict, stage: int, opts: dict, notes: list[str]) -> None:
    sections = {}
    switched_off = False
    for key in ("offload_optimizer", "offload_param"):
        if zero.get(key) is not None:  # null: DeepSpeed's own "no offload"
            _check_keys(zero[key], _OFFLOAD_KEYS, f"zero_optimization.{key}")
            device = zero[key].get("device", "none")
            if device != "none":  # (tuning an offload that is off: no effect in DeepSpeed either)
                _not_followed(zero[key], _OFFLOAD_NOT_FOLLOWED, f"zero_optimization.{key}.", notes)
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
    # DeepSpeed's old spellings of offload_optimizer.device=cpu and offload_param.device=cpu
    for old, key in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if _switch(zero, old, False):
            sections.setdefault(key, {"device": "cpu"})
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


def _same(name: str, a: Any, b: Any) -> bool:
    """Whether a keyword and the config's option say the same thing, however spelled: dtypes as
    Options reads them ("bf16" is torch.bfloat16; a float32 param_dtype is None), folders as one
    path ("/x/nv/" is "/x/nv")."""
    if name in ("param_dtype", "reduce_dtype"):
        a, b = _dtype(name, a), _dtype(name, b)
        if name == "param_dtype":
            a, b = (None if d is torch.float32 else d for d in (a, b))
    elif name == "offload_dir" and isinstance(a, (str, os.PathLike)) and isinstance(b, (str, os.PathLike)):
        a, b = (os.path.normpath(os.path.abspath(os.fspath(p))) for p in (a, b))
    elif (
        name in ("quantize_weights", "quantize_grads") and (name, a) in _REFINED
    ):  # DeepSpeed's switch turns quantization on; the keyword picks the format
        return b in _REFINED[name, a]
    return a == b


# (option, what a ZeRO++ switch in the config gives) -> the keyword values that agree with it:
# zero_quantized_weights is "8-bit weights" (int8 or fp8 here), zero_quantized_gradients
# "quantized gradients" (DeepSpeed's qgZ sends int4 inside a node and int8 across nodes)
_REFINED = {("quantize_weights", "int8"): ("int8", "fp8"), ("quantize_grads", "int8"): ("int8", "int4")}


def merge_with_keywords(translation: DeepSpeedTranslation, keywords: dict[str, Any]) -> dict[str, Any]:
    """The config's options overridden by ``zerofx.compile``'s keyword arguments where the config
    said "auto" (or nothing); a keyword that contradicts an explicit config value raises."""
    merged = dict(translation.options)
    for name, value in keywords.items():
        if name == "disable_passes" and name in merged:  # passes turned off: both lists' (overlap_comm=false adds one)
            merged[name] = tuple(dict.fromkeys((*merged[name], *((value,) if isinstance(value, str) else value))))
            continue
        if name in merged and name not in translation.from_auto and not _same(name, merged[name], value):
            raise ZeroFXError(
                f"option {name}={value!r} contradicts the DeepSpeed config, which gives "
                f"{merged[name]!r}; change one of them"
            )
        merged[name] = value
    return merged
