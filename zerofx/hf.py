"""HF transformers' ``Trainer`` with zerofx as its engine: ``ZeroFXTrainer``.

    # torchrun --nproc-per-node 8 train.py       (ranks launched as for any Trainer script)
    from zerofx.hf import ZeroFXTrainer
    trainer = ZeroFXTrainer(model=model, args=training_args, train_dataset=ds,
                            zerofx_config="ds_config.json")   # or zerofx_options={"stage": 3, ...}
    trainer.train()
    trainer.save_model("out")    # HF safetensors + config.json: from_pretrained("out") loads it

The one subclass a DeepSpeed user needs instead of ``--deepspeed ds_config.json``: the same
config (``zerofx_config``, translated by zerofx/ds_config.py) or zerofx's own keywords
(``zerofx_options``), the same ``TrainingArguments``, datasets, callbacks and logging. Requires
``pip install 'zerofx[hf]'`` (transformers >= 5 and accelerate). As with HF's DeepSpeed
integration, the config's ``"auto"`` values are filled from ``TrainingArguments`` (``bf16`` /
``fp16`` from ``--bf16`` / ``--fp16``: bf16 or fp16 parameters over fp32 master weights, an fp16
loss scaled by zerofx's scaler as DeepSpeed scales it, NOTE: loss scaling under the Trainer), and
an explicit value they contradict is an error naming both.

How it plugs in (what was tried: ``Trainer`` wraps any multi-process model in DDP through
accelerate's ``prepare``, which a model of DTensor shards cannot take, and accelerate has no
plugin slot for a third-party engine). transformers' own path for models that were sharded when
they were loaded (``from_pretrained(distributed_config=...)``) skips that: the model "owns
placement and gradient reduction", so accelerate prepares it without wrapping or moving it.
A zerofx model owns both in the same sense, so ``ZeroFXTrainer`` shards and compiles the model
(``zerofx.compile``) once the process group exists (accelerate initializes it from torchrun's
environment when ``args.device`` is first read), marks it for that path, and otherwise leaves
the Trainer alone. Its loss scaling assumes DDP's averaged gradients, which zerofx's
reduce-scatter averages match, and ``clip_grad_norm_`` over DTensor shards returns the global
norm. Overrides:

* ``training_step``: micro-steps inside a gradient-accumulation window run under
  ``zerofx.no_sync`` (one reduction per window, as DDP's ``no_sync`` does under accelerate);
* ``save_model``: every rank writes a zerofx checkpoint, then rank 0 exports it to HF
  safetensors (``zerofx.checkpoint.export``, one tensor at a time) next to ``config.json``; in a
  resumable ``checkpoint-N`` folder that checkpoint is ``zerofx_state/`` itself, written with the
  optimizer, so the parameters are written once for both;
* the checkpoint hooks ``_save_optimizer_and_scheduler``, ``_load_from_checkpoint``,
  ``_load_optimizer_and_scheduler`` and ``_load_best_model`` (below);
* ``_clip_grad_norm`` / ``_get_grad_norm``: an fp16 model's gradients are unscaled first (NOTE:
  loss scaling under the Trainer; its scaler is accelerate's ``scaler``), and a callback hands
  accelerate's optimizer wrapper zerofx's step on local shards after each step (``_KeepLocalStep``);
* ``evaluation_loop``: ``--bf16_full_eval`` / ``--fp16_full_eval`` without the Trainer's cast of
  the model (it evaluates at its ``param_dtype``, checked against the flag at construction).

Resumable checkpoints (``save_strategy`` other than ``"no"``, without ``save_only_model``): each
``checkpoint-N`` folder holds what ``save_model`` writes (HF safetensors, so ``from_pretrained``
loads any checkpoint), the Trainer's own files (``trainer_state.json``, the scheduler, every
rank's RNG state) and ``zerofx_state/``, a sharded ``zerofx.checkpoint`` of the model and
optimizer, each rank writing its shards only. ``trainer.train(resume_from_checkpoint=...)``
loads the model from it before training and only the optimizer's state from it once the
Trainer has built one (``zerofx.checkpoint.load(..., load_model=False)``: the parameters are
read once); a
checkpoint saved with ``save_only_model=True`` has no ``zerofx_state/``, so resuming from it
loads the model from its safetensors (``zerofx.checkpoint.load_hf``) and starts the optimizer
afresh, as the plain Trainer does. ``load_best_model_at_end`` loads the best checkpoint the same
way. Resuming continues bit for bit as the uninterrupted run (tests/test_hf.py). transformers refuses optimizer checkpoints for its own load-time-sharded models, whose
optimizer state it cannot save; ``ZeroFXTrainer`` saves that state itself, so it passes that
check and leaves ``save_only_model`` as the user set it.

PEFT models (``peft.get_peft_model``, built before the Trainer) take the same path: the flag
that selects it is also set on the transformers model inside the wrapper, which is where the
Trainer's read of it lands. ``save_model`` writes their adapters as the plain Trainer does
(``save_pretrained``: ``adapter_config.json``, ``adapter_model.safetensors``), and such a folder
loads back as a checkpoint (``_load_from_checkpoint``).

Not supported: ``--deepspeed`` / ``--fsdp`` in the same run (an error).

A custom loop on ``accelerate.Accelerator`` takes a zerofx model through :func:`prepare` in
place of ``accelerator.prepare`` (which would wrap it in DDP, and refuses DTensor parameters)::

    model = zerofx.compile(model, mesh)
    model, opt, loader = zerofx.hf.prepare(accelerator, model, opt, loader)
    for batch in loader:
        with accelerator.accumulate(model):      # model.no_sync() inside a window
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import zerofx
from zerofx.checkpoint import same_on_every_rank
from zerofx.errors import ZeroFXError, some_names
from zerofx.runtime.accumulation import no_sync
from zerofx.runtime.local_step import local_step_method
from zerofx.runtime.params import runtime_of
from zerofx.sharding import is_sharded, mesh_of

__all__ = ["ZeroFXTrainer", "prepare", "STATE_DIR"]

# the sharded model + optimizer checkpoint inside each of the Trainer's checkpoint-N folders
STATE_DIR = "zerofx_state"


# a DeepSpeed config's training-loop keys -> the TrainingArguments field that sets the same
_LOOP_KEYS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
}


ADAPTER_FILE = "adapter_model.safetensors"  # what PEFT's save_pretrained writes (safetensors)


def _is_peft(model: Any) -> bool:
    """Whether ``model`` is a PEFT model (peft is not imported unless the model is one)."""
    return type(model).__module__.startswith("peft.") and hasattr(model, "peft_config")


def _load_adapters(model: Any, path: Path) -> None:
    """A PEFT model's adapter weights from ``path`` (whole tensors; every rank reads the file and
    keeps its rows, through the sharded modules' ``load_state_dict``)."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(model, load_file(path))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ZeroFXError(f"ZeroFXTrainer: {path} holds weights this model has no place for: {some_names(unexpected)}")


