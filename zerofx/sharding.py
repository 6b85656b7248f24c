"""Turn a module's parameters into dim-0 shards on a DeviceMesh (ZeRO-3's model-state layout).

After ``shard(model, mesh)``:

* every parameter is a ``DTensor`` with placement ``Shard(0)`` on the mesh, holding this rank's
  rows (torch.chunk layout, see ``zerofx.ops`` NOTE: shard layout). So ``model.parameters()``
  are the shards: any ``torch.optim`` optimizer keeps 1/N of the state, ``clip_grad_norm_``
  computes the global norm, and ``state_dict()`` is ready for ``torch.distributed.checkpoint``;
* reading ``module.weight`` inside ``forward`` returns the *full* weight through the
  ``zerofx::unshard`` marker op. The module's class is swapped for a subclass whose parameter
  names are properties, so parameter names, ``state_dict`` keys and the module tree are
  unchanged (SimpleFSDP's parametrization idea, without ``torch.nn.utils.parametrize``'s
  renamed ``parametrizations.*.original`` keys);
* a parameter shared by several modules (tied embeddings) is sharded once; all users get the
  same DTensor, and autograd sums their gradient contributions into one shard;
* buffers stay replicated and are not synchronized (like FSDP); frozen parameters are sharded
  and gathered like the rest, and never reduced.

Reading ``module.weight`` is a collective: every rank of the mesh must do it, as in a forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from zerofx.errors import ZeroFXError
from zerofx.ops import local_rows

log = logging.getLogger(__name__)

__all__ = ["ShardLayout", "shard", "resolve_mesh", "is_sharded", "mesh_of"]


@dataclass(frozen=True)
class ShardLayout:
    """How one parameter is split: the constants baked into its marker ops."""

    group_size: int
    group_name: str
    full_rows: int
    shard_rows: int


def _model_device_type(model: nn.Module) -> str | None:
    for t in (*model.parameters(), *model.buffers()):
        return t.device.type
    return None


def resolve_mesh(model: nn.Module, mesh: DeviceMesh | None) -> DeviceMesh:
    """Check ``mesh`` against ``model`` (or build the default 1-D mesh) with clear errors."""
    if mesh is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ZeroFXError(
                "zerofx needs a DeviceMesh: pass mesh=init_device_mesh('cpu' or 'cuda', (world_size,)) "
                "or initialize the default process group first (torch.distributed.init_process_group, "
                "e.g. under torchrun); no mesh was given and no process group is initialized"
            )
        device_type = _model_device_type(model) or "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise ZeroFXError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ZeroFXError(
            f"zerofx shards over a 1-D mesh; got a {mesh.ndim}-D mesh {tuple(mesh.shape)} "
            "(pass mesh[dim_name] to shard over one of its dimensions)"
        )
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.device.type == "meta":
            raise ZeroFXError(f"{name} is on the meta device; materialize the model before zerofx.shard")
        if t.device.type != mesh.device_type:
            raise ZeroFXError(
                f"{name} is on device {t.device}, which the mesh (device_type={mesh.device_type!r}) does "
                f"not cover; move the model with model.to({mesh.device_type!r}) or build the mesh for "
                f"{t.device.type!r}"
            )
    return mesh


def is_sharded(model: nn.Module) -> bool:
    return getattr(model, "_zerofx_mesh", None) is not None


def mesh_of(model: nn.Module) -> DeviceMesh | None:
    return getattr(model, "_zerofx_mesh", None)


_SHARDED_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _gathered_property(name: str) -> property:
    def gathered(self: nn.Module) -> torch.Tensor:
        param = self._parameters[name]
        layout = self._zerofx_layouts[name]
        return torch.ops.zerofx.unshard(param.to_local(), layout.group_size, layout.group_name, layout.full_rows)

    gathered.__name__ = f"gathered_{name}"
    return property(gathered, doc=f"The full '{name}', all-gathered from its shards (a collective).")


def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    key = (cls, names)
    if key not in _SHARDED_CLASSES:
        attrs = {name: _gathered_property(name) for name in names}
        attrs["__module__"] = cls.__module__
        _SHARDED_CLASSES[key] = type(f"ZeroFX{cls.__name__}", (cls,), attrs)
    return _SHARDED_CLASSES[key]


def shard(model: nn.Module, mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard every parameter of ``model`` along dim 0 over the 1-D ``mesh``, in place.

    Returns ``model``. With a mesh of one rank nothing is sharded: the model trains as is.
    """
    if is_sharded(model):
        raise ZeroFXError("model is already sharded by zerofx; call zerofx.shard once per model")
    mesh = resolve_mesh(model, mesh)
    model._zerofx_mesh = mesh
    if mesh.size() == 1:
        log.info("zerofx: mesh has one rank; parameters stay whole")
        return model

    group_size, rank = mesh.size(), mesh.get_local_rank()
    group_name = mesh.get_group().group_name
    sharded: dict[int, nn.Parameter] = {}  # id(original param) -> its one sharded replacement
    for module_name, module in model.named_modules():
        names = tuple(n for n, p in module._parameters.items() if p is not None)
        if not names:
            continue
        layouts = {}
        for name in names:
            param = module._parameters[name]
            qualname = f"{module_name}.{name}" if module_name else name
            if isinstance(param, DTensor):
                raise ZeroFXError(f"{qualname} is already a DTensor; zerofx shards plain parameters")
            if param.dim() == 0:
                raise ZeroFXError(f"{qualname} is a 0-dim parameter; zerofx shards along dim 0 (give it shape (1,))")
            if id(param) not in sharded:
                dt = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=0)
                sharded[id(param)] = nn.Parameter(dt, requires_grad=param.requires_grad)
            module._parameters[name] = sharded[id(param)]
            full_rows = param.shape[0]
            layouts[name] = ShardLayout(group_size, group_name, full_rows, local_rows(full_rows, group_size, rank))
        module._zerofx_layouts = layouts
        module.__class__ = _sharded_class(type(module), names)
    return model
