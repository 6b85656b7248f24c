"""PyTorch Lightning with zerofx as its engine: ``ZeroFXStrategy`` (Trainer) and
``ZeroFXFabricStrategy`` (Fabric).

    import lightning as L, zerofx
    from zerofx.lightning import ZeroFXStrategy

    class LitGPT(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = GPT(cfg)

        def configure_model(self):                     # every rank, once its process group exists
            zerofx.compile(self.model, self.device_mesh["data_parallel"])

        def configure_optimizers(self):                # runs after configure_model: sees the shards
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    trainer = L.Trainer(strategy=ZeroFXStrategy(), devices=8, accumulate_grad_batches=4)

Requires ``pip install 'zerofx[lightning]'``.

Lightning's ``ModelParallelStrategy`` is already the slot for a model that owns its
parallelism: it initializes the process group, builds a ``(data_parallel, tensor_parallel)``
DeviceMesh for ``configure_model``, neither wraps nor moves the model, and saves and loads
checkpoints through ``torch.distributed.checkpoint`` from the DTensors' own state dicts, which
zerofx's sharded parameters and optimizer state are (zerofx/checkpoint.py does the same). A
zerofx model trains under it unchanged. ``ZeroFXStrategy`` is that strategy with what it lacks
for ZeRO:

* sizes: ``tensor_parallel_size`` defaults to 1 and ``data_parallel_size`` to the rest of the
  ranks, so ``device_mesh["data_parallel"]`` spans the job (the base class defaults to tensor
  parallelism within a node and data parallelism across nodes);
* gradient accumulation: inside an ``accumulate_grad_batches`` window the backward passes of
  every zerofx model under the LightningModule run under ``zerofx.no_sync`` (one reduction per
  window, as Lightning's DDP does with ``no_sync``); the base class reduces every micro-batch;
* fp16: a model compiled with ``loss_scale="dynamic"`` steps through zerofx's scaler, which
  becomes the precision plugin's (``_ZeroFXLossScaling``: Lightning's AMP plugin without autocast);
* whole copies (stages 1-2) refreshed at the edges of the validation, test and predict loops and
  when training ends, where callbacks write parameters through ``param.data`` (NOTE: whole copies
  at the loops' edges);
* checkpoints of a one-rank model, which zerofx keeps whole (``_one_rank_checkpoints``);
* checks, after ``configure_model``: some module must be zerofx-sharded, no trainable parameter
  may sit outside the compiled modules, the precision plugin may not convert the model's
  parameters (``"16-true"`` / ``"bf16-true"`` / ``"64-true"`` would swap the shards under zerofx;
  use ``zerofx.compile(param_dtype=...)`` or ``precision="bf16-mixed"``), nor stand beside
  zerofx's loss scaling; ``StochasticWeightAveraging`` and EMA with checkpointing on several
  ranks are refused: an error naming the fix instead of a run that does not train.

Tensor parallelism composes as in plain zerofx (docs/tensor_parallel.md): parallelize the model
over ``self.device_mesh["tensor_parallel"]`` first, then ``zerofx.compile(self.model,
self.device_mesh, tp_dim="tensor_parallel")``.

Fabric takes the same engine through ``ZeroFXFabricStrategy`` (Fabric's ``ModelParallelStrategy``,
whose ``parallelize_fn`` defaults to ``zerofx.compile`` over the data-parallel dimension with
``options``, and whose ``fabric.no_backward_sync(model)`` is ``zerofx.no_sync``)::

    fabric = L.Fabric(strategy=ZeroFXFabricStrategy(options={"stage": 3}), devices=8)
    fabric.launch()
    model = fabric.setup_module(GPT(cfg))            # zerofx.compile happens here
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    with fabric.no_backward_sync(model, enabled=not last_micro_batch):
        fabric.backward(loss)

Fabric converts a ``"bf16-true"`` model before the strategy sees it, so zerofx shards bf16
parameters (pure bf16 training, tried by hand on 2 ranks); nothing is refused there. An fp16
model's loss scaler becomes Fabric's precision plugin's for ``fabric.backward``,
``fabric.clip_gradients`` and the optimizer's step; trainable parameters outside the compiled
modules are refused; one-rank checkpoints save and load as in the Trainer.
"""