def _checkpoint_layers(model: Any, args: TrainingArguments) -> None:
    """``TrainingArguments(activation_checkpointing=True)``: set it on the model's layers as the
    Trainer would (``activation_checkpointing_enable``, with its ``every_n_layers`` and
    ``offload``), before ``zerofx.compile`` takes it over (zerofx/layer_checkpointing.py, NOTE: a
    model's own layer checkpointing); the Trainer then leaves the layers alone (``train``)."""
    if not args.activation_checkpointing:
        return
    kwargs = dict(args.activation_checkpointing_kwargs or {})
    every, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs or None, every_n_layers=every, offload=offload
        )
    elif hasattr(model, "gradient_checkpointing_enable"):  # models with only transformers' older name
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
    else:
        raise ZeroFXError(
            f"TrainingArguments(activation_checkpointing=True), but {type(model).__name__} has no "
            "activation_checkpointing_enable: drop the setting and pass zerofx_options="
            "{'checkpoint': 'full'} (or checkpoint_modules=...) for zerofx's own checkpointing"
        )


def _check_full_eval(param_dtype: torch.dtype | None, args: TrainingArguments) -> None:
    """``--bf16_full_eval`` / ``--fp16_full_eval`` cast the whole model for evaluation, which the
    Trainer does with ``model.to(dtype=...)``: zerofx's shards (and their optimizer state) cannot
    be cast, so a zerofx model evaluates at its ``param_dtype``, which must then be that dtype
    (``evaluation_loop`` below skips the cast). Anything else is an error here, before training."""
    for flag, dtype in (("bf16_full_eval", torch.bfloat16), ("fp16_full_eval", torch.float16)):
        if getattr(args, flag) and param_dtype is not dtype:
            raise ZeroFXError(
                f"ZeroFXTrainer: --{flag} casts the model for evaluation, which zerofx's shards cannot take; a "
                f"zerofx model evaluates at its param_dtype ({param_dtype or torch.float32} here): compile it with "
                f'param_dtype={dtype} (--{flag[:4]} with a config\'s "enabled": "auto") or drop --{flag}'
            )


