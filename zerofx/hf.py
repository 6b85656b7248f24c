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
``pip install 'zerofx[hf]'`` (transformers >= 5 and accelerate).

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
norm. Two overrides:

* ``training_step``: micro-steps inside a gradient-accumulation window run under
  ``zerofx.no_sync`` (one reduction per window, as DDP's ``no_sync`` does under accelerate);
* ``save_model``: every rank writes a zerofx checkpoint, then rank 0 exports it to HF
  safetensors (``zerofx.checkpoint.export``, one tensor at a time) next to ``config.json``.

Not supported yet: the Trainer's resumable checkpoints (optimizer, scheduler and RNG states;
transformers refuses them for this path: use ``save_only_model=True``, or zerofx.checkpoint for
resumable sharded checkpoints) and ``--deepspeed`` / ``--fsdp`` in the same run (an error).
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers import Trainer, TrainingArguments

import zerofx
from zerofx.checkpoint import same_on_every_rank
from zerofx.errors import ZeroFXError
from zerofx.runtime.accumulation import no_sync
from zerofx.runtime.params import runtime_of
from zerofx.sharding import is_sharded

__all__ = ["ZeroFXTrainer"]


# a DeepSpeed config's training-loop keys -> the TrainingArguments field that sets the same
_LOOP_KEYS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
}


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
    if clashes:
        raise ZeroFXError("ZeroFXTrainer: the DeepSpeed config contradicts TrainingArguments: " + "; ".join(clashes))
    ignored = [k for k in ("optimizer", "scheduler") if k in training]
    if ignored:
        warnings.warn(
            f"zerofx: DeepSpeed config: {' and '.join(ignored)} sections are not used: the Trainer builds them "
            "from TrainingArguments (optim, learning_rate, lr_scheduler_type, ...)",
            stacklevel=3,
        )


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
        if not hasattr(type(model), "is_distributed_loading_by_transformers"):
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
            with warnings.catch_warnings():  # the loop settings are the Trainer's: checked below instead
                warnings.filterwarnings("ignore", message=".*training-loop settings zerofx leaves to the loop")
                zerofx.compile(model, mesh, config=zerofx_config, **(zerofx_options or {}))
            _check_loop_settings(runtime_of(model).training, args)
        elif zerofx_config is not None or zerofx_options:
            raise ZeroFXError("the model is already compiled by zerofx: drop zerofx_config / zerofx_options")
        # transformers' path for models sharded at load time: no DDP wrap, no move
        model._is_distributed_loading_by_transformers = True
        super().__init__(model, args, *trainer_args, **trainer_kwargs)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        if self.accelerator.sync_gradients:
            return super().training_step(model, inputs, num_items_in_batch)
        with no_sync(self.model):  # inside an accumulation window: reduce once, at its last micro-step
            return super().training_step(model, inputs, num_items_in_batch)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write ``output_dir`` as ``save_pretrained`` would (safetensors + config.json); a collective."""
        output_dir = Path(output_dir or self.args.output_dir)
        staging = output_dir.parent / same_on_every_rank(f".{output_dir.name}.zerofx-{uuid.uuid4().hex[:12]}")
        zerofx.checkpoint.save(staging / "ckpt", self.model)
        if self.args.should_save:
            try:
                exported = zerofx.checkpoint.export(staging / "ckpt", staging / "hf", to="hf")
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