from __future__ import annotations

import contextlib
from typing import Any, Generator

import lightning.fabric.strategies.model_parallel as _fabric_model_parallel
import torch
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from zerofx.errors import ZeroFXError, some_names
from zerofx.runtime.accumulation import no_sync
from zerofx.runtime.params import runtime_of
from zerofx.sharding import is_sharded

__all__ = ["ZeroFXStrategy", "ZeroFXFabricStrategy"]


def sharded_modules(root: nn.Module) -> list[nn.Module]:
    """The outermost modules under ``root`` (itself included) that zerofx sharded; the walk
    stops at each, so it costs the modules above them only."""
    if is_sharded(root):
        return [root]
    return [found for child in root.children() for found in sharded_modules(child)]


@contextlib.contextmanager
def _no_sync_under(root: nn.Module) -> Generator[None, None, None]:
    """``zerofx.no_sync`` for every zerofx model under ``root``."""
    with contextlib.ExitStack() as stack:
        for module in sharded_modules(root):
            stack.enter_context(no_sync(module))
        yield


def _refresh_whole_copies_under(roots: list[nn.Module]) -> None:
    """Refresh the whole copies (stages 1-2) of every module zerofx sharded under ``roots``: after
    writes to the shards that no load_state_dict of zerofx's saw (NOTE: stale whole copies)."""
    for module in (found for root in roots for found in sharded_modules(root)):
        runtime = runtime_of(module)
        if runtime.whole_copies:
            runtime.refresh()


def _refuse_unsharded_trainable(owner: str, root: nn.Module, data_parallel_size: int) -> None:
    """Trainable parameters outside every zerofx model of ``root`` get no gradient reduction: on
    several data-parallel ranks each rank would train its own copy, silently (as under Lightning's
    ModelParallelStrategy with FSDP2). An error naming them."""
    if data_parallel_size <= 1:
        return
    inside = {id(p) for module in sharded_modules(root) for p in module.parameters()}
    alone = [name for name, p in root.named_parameters() if p.requires_grad and id(p) not in inside]
    if alone:
        raise ZeroFXError(
            f"{owner}: {some_names(alone)} {'is' if len(alone) == 1 else 'are'} trainable but outside every module "
            "zerofx compiled, so no rank would reduce their gradients and each rank would train its own copy: "
            "move them into the module you compile, compile the module that holds them, or freeze them "
            "(requires_grad=False)"
        )


def _loss_scaler(owner: str, modules: list[nn.Module]) -> Any:
    """The one loss scaler of zerofx ``modules`` compiled with ``loss_scale="dynamic"`` (fp16), or None."""
    scalers = {id(s): s for s in (runtime_of(m).scaler for m in modules) if s is not None}
    if len(scalers) > 1:
        raise ZeroFXError(
            f"{owner}: {len(scalers)} zerofx models scale their losses with scalers of their own; one "
            "precision plugin can step with one: compile one model around them (or one with loss_scale)"
        )
    return next(iter(scalers.values()), None)


def _has_distributed_or_zerofx_modules(obj: object) -> bool:
    """Lightning's test for a model its DCP checkpoints hold, which also counts a zerofx model on
    one rank: zerofx keeps a one-rank model's parameters whole (plain tensors, no DTensors), and
    torch's state-dict helpers and DCP save and load such a module as they do a sharded one."""
    return _LIGHTNING_HAS_DTENSOR_MODULES(obj) or (isinstance(obj, nn.Module) and bool(sharded_modules(obj)))


_LIGHTNING_HAS_DTENSOR_MODULES = getattr(_fabric_model_parallel, "_has_dtensor_modules", None)