def _check_loop_settings(training: dict[str, Any], args: TrainingArguments) -> None:
    """The Trainer runs the loop from ``args``; a DeepSpeed config that says otherwise is an
    error naming both values (as HF's DeepSpeed integration does), ``"auto"`` is fine, and the
    config's optimizer / scheduler sections give way to ``args`` (one warning)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    wanted = {key: getattr(args, field) for key, field in _LOOP_KEYS.items()}
    wanted["train_batch_size"] = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    fields = {**_LOOP_KEYS, "train_batch_size": "per_device_train_batch_size x gradient_accumulation_steps x world"}
    clashes = [
        f"{key}={training[key]!r} but TrainingArguments give {wanted[key]!r} ({fields[key]})"
        for key in wanted
        if key in training and training[key] != "auto" and training[key] != wanted[key]
    ]
    clashes += _optimizer_clashes(training.get("optimizer"), args) + _scheduler_clashes(training.get("scheduler"), args)
    if clashes:
        raise ZeroFXError("ZeroFXTrainer: the DeepSpeed config contradicts TrainingArguments: " + "; ".join(clashes))
    ignored = [k for k in ("optimizer", "scheduler") if k in training]
    if ignored:
        warnings.warn(
            f"zerofx: DeepSpeed config: {' and '.join(ignored)} sections are not used: the Trainer builds them "
            "from TrainingArguments (optim, learning_rate, lr_scheduler_type, ...), which agree with what they give",
            stacklevel=3,
        )


# NOTE: the config's optimizer and scheduler under the Trainer
# With HF's DeepSpeed integration the config's optimizer and scheduler sections are what trains
# (DeepSpeed builds them), their "auto" values filled from TrainingArguments and an explicit value
# that contradicts them an error (transformers' HfTrainerDeepSpeedConfig.fill_match). Under
# ZeroFXTrainer the Trainer builds both from TrainingArguments; a section that says something else
# (another learning rate, betas, schedule) would train otherwise than the user's DeepSpeed run did,
# silently. So what the sections give must be what the arguments give: an Adam/AdamW section with
# an adamw optimizer (not DeepSpeed's Adam with ``adam_w_mode`` false: L2 decay), WarmupLR with
# constant_with_warmup, WarmupDecayLR with linear (the pairs HF documents) and a linear warmup
# (DeepSpeed's default ``warmup_type`` is log), and every explicit parameter equal to what HF
# would fill in (total and warmup steps from ``max_steps``); with epochs instead of ``max_steps``
# the total is only known once the data is, and is left to the Trainer.
_OPTIMIZER_ARGS = {
    "lr": lambda a: a.learning_rate,
    "betas": lambda a: [a.adam_beta1, a.adam_beta2],
    "eps": lambda a: a.adam_epsilon,
    "weight_decay": lambda a: a.weight_decay,
}
_SCHEDULERS = {"warmuplr": "constant_with_warmup", "warmupdecaylr": "linear"}


def _section(section: Any) -> tuple[str, dict]:
    if not isinstance(section, dict):
        return "", {}
    params = section.get("params")
    return str(section.get("type", "")), params if isinstance(params, dict) else {}


def _differs(given: Any, wanted: Any) -> bool:
    if isinstance(given, str) and given == "auto":
        return False
    if isinstance(wanted, list):
        return not isinstance(given, (list, tuple)) or [float(g) for g in given] != [float(w) for w in wanted]
    try:
        return float(given) != float(wanted)
    except (TypeError, ValueError):
        return True


def _optimizer_clashes(section: Any, args: TrainingArguments) -> list[str]:
    """What the config's optimizer section gives that TrainingArguments do not (NOTE: the
    config's optimizer and scheduler under the Trainer)."""
    kind, params = _section(section)
    if not kind:
        return []
    optim = str(getattr(args.optim, "value", args.optim))
    out = []
    if kind.lower() not in ("adam", "adamw") or not optim.startswith("adamw"):
        out.append(f"optimizer.type={kind!r} but TrainingArguments give optim={optim!r}")
    for key, value in params.items():
        if key in _OPTIMIZER_ARGS and _differs(value, _OPTIMIZER_ARGS[key](args)):
            out.append(f"optimizer.params.{key}={value!r} but TrainingArguments give {_OPTIMIZER_ARGS[key](args)!r}")
    decay = params.get("weight_decay", args.weight_decay)
    decay = args.weight_decay if decay == "auto" else decay
    if params.get("adam_w_mode") is False and kind.lower() == "adam" and _differs(decay, 0):
        out.append(
            "optimizer.params.adam_w_mode=false (DeepSpeed's Adam with L2 weight decay) but the Trainer's "
            f"optim={optim!r} decays the weights decoupled (AdamW)"
        )
    return out


