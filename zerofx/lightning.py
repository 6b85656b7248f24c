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
* checks, after ``configure_model``: some module must be zerofx-sharded, and the precision
  plugin may not convert the model's parameters (``"16-true"`` / ``"bf16-true"`` /
  ``"64-true"`` would swap the shards under zerofx; use ``zerofx.compile(param_dtype=...)`` or
  ``precision="bf16-mixed"``): an error naming the fix instead of a run that does not train.

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
parameters (pure bf16 training, tried by hand on 2 ranks); nothing is refused there.
"""

from __future__ import annotations

import contextlib
from typing import Any, Generator

from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from zerofx.errors import ZeroFXError
from zerofx.runtime.accumulation import no_sync
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
        if not sharded_modules(self.lightning_module):
            raise ZeroFXError(
                "ZeroFXStrategy: no module of the LightningModule is sharded by zerofx; call "
                "zerofx.compile(self.model, self.device_mesh['data_parallel']) in configure_model()"
            )
        super().setup(trainer)

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
        if not sharded_modules(module):
            raise ZeroFXError(
                "ZeroFXFabricStrategy: parallelize_fn sharded no module with zerofx; call "
                "zerofx.compile(module, mesh['data_parallel']) in it (or leave parallelize_fn out)"
            )
        return module