@contextlib.contextmanager
def _one_rank_checkpoints() -> Generator[None, None, None]:
    """Lightning's ModelParallelStrategy saves and loads checkpoints only of models with DTensor
    parameters (``_has_dtensor_modules`` in lightning.fabric.strategies.model_parallel, which both
    its Trainer and Fabric checkpoints call). A zerofx model on one rank (``devices=1``) has none,
    so Fabric could save neither and the Trainer could not load its own checkpoint, or one written
    on several ranks. For the duration of a save or load that test also counts zerofx models."""
    if _LIGHTNING_HAS_DTENSOR_MODULES is None:  # (a Lightning without it: nothing to widen)
        yield
        return
    _fabric_model_parallel._has_dtensor_modules = _has_distributed_or_zerofx_modules
    try:
        yield
    finally:
        _fabric_model_parallel._has_dtensor_modules = _LIGHTNING_HAS_DTENSOR_MODULES


class _ZeroFXLossScaling(MixedPrecision):
    """Lightning's AMP plugin stepping with zerofx's loss scaler and no autocast: the model computes
    in its ``param_dtype`` already. The loss is scaled before backward, the gradients unscaled
    before clipping, an overflowing step skipped on every rank (the scaler's flag is all-reduced),
    and the scaler's state saved in Lightning's checkpoints."""

    def __init__(self, scaler: Any, device: str) -> None:
        super().__init__("16-mixed", device, scaler)

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        yield


class _ZeroFXFabricLossScaling(FabricMixedPrecision):
    """Fabric's AMP plugin stepping with zerofx's loss scaler and no autocast (``_ZeroFXLossScaling``)."""

    def __init__(self, scaler: Any, device: str) -> None:
        super().__init__("16-mixed", device, scaler)

    def forward_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def convert_input(self, data: Any) -> Any:
        return data

    def convert_output(self, data: Any) -> Any:
        return data


def _check_tp_size(owner: str, tensor_parallel_size: Any) -> None:
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ZeroFXError(f"{owner}: tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")


def _resolve_data_parallel_size(strategy: Any, world: int) -> None:
    """``data_parallel_size="auto"``: every rank that tensor parallelism does not use."""
    if strategy._data_parallel_size != "auto":
        return
    if world % strategy._tensor_parallel_size:
        raise ZeroFXError(
            f"{type(strategy).__name__}: tensor_parallel_size={strategy._tensor_parallel_size} does not divide "
            f"the job's {world} ranks"
        )
    strategy._data_parallel_size = world // strategy._tensor_parallel_size


class ZeroFXStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` for models that ``configure_model`` compiles with zerofx (module
    docstring). Arguments are the base class's; ``tensor_parallel_size`` defaults to 1 and
    ``data_parallel_size`` (``"auto"``) to the job's ranks divided by it."""

    def __init__(self, data_parallel_size: int | str = "auto", tensor_parallel_size: int = 1, **kwargs: Any):
        _check_tp_size("ZeroFXStrategy", tensor_parallel_size)
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size, **kwargs)

    def setup_environment(self) -> None:
        _resolve_data_parallel_size(self, self.num_nodes * self.num_processes)
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        if isinstance(self.precision_plugin, (HalfPrecision, DoublePrecision)):
            raise ZeroFXError(
                f"ZeroFXStrategy: precision={self.precision_plugin.precision!r} converts the model's parameters "
                "after configure_model, under zerofx's shards; train in bf16 with "
                "zerofx.compile(..., param_dtype=torch.bfloat16) (fp32 master weights) or "
                "precision='bf16-mixed' (autocast)"
            )
        modules = sharded_modules(self.lightning_module)
        if not modules:
            raise ZeroFXError(
                "ZeroFXStrategy: no module of the LightningModule is sharded by zerofx; call "
                "zerofx.compile(self.model, self.device_mesh['data_parallel']) in configure_model()"
            )
        _refuse_unsharded_trainable("ZeroFXStrategy", self.lightning_module, self._data_parallel_size)
        if any(isinstance(c, StochasticWeightAveraging) for c in trainer.callbacks):
            raise ZeroFXError(
                "ZeroFXStrategy: StochasticWeightAveraging copies the module before configure_model, so its "
                "average is never sharded as the model is (as Lightning refuses it under FSDP and DeepSpeed); "
                "use lightning.pytorch.callbacks.WeightAveraging (EMAWeightAveraging, or an SWA avg_fn), which "
                "averages the sharded parameters"
            )
        if (
            self._data_parallel_size > 1
            and trainer.checkpoint_callbacks
            and any(isinstance(c, WeightAveraging) for c in trainer.callbacks)
        ):
            raise ZeroFXError(
                "ZeroFXStrategy: WeightAveraging (EMA) puts the averaged and the current model's state dicts "
                "into the checkpoint's metadata, which Lightning writes with torch.save, and sharded (DTensor) "
                "state cannot be pickled there: the first checkpoint would fail. Train it with "
                "enable_checkpointing=False, and save the averaged model yourself (zerofx.checkpoint.save on "
                "every rank)"
            )
        scaler = _loss_scaler("ZeroFXStrategy", modules)
        if scaler is not None:
            # (a second fit / validate / test on this Trainer finds the plugin installed by the first)
            if type(self.precision_plugin) is not Precision and not isinstance(
                self.precision_plugin, _ZeroFXLossScaling
            ):
                raise ZeroFXError(
                    f"ZeroFXStrategy: precision={self.precision_plugin.precision!r} with a model zerofx compiled "
                    "with loss_scale='dynamic' (fp16): zerofx scales the loss and casts the computation itself; "
                    "leave the Trainer's precision at its default ('32-true')"
                )
            self.precision_plugin = _ZeroFXLossScaling(scaler, self.root_device.type)
        super().setup(trainer)

    # NOTE: whole copies at the loops' edges
    # At stages 1 and 2 a compiled forward reads whole copies of the parameters, refreshed after
    # every optimizer step; a write to the shards by other means is caught by version counters,
    # except through ``param.data`` (its own counter) or DTensor's foreach ops (none), which is how
    # Lightning's WeightAveraging (EMA) swaps the averaged weights in for validation, swaps them
    # back after it, and copies them over the model when training ends. Validation then ran on
    # the training weights (each rank's own rows of the averaged ones), silently. The strategy
    # refreshes the copies where such callbacks write: at the first step of a validation, test or
    # predict loop (after the callbacks' epoch-start hooks), at its end (after their epoch-end
    # hooks), and when training ends. A refresh is one gather of the model, on every rank alike.

    def _refresh_whole_copies(self) -> None:
        self._zerofx_refresh_at_step = False
        _refresh_whole_copies_under([self.lightning_module])

    def _loop_starts(self) -> None:
        self._zerofx_refresh_at_step = True

    def _first_step_of_loop(self) -> None:
        if getattr(self, "_zerofx_refresh_at_step", False):
            self._refresh_whole_copies()

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._loop_starts()

    def on_test_start(self) -> None:
        super().on_test_start()
        self._loop_starts()

    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._loop_starts()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._first_step_of_loop()
        return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._first_step_of_loop()
        return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._first_step_of_loop()
        return super().predict_step(*args, **kwargs)

    def on_validation_end(self) -> None:
        super().on_validation_end()
        self._refresh_whole_copies()

    def on_test_end(self) -> None:
        super().on_test_end()
        self._refresh_whole_copies()

    def on_predict_end(self) -> None:
        super().on_predict_end()
        self._refresh_whole_copies()

    def on_train_end(self) -> None:
        super().on_train_end()
        self._refresh_whole_copies()

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        with _one_rank_checkpoints():
            return super().load_checkpoint(*args, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's hook for a micro-batch inside an accumulation window: reduce nothing."""
        with _no_sync_under(self.lightning_module):
            yield


class _ZeroFXBackwardSync(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return _no_sync_under(module) if enabled else contextlib.nullcontext()


class ZeroFXFabricStrategy(FabricModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` with zerofx as the engine (module docstring):
    ``parallelize_fn`` defaults to ``zerofx.compile(module, mesh["data_parallel"], **options)``;
    sizes as :class:`ZeroFXStrategy`'s; other arguments are the base class's."""

    def __init__(
        self,
        parallelize_fn: Any = None,
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int = 1,
        *,
        options: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        _check_tp_size("ZeroFXFabricStrategy", tensor_parallel_size)
        if parallelize_fn is not None and options:
            raise ZeroFXError(
                "ZeroFXFabricStrategy: options= are for the default parallelize_fn; pass one or the other"
            )
        zerofx_options = dict(options or {})

        def compile_over_data_parallel(module: nn.Module, mesh: Any) -> nn.Module:
            import zerofx

            return zerofx.compile(module, mesh["data_parallel"], **zerofx_options)

        super().__init__(
            parallelize_fn or compile_over_data_parallel,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            **kwargs,
        )
        self._backward_sync_control = _ZeroFXBackwardSync()

    def setup_environment(self) -> None:
        _resolve_data_parallel_size(self, self.num_nodes * self.num_processes)
        super().setup_environment()

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        modules = sharded_modules(module)
        if not modules:
            raise ZeroFXError(
                "ZeroFXFabricStrategy: parallelize_fn sharded no module with zerofx; call "
                "zerofx.compile(module, mesh['data_parallel']) in it (or leave parallelize_fn out)"
            )
        _refuse_unsharded_trainable("ZeroFXFabricStrategy", module, self._data_parallel_size)
        scaler = _loss_scaler("ZeroFXFabricStrategy", modules)
        if scaler is not None:  # fabric.backward scales the loss, optimizer.step steps through the scaler
            if isinstance(self.precision, _ZeroFXFabricLossScaling):
                if self.precision.scaler is not scaler:  # a second model set up with a scaler of its own
                    raise ZeroFXError(
                        "ZeroFXFabricStrategy: two zerofx models scale their losses with scalers of their own; "
                        "one precision plugin can step with one: compile one model around them"
                    )
            elif type(self.precision) is not FabricPrecision:
                raise ZeroFXError(
                    f"ZeroFXFabricStrategy: precision={self.precision.precision!r} with a model zerofx compiled "
                    "with loss_scale='dynamic' (fp16): zerofx scales the loss and casts the computation itself; "
                    "leave Fabric's precision at its default ('32-true')"
                )
            else:
                self.precision = _ZeroFXFabricLossScaling(scaler, self.root_device.type)
        return module

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        with _one_rank_checkpoints():
            super().save_checkpoint(*args, **kwargs)

    def load_checkpoint(self, path: Any, state: Any = None, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Fabric's load, then what it leaves undone for a zerofx model (NOTE: Fabric loads):
        stateful objects read back from a sharded checkpoint, whole copies refreshed."""
        stateful = {}
        if isinstance(state, dict):
            stateful = {
                key: obj
                for key, obj in state.items()
                if not isinstance(obj, (nn.Module, torch.optim.Optimizer))
                and callable(getattr(obj, "load_state_dict", None))
                and callable(getattr(obj, "state_dict", None))
            }
        with _one_rank_checkpoints():
            remaining = super().load_checkpoint(path, state, *args, **kwargs)
        for key, obj in stateful.items():
            if state.get(key) is not obj:  # the sharded path put the saved state dict in its place
                obj.load_state_dict(state[key])
                state[key] = obj
        roots = [state] if isinstance(state, nn.Module) else []
        if isinstance(state, dict):
            roots = [obj for obj in state.values() if isinstance(obj, nn.Module)]
        _refresh_whole_copies_under(roots)
        return remaining


# NOTE: Fabric loads
# Fabric's ModelParallelStrategy loads a sharded (DCP) checkpoint's other entries by putting each
# saved value in the state dict's place: a scheduler (any object with load_state_dict) is replaced
# by its state dict and never loaded (FSDP2 under Fabric resumes a OneCycleLR at step 0; the
# full-file path calls load_state_dict). And it writes parameters through set_model_state_dict per
# submodule (load_raw, full files), which the root's load_state_dict, where zerofx refreshes the
# whole copies of stages 1-2, never sees. The override calls load_state_dict on what it was given,
# as the full-file path does, and refreshes the copies.