def _scheduler_clashes(section: Any, args: TrainingArguments) -> list[str]:
    """The same for the scheduler section: its type's schedule and the values the arguments fix."""
    kind, params = _section(section)
    if not kind:
        return []
    schedule = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    out = []
    if _SCHEDULERS.get(kind.lower()) != schedule:
        pair = ", ".join(
            f"{k} with {v}" for k, v in (("WarmupLR", "constant_with_warmup"), ("WarmupDecayLR", "linear"))
        )
        out.append(
            f"scheduler.type={kind!r} but TrainingArguments give lr_scheduler_type={schedule!r} (the Trainer pairs {pair})"
        )
    wanted: dict[str, Any] = {"warmup_max_lr": args.learning_rate, "warmup_min_lr": 0}
    if args.max_steps > 0:  # what HF fills in (trainer_config_finalize); with epochs, only the data knows
        wanted["total_num_steps"] = args.max_steps
        wanted["warmup_num_steps"] = max(1, args.get_warmup_steps(args.max_steps))
    elif args.warmup_steps >= 1:
        wanted["warmup_num_steps"] = int(args.warmup_steps)
    for key, value in params.items():
        if key in wanted and _differs(value, wanted[key]):
            out.append(f"scheduler.params.{key}={value!r} but TrainingArguments give {wanted[key]!r}")
    # DeepSpeed warms up on a log curve unless told otherwise; the Trainer's schedules warm up linearly
    warmup = params.get("warmup_num_steps", "auto")
    steps = wanted.get("warmup_num_steps", 1) if warmup == "auto" else warmup
    if params.get("warmup_type", "log") != "linear" and _differs(steps, 1) and _differs(steps, 0):
        out.append(
            f"scheduler.params.warmup_type={params.get('warmup_type', 'log')!r} (DeepSpeed's default: log) but the "
            "Trainer's warmup is linear: set warmup_type to 'linear'"
        )
    return out


def _with_trainer_precision(config: Any, args: TrainingArguments) -> Any:
    """The DeepSpeed config with ``bf16`` / ``fp16`` ``"enabled": "auto"`` turned on by ``--bf16`` /
    ``--fp16``, as HF's DeepSpeed integration fills them (so ``"auto"`` under ``--bf16`` trains
    with bf16 parameters and fp32 master weights, as DeepSpeed would); without the flag it stays
    ``"auto"`` (off, unless ``zerofx_options`` give a ``param_dtype``). An explicit ``enabled``
    that the flag contradicts is an error naming both, as it is there. ``None`` stays ``None``."""
    if config is None:
        return None
    from zerofx.ds_config import _enabled, _load

    config = dict(_load(config))
    flags = {"bf16": bool(args.bf16 or args.bf16_full_eval), "fp16": bool(args.fp16 or args.fp16_full_eval)}
    clashes = []
    for key, spelled in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        section = config.get(key)
        if not isinstance(section, dict) or "enabled" not in section:
            continue
        enabled = _enabled(section, key)  # read as DeepSpeed reads it: 1, "true", "on" are on
        if enabled == "auto":
            if flags[spelled]:  # off, "auto" stays: zerofx_options may still ask for the dtype
                config[key] = {**section, "enabled": True}
        elif enabled != flags[spelled]:
            clashes.append(
                f"{key}.enabled={section['enabled']!r} but TrainingArguments give {spelled}={flags[spelled]}"
            )
    if clashes:
        raise ZeroFXError("ZeroFXTrainer: the DeepSpeed config contradicts TrainingArguments: " + "; ".join(clashes))
    return config


def _refuse_rank0_state(models: list, *_: Any) -> None:
    """accelerate's save/load-state pre-hook: a zerofx model sharded over several ranks is an
    error there, on every rank alike (see ``prepare``)."""
    for model in models:
        if is_sharded(model) and mesh_of(model).size() > 1:
            raise ZeroFXError(
                "accelerator.save_state/load_state write and read model and optimizer state from the main "
                "process only: for a zerofx model that is rank 0's shards, and loading them gives every rank "
                "rank 0's rows. Save with zerofx.checkpoint.save(folder, model, optimizer) on every rank and "
                "resume with zerofx.checkpoint.load(folder, model, optimizer)"
            )


def _gather_state_dicts(accelerator: Any) -> None:
    """``accelerator.get_state_dict`` (and so ``accelerator.save_model``) of a zerofx model: its
    entries whole, on the CPU, on the main process, and ``{}`` elsewhere, as accelerate's FSDP2
    branch gives them (``full_state_dict`` with ``cpu_offload``); a collective (an all-gather per
    sharded entry), so called on every rank, as under FSDP2. accelerate's own branch for such a
    model is ``model.state_dict()``: the sharded DTensors, of which ``save_model`` writes rank 0's
    shards. Other models go to accelerate's method."""
    accelerate_get_state_dict = accelerator.get_state_dict

    def get_state_dict(model: Any, unwrap: bool = True) -> dict:
        inner = accelerator.unwrap_model(model)
        if not is_sharded(inner):
            return accelerate_get_state_dict(model, unwrap)
        whole = {}
        for key, value in inner.state_dict().items():
            if isinstance(value, DTensor):
                value = value.full_tensor()  # on every rank: a collective
            if accelerator.is_main_process:
                whole[key] = value.detach().cpu() if isinstance(value, torch.Tensor) else value
        return whole

    accelerator.get_state_dict = get_state_dict


def prepare(accelerator: Any, *objects: Any) -> Any:
    """``accelerator.prepare(*objects)`` for objects that include zerofx models: those are
    registered with the accelerator (``accumulate`` and ``unwrap_model`` know them) but neither
    wrapped in DDP nor moved, as transformers' Trainer prepares models that own their placement
    and gradient reduction; everything else (optimizers, data loaders, schedulers) is prepared as
    accelerate would. Returns what ``accelerator.prepare`` returns: the objects in order, or the
    one object.

    ``accelerator.save_state`` / ``load_state`` of a zerofx model sharded over several ranks are
    errors: accelerate writes the model's and the optimizer's state dicts from the main process
    only, which for sharded parameters are rank 0's shards, and its load gives every rank those
    rows, silently. Save with ``zerofx.checkpoint.save(folder, model, optimizer)`` on every rank
    (and ``zerofx.checkpoint.load``); the RNG and data-loader state are accelerate's to save as
    before. ``accelerator.get_state_dict`` and ``accelerator.save_model`` of a zerofx model give
    (on the main process) and write its whole tensors: collectives, called on every rank (as under
    FSDP2)."""
    if not objects:
        raise ZeroFXError("zerofx.hf.prepare(accelerator, *objects) needs at least one object to prepare")
    models = [i for i, obj in enumerate(objects) if is_sharded(obj)]
    if not models:
        raise ZeroFXError(
            "zerofx.hf.prepare: none of the objects is a model zerofx compiled; run zerofx.compile(model, mesh) "
            "first, or use accelerator.prepare"
        )
    if not getattr(accelerator, "_zerofx_state_hooks", False):
        accelerator.register_save_state_pre_hook(_refuse_rank0_state)
        accelerator.register_load_state_pre_hook(_refuse_rank0_state)
        _gather_state_dicts(accelerator)
        accelerator._zerofx_state_hooks = True
    prepared = list(objects)
    for i in models:  # evaluation_mode: no DDP wrap (the model reduces its own gradients)
        prepared[i] = accelerator.prepare_model(objects[i], device_placement=False, evaluation_mode=True)
    rest = [i for i in range(len(objects)) if i not in models]
    if rest:
        done = accelerator.prepare(*(objects[i] for i in rest))
        for i, obj in zip(rest, done if len(rest) > 1 else (done,)):
            prepared[i] = obj
    return prepared[0] if len(prepared) == 1 else tuple(prepared)


class _KeepLocalStep(TrainerCallback):
    """Under a loss scaler accelerate's ``AcceleratedOptimizer`` steps through the ``step`` it
    captured when it was prepared, before the first step, and puts that one back after every
    step. zerofx installs its step on local shards at the first step (zerofx/runtime/local_step.py),
    so from the second step on accelerate called around it: every step went through DTensor (the
    same numbers, a slower optimizer step). After each step accelerate is handed zerofx's."""

    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **_: Any) -> None:
        inner = getattr(optimizer, "optimizer", None)
        method = None if inner is None else local_step_method(inner)
        if method is None or getattr(optimizer, "scaler", None) is None:
            return
        if getattr(optimizer, "_optimizer_original_step_method", None) is not method:
            from accelerate.optimizer import patch_optimizer_step

            optimizer._optimizer_original_step_method = method
            optimizer._optimizer_patched_step_method = patch_optimizer_step(optimizer, method)
            inner.step = method


class ZeroFXTrainer(Trainer):
    """``transformers.Trainer`` training ``model`` with zerofx (see the module docstring).

    ``mesh``: the DeviceMesh to shard over (default: every rank, 1-D). ``zerofx_config``: a
    DeepSpeed config (path or dict) for ``zerofx.compile(config=...)``; ``zerofx_options``:
    keyword options for ``zerofx.compile``. A model already compiled by zerofx is used as is.
    """

    def __init__(
        self,
        model: Any = None,
        args: TrainingArguments | None = None,
        *trainer_args: Any,
        mesh: Any = None,
        zerofx_config: Any = None,
        zerofx_options: dict[str, Any] | None = None,
        **trainer_kwargs: Any,
    ):
        if model is None or args is None:
            raise ZeroFXError("ZeroFXTrainer needs model= and args= (TrainingArguments)")
        if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
            raise ZeroFXError(
                "ZeroFXTrainer shards with zerofx: drop TrainingArguments' deepspeed / fsdp settings "
                "(pass the DeepSpeed config as zerofx_config= instead)"
            )
        if not hasattr(PreTrainedModel, "is_distributed_loading_by_transformers"):
            raise ZeroFXError(
                "ZeroFXTrainer needs transformers >= 5 (its Trainer path for models that own their "
                "placement and gradient reduction); pip install 'zerofx[hf]'"
            )
        args.device  # noqa: B018  (accelerate initializes the process group from torchrun's environment here)
        if not is_sharded(model):
            first = next(iter(model.parameters()), None)
            if first is not None and not first.is_meta and first.device != args.device:
                model.to(args.device)  # what the Trainer would do; it leaves a model on this path where it is
            if not (dist.is_available() and dist.is_initialized()):
                raise ZeroFXError(
                    "ZeroFXTrainer: no process group after TrainingArguments set up its devices; "
                    "launch the script with torchrun (or pass a model zerofx already compiled)"
                )
            _checkpoint_layers(model, args)  # before compiling: zerofx takes the layers' checkpointing over
            with warnings.catch_warnings():  # the loop settings are the Trainer's: checked below instead
                warnings.filterwarnings("ignore", message=".*training-loop settings zerofx leaves to the loop")
                zerofx.compile(
                    model, mesh, config=_with_trainer_precision(zerofx_config, args), **(zerofx_options or {})
                )
            _check_loop_settings(runtime_of(model).training, args)
        elif zerofx_config is not None or zerofx_options:
            raise ZeroFXError("the model is already compiled by zerofx: drop zerofx_config / zerofx_options")
        _check_full_eval(runtime_of(model).options.param_dtype, args)
        # transformers' path for models sharded at load time: no DDP wrap, no move. The Trainer
        # reads the flag through the model it was given; a wrapper (peft's PeftModel) forwards
        # that read to the transformers model inside it, so the flag goes there too.
        model._is_distributed_loading_by_transformers = True
        if not isinstance(model, PreTrainedModel):
            inner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
            if inner is not None:
                inner._is_distributed_loading_by_transformers = True
        # That path refuses optimizer checkpoints, which it could not save; the hooks below save
        # them through zerofx.checkpoint, so the check is passed and the setting put back.
        # the Trainer's activation checkpointing was set on the layers before zerofx.compile took it over
        self._zerofx_checkpointed = runtime_of(model).checkpoint_report is not None and args.activation_checkpointing
        self._zerofx_state_saved: Path | None = None  # checkpoint-N whose zerofx_state save_model wrote
        self._zerofx_model_loaded_from: Path | None = None  # checkpoint-N whose zerofx_state model was read
        save_only_model = args.save_only_model
        args.save_only_model = True
        try:
            super().__init__(model, args, *trainer_args, **trainer_kwargs)
        finally:
            args.save_only_model = save_only_model
        if runtime_of(model).scaler is not None:  # NOTE: loss scaling under the Trainer
            self.accelerator.scaler = runtime_of(model).scaler
            self.add_callback(_KeepLocalStep())

    def train(self, *args: Any, **kwargs: Any) -> Any:
        # the layers' checkpointing was set up (and taken over by zerofx) when the model was
        # compiled: the Trainer must not set torch.utils.checkpoint on them again when it starts
        checkpointing = self.args.activation_checkpointing
        if self._zerofx_checkpointed:
            self.args.activation_checkpointing = False
        try:
            return super().train(*args, **kwargs)
        finally:
            self.args.activation_checkpointing = checkpointing

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        # --bf16/fp16_full_eval: the model computes in that dtype already (_check_full_eval); the
        # Trainer's cast of the whole model (model.to(dtype=...)) is skipped
        full = self.args.fp16_full_eval, self.args.bf16_full_eval
        self.args.fp16_full_eval = self.args.bf16_full_eval = False
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.args.fp16_full_eval, self.args.bf16_full_eval = full

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        if self.accelerator.sync_gradients:
            return super().training_step(model, inputs, num_items_in_batch)
        with no_sync(self.model):  # inside an accumulation window: reduce once, at its last micro-step
            return super().training_step(model, inputs, num_items_in_batch)

    # NOTE: loss scaling under the Trainer
    # An fp16 model (loss_scale="dynamic", which fp16 requires) has zerofx's scaler, which agrees on
    # overflows across ranks (a shard sees only its gradients). Put in accelerate's ``scaler`` slot,
    # it is what ``accelerator.backward`` scales the loss by and what the optimizer accelerate wraps
    # steps through (``scaler.step``: a step with inf/NaN gradients is skipped, and the Trainer then
    # skips the scheduler's step, as it does for DeepSpeed's skipped steps); the Trainer saves and
    # resumes its state (scaler.pt). On a CPU accelerate runs no AMP, so nothing else used the slot:
    # the Trainer's fp16 run backpropagated an unscaled loss, fp16 gradients underflowing, and never
    # skipped a step. The gradients are unscaled before the Trainer clips or measures them (with AMP,
    # on an accelerator, accelerate's clip_grad_norm_ does that itself).

    def _unscale_gradients(self) -> None:
        scaler = self.accelerator.scaler
        if (
            scaler is None or runtime_of(self.model).scaler is not scaler or self.optimizer is None
        ):  # (a ZeroFXGradScaler)
            return
        if self.accelerator.native_amp and self.accelerator.mixed_precision == "fp16":
            return  # accelerate unscales in clip_grad_norm_
        if not scaler.unscaled(self._inner_optimizer()):  # once per optimizer step (update() resets it)
            scaler.unscale_(self._inner_optimizer())

    def _clip_grad_norm(self, model: Any) -> Any:
        self._unscale_gradients()
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        if grad_norm is None:  # measured here (no clipping): of the unscaled gradients
            self._unscale_gradients()
        return super()._get_grad_norm(model, grad_norm)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write ``output_dir`` as ``save_pretrained`` would (safetensors + config.json; a PEFT
        model's adapters only, as the plain Trainer saves them); a collective.

        For a resumable ``checkpoint-N`` folder the sharded checkpoint written on the way is its
        ``zerofx_state`` (model and optimizer), so the parameters are written once for both."""
        output_dir = Path(output_dir or self.args.output_dir)
        staging = output_dir.parent / same_on_every_rank(f".{output_dir.name}.zerofx-{uuid.uuid4().hex[:12]}")
        if self._is_resumable_checkpoint(output_dir, _internal_call):
            written = zerofx.checkpoint.save(output_dir / STATE_DIR, self.model, self._inner_optimizer())
            self._zerofx_state_saved = output_dir
        elif not _is_peft(self.model):
            written = zerofx.checkpoint.save(staging / "ckpt", self.model)
        if _is_peft(self.model):
            self._save_adapters(output_dir)
        elif self.args.should_save:
            try:
                exported = zerofx.checkpoint.export(written, staging / "hf", to="hf")
                output_dir.mkdir(parents=True, exist_ok=True)
                for stale in [*output_dir.glob("model*.safetensors"), *output_dir.glob("model.safetensors.index.json")]:
                    stale.unlink()  # an earlier save's files (another shard count) would mix in
                for f in exported.iterdir():
                    os.replace(f, output_dir / f.name)
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(output_dir)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()

    def _save_adapters(self, output_dir: Path) -> None:
        """A PEFT model's ``save_model``: its adapters, as the plain Trainer saves them
        (``adapter_model.safetensors``, ``adapter_config.json``). Its trainable parameters are
        what PEFT saves; each is gathered whole (a collective, on every rank), and rank 0 hands
        them to ``save_pretrained``, which picks and renames the adapter weights."""
        trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
        whole = {}
        for key, value in self.model.state_dict().items():
            if key in trainable:
                whole[key] = value.full_tensor() if isinstance(value, DTensor) else value
        if self.args.should_save:
            output_dir.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(output_dir, state_dict=whole)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)

    def _is_resumable_checkpoint(self, output_dir: Path, internal: bool) -> bool:
        """Whether the Trainer is saving ``checkpoint-N`` with its optimizer (``_save_checkpoint``
        calls ``save_model`` and then ``_save_optimizer_and_scheduler`` on the same folder)."""
        return (
            internal
            and not self.args.save_only_model
            and self.optimizer is not None
            and output_dir.name == f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )

    # -- resumable checkpoints (module docstring) --------------------------------------------------

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer under accelerate's wrapper, which DCP's state-dict helpers need."""
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank writes its shards of the model and optimizer to ``output_dir/zerofx_state``;
        rank 0 adds the scheduler's state, as the Trainer does; a collective."""
        if self._zerofx_state_saved != Path(output_dir):  # else save_model wrote it, with the optimizer
            zerofx.checkpoint.save(Path(output_dir) / STATE_DIR, self.model, self._inner_optimizer())
        self._zerofx_state_saved = None
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), Path(output_dir) / SCHEDULER_NAME)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The model's parameters from a checkpoint folder: its ``zerofx_state`` when it has one,
        else its HF safetensors (a ``save_only_model`` checkpoint); a collective."""
        folder = Path(resume_from_checkpoint)
        model = self.model if model is None else model
        if (folder / STATE_DIR).is_dir():
            zerofx.checkpoint.load(folder / STATE_DIR, model)
            self._zerofx_model_loaded_from = folder
        elif _is_peft(model) and (folder / ADAPTER_FILE).is_file():
            _load_adapters(model, folder / ADAPTER_FILE)
        elif any(folder.glob("model*.safetensors")):
            zerofx.checkpoint.load_hf(folder, model)
        else:
            wanted = ADAPTER_FILE if _is_peft(model) else "model*.safetensors"
            raise ZeroFXError(
                f"ZeroFXTrainer: {folder} holds neither {STATE_DIR}/ (a resumable checkpoint) nor "
                f"{wanted}: not a checkpoint this Trainer wrote"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The optimizer's state (and the scheduler's) from a resumable checkpoint; nothing from a
        ``save_only_model`` one, which has neither (the plain Trainer starts them afresh too)."""
        if checkpoint is None or not (Path(checkpoint) / STATE_DIR).is_dir():
            return
        # the parameters were read from the same folder already, unless transformers skipped that
        loaded = self._zerofx_model_loaded_from == Path(checkpoint)
        zerofx.checkpoint.load(Path(checkpoint) / STATE_DIR, self.model, self._inner_optimizer(), load_model=not loaded)
        scheduler = Path(checkpoint) / SCHEDULER_NAME
        if self.lr_scheduler is not None and scheduler.is_file():
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's parameters, as resuming loads them."""
        self._load_from_checkpoint(self.state.best_model_checkpoint)
