"""Give a module's parameters ZeRO's layout on a DeviceMesh, in place (``shard(model, mesh)``).

After ``shard(model, mesh, **options)``:

* every parameter is a ``DTensor``: ``Shard(0)`` over the mesh (torch.chunk rows, see
  ``zerofx.ir.layout`` NOTE: shard layout), or ``Replicate()`` for parameters at or below the
  persistence threshold. So ``model.parameters()`` are what the optimizer steps in every ZeRO stage: any
  ``torch.optim`` optimizer keeps 1/N of the state, ``clip_grad_norm_`` computes the global
  norm, and ``state_dict()`` is ready for ``torch.distributed.checkpoint``;
* on a 2-D mesh ``(replicate, shard)`` (hybrid sharding) placements are
  ``(Replicate(), Shard(0))``: sharded within the inner dimension, replicated across the outer;
  with ``secondary_shard=True`` (ZeRO++ hpZ) ``Shard(0)`` over the mesh flattened to 1-D, and the
  backward re-gathers within the inner dimension (NOTE: hpZ);
* reading ``module.weight`` inside ``forward`` returns the *full* weight through the stage's
  marker ops (``zerofx.runtime.params`` NOTE: markers per stage). The module's class is swapped for a
  subclass whose parameter names are properties, so parameter names, ``state_dict`` keys and
  the module tree are unchanged (SimpleFSDP's parametrization idea, without
  ``torch.nn.utils.parametrize``'s renamed ``parametrizations.*.original`` keys);
* stages 1 and 2 also keep a whole copy of each sharded parameter in the compute dtype,
  refreshed after every optimizer step and after ``load_state_dict``;
* a parameter shared by several modules (tied embeddings) is sharded once; all users get the
  same DTensor, and autograd sums their gradient contributions into one shard;
* buffers stay replicated and are not synchronized (like FSDP); frozen parameters are sharded
  and gathered like the rest, and never reduced;
* with ``param_dtype`` set, floating-point inputs of the model's forward are cast to it (as
  FSDP's mixed precision does), so the whole forward computes in that dtype; buffers keep their
  dtype, and so do the parameters of batch and instance norm layers (NOTE: norm layers under
  param_dtype).

Reading ``module.weight`` may be a collective: every rank of the mesh must do it, as in a forward.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import sys
import types
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_map

from zerofx.agreement import check_ranks_agree, has_gradient_hooks
from zerofx.errors import ZeroFXError, some_names
from zerofx.ir.collectives import name_mesh_dims
from zerofx.ir.layout import local_rows, row_offset, rows_back, rows_first, shard_dim
from zerofx.options import Options
from zerofx.runtime import eager_buckets
from zerofx.runtime.accumulation import no_sync
from zerofx.runtime.local_step import install as install_local_step
from zerofx.runtime.lockstep import make_lockstep
from zerofx.runtime.loss_scaling import make_loss_scaler
from zerofx.runtime.params import (
    REPLACED_BY,
    GroupInfo,
    ModelRuntime,
    ParamState,
    TensorParallel,
    added_after_sharding,
    discard_pending,
    read_after_sharding,
    runtime_of,
    track,
    weak_hook,
)

log = logging.getLogger(__name__)

__all__ = ["shard", "resolve_mesh", "is_sharded", "mesh_of", "runtime_of", "mark_loaded"]


def _model_device_type(model: nn.Module) -> str | None:
    for t in (*model.parameters(), *model.buffers()):
        return t.device.type
    return None


def resolve_mesh(model: nn.Module, mesh: DeviceMesh | None, on_meta: bool = False) -> DeviceMesh:
    """Check ``mesh`` against ``model`` (or build the default 1-D mesh) with clear errors;
    ``on_meta``: the model was built on the meta device (see NOTE: models built on meta)."""
    if mesh is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ZeroFXError(
                "zerofx needs a DeviceMesh: pass mesh=init_device_mesh('cpu' or 'cuda', (world_size,)) "
                "or initialize the default process group first (torch.distributed.init_process_group, "
                "e.g. under torchrun); no mesh was given and no process group is initialized"
            )
        device_type = _model_device_type(model) or "cpu"
        if device_type == "meta":
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise ZeroFXError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.get_coordinate() is None:  # (torch lets a mesh leave ranks out; they have nothing to shard over)
        raise ZeroFXError(
            f"this rank ({dist.get_rank()}) is not in the mesh (ranks {mesh.mesh.flatten().tolist()}): call "
            "zerofx.compile only on the ranks of its mesh, or build the mesh over every rank"
        )
    if mesh.ndim not in (1, 2):
        raise ZeroFXError(
            f"mesh: zerofx shards over a 1-D mesh (shard) or a 2-D mesh (replicate, shard) for hybrid "
            f"sharding; got a {mesh.ndim}-D mesh {tuple(mesh.shape)} (pass mesh[dim_names] to select dimensions)"
        )
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.device.type == "meta" and not on_meta:
            raise ZeroFXError(f"{name} is on the meta device; materialize the model before zerofx.shard")
        if t.device.type != mesh.device_type and not on_meta:
            raise ZeroFXError(
                f"{name} is on device {t.device}, which the mesh (device_type={mesh.device_type!r}) does "
                f"not cover; move the model with model.to({mesh.device_type!r}) or build the mesh for "
                f"{t.device.type!r}"
            )
    return mesh


def is_sharded(model: nn.Module) -> bool:
    return runtime_of(model) is not None


def mesh_of(model: nn.Module) -> DeviceMesh | None:
    runtime = runtime_of(model)
    return runtime.mesh if runtime is not None else None


_SHARDED_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


# NOTE: writes to a gathered copy
# Outside a compiled graph, ``module.weight`` is a whole copy gathered for this read; an in-place
# change to it (weight clipping, ``nn.init.normal_(module.weight)``, ``.data.copy_``, and
# ``module.weight.data = value``) would change that copy only and be lost, silently. So eager reads come back as ``GatheredCopy``, a plain
# tensor for every read (results are plain tensors, autograd as before) that refuses in-place
# ops, ``out=`` into it, item assignment and ``.data`` assignment of other values, naming the parameter and where to write instead:
# the parameter itself (``dict(model.named_parameters())[name]``, a DTensor of shards, whose
# in-place ops change every rank's rows; stages 1 and 2 then renew their whole copies with
# ``runtime_of(model).refresh()``). Compiled graphs (dynamo traces the read) get the plain value.
# Freezing and unfreezing through the attribute (``module.weight.requires_grad_(False)``,
# ``module.weight.requires_grad = True``) set the parameter's flag: on the copy alone they would
# be lost as silently (a copy's ``.detach()`` / ``.data`` is a new tensor, with a flag of its own).

_NOT_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_", "detach_"})
_INPLACE_DUNDERS = frozenset(
    {
        "__setitem__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
        "__imatmul__",
    }
)


# NOTE: reads from eager code inside a compiled region
# A forward that dynamo does not trace whole still runs inside the compiled call: a frame it
# fell back on (a graph break it could not resume from, a recompile limit reached) runs eagerly,
# and so does torch's own module code (``nn.LSTM.forward``). A read of ``module.weight`` from
# there calls the parameter's property as a frame of its own, which dynamo compiles: a gather in
# a graph of its own (NOTE: static layouts in a frame of their own, zerofx/runtime/params.py),
# recompiled per parameter name and shape. Past dynamo's recompile limit (8) the property runs
# eagerly and hands ``F.linear`` a GatheredCopy (an uncompiled read, as without torch.compile),
# whose ``__torch_function__`` dynamo then compiled as a frame too, and AOTAutograd could not run
# it: every rank raised torch's "Multiple dispatch failed" TypeError (an eager mixture-of-experts
# loop with a data-dependent index over more than four layers did). ``__torch_function__`` now
# always runs as plain Python when dynamo would start a frame in it: the reads past the limit are
# uncompiled reads, the ones before it compiled frames, each correct.


def _never_a_frame(fn: Any) -> Any:
    """``fn`` (a function or classmethod) with dynamo told never to compile a frame of its own
    in it, nor in anything it calls (NOTE: reads from eager code inside a compiled region).
    Through dynamo's per-code hook (private; a torch without it compiles them as before)."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:
        return fn
    strategy = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    set_code_exec_strategy(getattr(fn, "__func__", fn).__code__, strategy)
    return fn


class GatheredCopy(torch.Tensor):
    """A parameter's whole value gathered for one eager read (NOTE: writes to a gathered copy)."""

    _zerofx_name: str = "?"
    _zerofx_param: nn.Parameter | None = None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = args[0] if args else next((kwargs[k] for k in ("tensor", "input", "self") if k in kwargs), None)
        writes = (
            isinstance(target, GatheredCopy)
            and (
                (name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES) or name in _INPLACE_DUNDERS
            )
        ) or isinstance(kwargs.get("out"), GatheredCopy)
        if isinstance(target, GatheredCopy) and name == "__set__" and getattr(func, "__self__", None) is _DATA:
            # replaces the copy's values, not the parameter's: refused unless it changes nothing
            # (transformers' tie_weights pads an output bias to its own length this way)
            writes, name = not _same_values(target, args[1] if len(args) > 1 else None), ".data = ..."
        param = getattr(target, "_zerofx_param", None) if isinstance(target, GatheredCopy) else None
        if param is not None and name in ("__get__", "__set__") and getattr(func, "__self__", None) is _GRAD:
            return _gradient_of(param, target._zerofx_name, name, args)
        if param is not None and (
            name == "requires_grad_" or (name == "__set__" and getattr(func, "__self__", None) is _REQUIRES_GRAD)
        ):  # freezing or unfreezing ``module.weight``: meant for the parameter, not for this read's copy
            flag = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
            param.requires_grad_(flag)
            return target if name == "requires_grad_" else None
        if param is not None and name in ("register_hook", "register_post_accumulate_grad_hook"):
            # ``module.weight.register_hook(fn)``: meant for the parameter's gradient; on this read's
            # copy, which no graph reads, it never ran (a gradient hook) or was torch's non-leaf error
            return getattr(param, name)(*args[1:], **kwargs)
        if writes:
            copy = target if isinstance(target, GatheredCopy) else kwargs["out"]
            raise ZeroFXError(
                f"{copy._zerofx_name}: {name} would change a copy of the parameter gathered for this read, and "
                f"the change would be lost. Change the parameter itself: dict(model.named_parameters())"
                f"[{copy._zerofx_name!r}] is a DTensor of this rank's rows, and its in-place ops change every "
                "rank's rows (at stages 1 and 2, then renew the whole copies: "
                "zerofx.sharding.runtime_of(model).refresh())"
            )
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if (name == "__get__" and getattr(func, "__self__", None) is _DATA) or name == "detach":
            return _as_gathered_copy(out, target._zerofx_name)  # still the same gathered bytes
        return out


_never_a_frame(GatheredCopy.__dict__["__torch_function__"])
_REQUIRES_GRAD = torch.Tensor.requires_grad
_DATA = torch.Tensor.data
_GRAD = torch.Tensor.grad


def _gradient_of(param: nn.Parameter, qualname: str, name: str, args: tuple) -> None:
    """``module.weight.grad`` (read or set): the copy gathered for this read has no gradient of
    its own, so a read gave None after every backward (a logging line that skips None grads
    skipped them all, silently) and a write was lost. A read is the truth where the parameter
    has no gradient (None: frozen, or before the first backward); otherwise a read or a write is
    refused, naming the parameter's. Not gathered here: that would be a collective that a read
    on one rank (``if rank == 0:``) hangs in, and writes to a gathered gradient would be lost."""
    if name == "__get__" and param.grad is None:
        return None
    verb = "setting" if name == "__set__" else "reading"
    raise ZeroFXError(
        f"{qualname}: {verb} .grad of module.{qualname.rsplit('.', 1)[-1]}, a copy of the parameter gathered for "
        f"this read, which has no gradient of its own; use the parameter's: model.get_parameter({qualname!r}).grad "
        "(a DTensor of this rank's rows; .full_tensor() gathers it, a collective every rank calls)"
    )


def _same_values(copy: torch.Tensor, value: Any) -> bool:
    """Whether ``value`` holds exactly ``copy``'s values (shape, dtype and every element)."""
    with torch._C.DisableTorchFunctionSubclass():
        return (
            isinstance(value, torch.Tensor)
            and value.shape == copy.shape
            and value.dtype == copy.dtype
            and bool(torch.equal(value, copy))
        )


def _as_gathered_copy(value: torch.Tensor, qualname: str, param: nn.Parameter | None = None) -> torch.Tensor:
    """``value`` as a GatheredCopy of ``qualname``. ``param``: the parameter itself, for a
    module attribute's read (``module.weight.requires_grad_(False)`` freezes it); None for what
    is derived from one (``.detach()``, ``.data``: new tensors whose flags are their own)."""
    copy = value.as_subclass(GatheredCopy)
    copy._zerofx_name = qualname
    copy._zerofx_param = param
    return copy


def _resolving_names() -> bool:
    """Whether the caller's caller is torch's DCP state-dict helpers' name resolution
    (``torch.distributed.checkpoint.state_dict._get_fqns``), which walks a parameter's dotted
    name by ``getattr`` and keeps only the names: each read through the property below was a
    whole-parameter all-gather, so ``get_state_dict`` gathered the whole model twice and
    ``zerofx.checkpoint.load`` seven times, for nothing (FSDP2's parameters are plain attributes)."""
    helpers = sys.modules.get("torch.distributed.checkpoint.state_dict")
    names = getattr(helpers, "_get_fqns", None)
    return names is not None and sys._getframe(2).f_code is getattr(names, "__code__", None)


def _gathered_property(name: str) -> property:
    def gathered(self: nn.Module) -> torch.Tensor:
        state = self._zerofx_params[name]
        held = self._parameters[name]
        if held is not state.param and type(held) is torch.Tensor and held.shape == state.param.shape:
            # a plain tensor of the parameter's full shape in ``_parameters``: put there for one call
            # by torch.func.functional_call / nn.utils.stateless (``module.weight = tensor`` is refused
            # by nn.Module, which takes only Parameters there), so the module computes with it, as in
            # torch; only writing into ``_parameters`` directly could leave one there for good
            return held
        if not torch.compiler.is_compiling():
            if _resolving_names():
                return held  # the shard itself: the caller wants the name, not the values
            state.check_uncompiled_read()
        value = state.forward_value(self._parameters[name])
        if torch.compiler.is_compiling() or type(value) is not torch.Tensor:
            return value  # traced into a graph (or a tensor-parallel DTensor): the plain value
        state.check_uncompiled_reduction(value)
        return _as_gathered_copy(value, state.qualname, self._parameters[name])

    gathered.__name__ = f"gathered_{name}"
    return property(gathered, doc=f"The full '{name}', through zerofx's marker ops (may be a collective).")


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same values, NaN where the other has NaN (a trained-into-NaN weight copies as itself)."""
    return torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))


def _apply_keeping_shards(self: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
    """``nn.Module._apply`` (``.to()``, ``.cpu()``, ``.cuda()``, ``.float()``, ...) for a
    module with zerofx parameters. A conversion that leaves a shard as it is (a move to the
    device it is on, a cast to its dtype) keeps it: torch would swap every DTensor parameter
    for its converted copy, which fails once anything holds a weak reference to it (dynamo's
    guards do, after the first step) and would leave zerofx's states and the optimizer on the
    old object. A conversion that would change a shard is an error naming it: shards, gradients
    and optimizer state were laid out by ``zerofx.shard``, so convert the model before that.
    Buffers and other parameters convert as usual."""
    ours = self._zerofx_params
    for name, state in ours.items():
        param = self._parameters[name]
        local = param._local_tensor
        with torch.no_grad():
            # on the local shard, not the DTensor: DTensor has no storage of its own, and
            # ``share_memory_`` on one crashes the process (torch 2.13); an in-place conversion
            # like that one then applies to the shard itself
            out = fn(local)
        # a copy that is the shard over again is no change either: ``.to("cpu:0")`` of a CPU tensor
        # copies it (the HF Trainer's move to ``args.device`` under torchrun does that)
        same = (
            isinstance(out, torch.Tensor)
            and out.dtype == local.dtype
            and out.device == local.device
            and out.shape == local.shape
            and out.stride() == local.stride()
        )
        kept = out is local or (
            same
            and (
                out.data_ptr() == local.data_ptr() or (out.is_pinned() == local.is_pinned() and _identical(out, local))
            )
        )
        if not kept:
            raise ZeroFXError(
                f"{state.qualname}: converting a zerofx-sharded parameter ({param.dtype} on {param.device} -> "
                f"{out.dtype} on {out.device}) is not supported: its shards, gradient and optimizer state were "
                "laid out by zerofx.compile / zerofx.shard. Move or cast the model before that (for low-precision "
                "compute, param_dtype=...)"
            )
    order = list(self._parameters)
    held = {name: self._parameters.pop(name) for name in ours}
    try:
        super(type(self), self)._apply(fn, recurse)
    finally:
        rest = dict(self._parameters)
        self._parameters.clear()
        self._parameters.update((name, held[name] if name in held else rest[name]) for name in order)
    return self


def _load_whole_into_shards(self: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """``nn.Module._load_from_state_dict`` for a module with zerofx parameters: a whole, plain
    tensor for one of them (a state dict saved from the unsharded model and loaded on every
    rank, ``model.load_state_dict(torch.load("model.pt"))``) becomes this rank's shard of it,
    with no communication, instead of DTensor's "got mixed torch.Tensor and DTensor". Every
    rank must pass the same values, as loading the same file does. DTensor values (a sharded
    state dict) load as before; a value of another shape gets torch's shape error.

    ``load_state_dict(..., assign=True)`` would put the state dict's tensors in place of the
    parameters zerofx sharded (the next forward then refuses the module); on such a module the
    values are copied into the shards instead, as without ``assign``."""
    if args and isinstance(args[0], dict) and args[0].get("assign_to_params_buffers"):
        args = ({**args[0], "assign_to_params_buffers": False}, *args[1:])
    for name in self._zerofx_params:
        key = prefix + name
        value, param = state_dict.get(key), self._parameters[name]
        if (
            isinstance(value, torch.Tensor)
            and not isinstance(value, DTensor)
            and isinstance(param, DTensor)
            and value.shape == param.shape
        ):
            whole = value.detach().to(param.device)
            state_dict[key] = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
    super(type(self), self)._load_from_state_dict(state_dict, prefix, *args)


def _save_aliasing_shards(self: nn.Module, destination: dict, prefix: str, keep_vars: bool) -> None:
    """``nn.Module._save_to_state_dict`` for a module with zerofx parameters: at stages 1 and 2,
    each state-dict value's local tensor is the parameter's own local shard, not a fresh alias of
    it, so that writes into it (``torch.distributed.checkpoint.load`` copies into ``to_local()``)
    bump the shard's version counter and the next forward sees that the whole copy is stale
    (NOTE: stale whole copies, zerofx/runtime/params.py). Same storage, sizes and strides as the
    alias DTensor's ``detach`` makes; writes through the value as a DTensor bump the parameter's
    version counter, which ``detach`` shares.

    Such a shard starts past its storage's first element (every rank's but the first), and
    DTensor gives its wrapper the local tensor's storage offset: ``torch.save`` of that wrapper
    fails ("invalid python storage") on those ranks only, and the other ranks would go on alone.
    The value's wrapper is set to offset 0, metadata only (a wrapper has no storage; no version
    bump, so nothing counts as stale); ``torch.save`` then writes the local shard as it writes
    any view, with its storage (the rows of the whole copy)."""
    super(type(self), self)._save_to_state_dict(destination, prefix, keep_vars)
    if keep_vars:
        return
    for name, state in self._zerofx_params.items():
        value = destination.get(prefix + name)
        if state.full is not None and isinstance(value, DTensor):
            value._local_tensor = self._parameters[name]._local_tensor
            if value.storage_offset() != 0:
                with torch._C._AutoDispatchBelowADInplaceOrView(), torch._C._DisableTorchDispatch():
                    torch.Tensor.as_strided_(value, value.size(), value.stride(), 0)


def _copy_local(local: torch.Tensor, memo: dict) -> torch.Tensor:
    """A copy of a local shard over the copy of its storage (torch's storage deepcopy memoizes
    storages, so a shard and the whole copy it is a view of stay aliased), without its
    attributes: zerofx's state, set on it while a local optimizer step runs, leads to parameters
    not copied yet."""
    if id(local) in memo:
        return memo[id(local)]
    storage = copy.deepcopy(local.untyped_storage(), memo)
    twin = torch.empty(0, dtype=local.dtype, device=local.device)
    twin.set_(storage, local.storage_offset(), local.size(), local.stride())
    memo[id(local)] = twin
    return twin


def _copy_over_storage(dt: DTensor, memo: dict) -> DTensor:
    """A copy of ``dt`` whose local tensor is :func:`_copy_local`'s (over the copy of its storage)."""
    spec = dict(shape=dt.shape, stride=dt.stride(), run_check=False)
    return DTensor.from_local(_copy_local(dt._local_tensor, memo), dt.device_mesh, dt.placements, **spec)


def _deepcopy_keeping_views(self: nn.Module, memo: dict) -> nn.Module:
    """``copy.deepcopy`` of a module with zerofx parameters (``AveragedModel``, an EMA or
    teacher copy). torch's own gets two things wrong here:

    - it copies a tensor's attributes before it records the tensor's copy in the memo, and
      zerofx's state on a parameter leads back to the parameter: the first parameter reached
      was copied twice, the module holding one copy and zerofx's state (where its gradient
      lands) the other;
    - it cannot copy a DTensor whose local shard starts past its storage's first element (at
      stages 1 and 2 without mixed precision, every rank's but the first: the shard is a view
      of its rows of the whole copy), failing with "Attempted to call copy_() on an invalid
      python storage" on those ranks only; gradients likewise (views of a reduce-scatter's
      bucket, at every stage).

    So every zerofx parameter of the model (its states lead from any module to all of them) is
    copied here first, through its local shard and in the same memo, which keeps the copy's
    shard a view of the copy's whole copy as in the original; then their attributes, then the
    module as ``nn.Module`` would be. torch copies no tensor hooks, so the copy's gradient sinks
    get theirs again (NOTE: the accumulation boundary, zerofx/runtime/params.py), and its
    whole copies count as refreshed if the original's were (NOTE: stale whole copies)."""
    states = next(iter(self._zerofx_params.values())).runtime.states  # every module's: they refer to each other
    for state in states:  # a new leaf over the copy's shard is made below, with its hook
        if state.leaf is not None:
            memo.setdefault(id(state.leaf), None)
    copied = []
    for param in (state.param for state in states):
        if id(param) in memo or not isinstance(param, DTensor):
            continue
        new = nn.Parameter(_copy_over_storage(param, memo), requires_grad=param.requires_grad)
        memo[id(param)] = new
        copied.append((param, new))
    for param, new in copied:  # after every parameter is in the memo: zerofx's states lead to all of them
        grad = param.grad
        if isinstance(grad, DTensor) and id(grad) not in memo:  # a view of a reduce-scatter's bucket
            memo[id(grad)] = _copy_over_storage(grad, memo)
        if grad is not None:
            new.grad = copy.deepcopy(grad, memo)
        new.__dict__.update(copy.deepcopy(param.__dict__, memo))
        new._local_tensor.__dict__.update(copy.deepcopy(param._local_tensor.__dict__, memo))
    # every twin, also when the parameters were copied before the model in the same deepcopy
    # (torch's own deepcopy of a ParamState copies its leaf without the hook)
    for state in states:
        twin = memo.get(id(state))
        if twin is None:
            continue
        if not getattr(twin.sink, "_post_accumulate_grad_hooks", None):
            # torch copies no tensor hooks: without this the copy's gradients would stay pending
            twin.sink.register_post_accumulate_grad_hook(weak_hook(twin.runtime.on_local_grad))
        if state.leaf is not None:
            twin.make_leaf()
        if twin.full is not None:  # new tensors, new version counters: in step if the original was
            twin.synced_version = twin.versions() if state.versions() == state.synced_version else (-1, -1)
    clone = type(self).__new__(type(self))
    memo[id(self)] = clone
    clone.__setstate__(copy.deepcopy(self.__getstate__(), memo))
    return clone


def _save_pretrained_of_whole_tensors(self: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    """HF's ``save_pretrained`` for a model with zerofx parameters: given whole tensors
    (``state_dict=``), as transformers' own; from the model's own state dict, whose values are
    shards, an error saying what to do, on every rank alike. (safetensors cannot read a
    DTensor's storage: rank 0 failed inside while the other ranks, which write nothing, went on.)"""
    state_dict = kwargs.get("state_dict")
    values = state_dict.values() if state_dict is not None else self.parameters()  # (its state dict's are those)
    if any(isinstance(v, DTensor) for v in values):
        raise ZeroFXError(
            f"{type(self).__name__}.save_pretrained: the parameters are zerofx shards; pass whole tensors, on "
            "every rank: save_pretrained(out, state_dict={k: v.full_tensor() for k, v in "
            "model.state_dict().items()}, is_main_process=rank == 0), or write a checkpoint with "
            "zerofx.checkpoint.save(folder, model) and zerofx.checkpoint.export(folder, out, to='hf')"
        )
    return type(self).save_pretrained(self, save_directory, *args, **kwargs)


def _refuse_pickling(self: nn.Module, protocol: int) -> Any:
    """``__reduce_ex__`` of a module with zerofx parameters: pickling one (``torch.save(model)``,
    ``copy.copy``, handing it to another process) is an error saying what to save instead. Its
    parameters are shards over this job's process groups, meaningless in any other process, and
    the swapped class is made at run time, so pickle could only fail with a lookup error.
    ``copy.deepcopy`` has a method of its own and works."""
    raise ZeroFXError(
        f"{type(self).__name__}: a zerofx-sharded module cannot be pickled (torch.save(model), copy.copy, "
        "sending it to another process): its parameters are this rank's shards over the job's process "
        "groups. Save its state instead: zerofx.checkpoint.save(path, model, optimizer) (or "
        "torch.distributed.checkpoint on model.state_dict()), and zerofx.checkpoint.export for whole "
        "tensors; copy.deepcopy(model) makes a copy in this process"
    )


def _get_parameter(module: nn.Module, target: str) -> nn.Parameter:
    """``Module.get_parameter`` in a sharded model: a sharded parameter is returned itself (the
    DTensor of this rank's rows, as ``named_parameters`` gives it). torch's reads the attribute,
    which outside a graph is a copy gathered for the read: a collective, then "not an
    nn.Parameter" (transformers' ``tie_weights`` looks its weights up this way)."""
    path, _, name = target.rpartition(".")
    owner = module.get_submodule(path)
    if name in getattr(owner, "_zerofx_params", {}):
        return owner._parameters[name]
    return nn.Module.get_parameter(module, target)


def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    key = (cls, names)
    if key not in _SHARDED_CLASSES:
        attrs: dict[str, Any] = {name: _gathered_property(name) for name in names}
        attrs["_apply"] = _apply_keeping_shards
        attrs["_load_from_state_dict"] = _load_whole_into_shards
        attrs["_save_to_state_dict"] = _save_aliasing_shards
        attrs["__deepcopy__"] = _deepcopy_keeping_views
        attrs["__reduce_ex__"] = _refuse_pickling
        attrs["__module__"] = cls.__module__
        _SHARDED_CLASSES[key] = type(f"ZeroFX{cls.__name__}", (cls,), attrs)
    return _SHARDED_CLASSES[key]


def _group(mesh: DeviceMesh, dim: int) -> GroupInfo:
    return GroupInfo(mesh.size(dim), mesh.get_group(dim).group_name, mesh.get_local_rank(dim))


# NOTE: norm layers under param_dtype
# Buffers are never cast, so BatchNorm's running statistics stay fp32. In bf16 a running variance
# near 1 has an ulp of 2^-7: a momentum update 0.1·(batch - running) under half of it rounds
# away, so batch variances within 4% of the running one never move it (what that does to a
# whole-bf16 ResNet's running stats: docs/measurements.md, norm layers).
# ATen's batch_norm (CPU and CUDA kernels) takes weight, bias and running stats in one dtype:
# either the input's, or fp32 with a bf16/fp16 input ("mixed type": the kernel computes in fp32
# and writes its output in the input's dtype). A bf16 weight next to fp32 running stats is
# neither, which is the "expected scalar type BFloat16 but found Float" such a model used to
# fail with. So the parameters of batch and instance norm layers (torch's _NormBase) keep their
# master dtype: they are gathered and reduced in it, tiny (one value per channel), and the
# activations still flow in param_dtype, as under torch.autocast (whose forward is then the same
# arithmetic, tests/test_mixed_precision_bn.py). The mixed kernels exist for fp32 only, so a norm
# layer whose tensors are neither all fp32 nor all param_dtype is an error (_check_norm_dtypes).
_NORM_LAYERS = (nn.modules.batchnorm._NormBase,)


def _full_precision_params(model: nn.Module, opts: Options) -> set[int]:
    """ids of the parameters that keep their master dtype under ``param_dtype``."""
    if opts.param_dtype is None:
        return set()
    norms = [(name, m) for name, m in model.named_modules() if isinstance(m, _NORM_LAYERS)]
    for name, module in norms:
        _check_norm_dtypes(name, module, opts.param_dtype)
    return {id(p) for _, m in norms for p in m._parameters.values() if p is not None}


def _check_norm_dtypes(name: str, module: nn.Module, param_dtype: torch.dtype) -> None:
    """batch_norm runs a ``param_dtype`` input with weight, bias and running stats all in fp32
    or all in ``param_dtype``; anything else is an error naming the option, before any sharding."""
    found = {
        f"{name}.{n}": t.dtype
        for n, t in (*module._parameters.items(), *module._buffers.items())
        if t is not None and t.is_floating_point()
    }
    dtypes = set(found.values())
    if len(dtypes) > 1 or not dtypes <= {torch.float32, param_dtype}:
        listed = ", ".join(f"{n} is {d}" for n, d in found.items())
        raise ZeroFXError(
            f"option param_dtype={param_dtype}: {type(module).__name__} {name!r} cannot run a {param_dtype} "
            f"input ({listed}): batch_norm takes weight, bias and running stats all in float32 or all in "
            f"{param_dtype}; convert the norm layers with module.float(), or drop param_dtype"
        )


def _make_state(
    qualname: str,
    param: nn.Parameter,
    mesh: DeviceMesh,
    opts: Options,
    runtime: ModelRuntime,
    full_precision: bool = False,
    tp_mesh: DeviceMesh | None = None,
) -> ParamState:
    secondary = None
    if opts.secondary_shard:  # hpZ: the primary partition spans the whole mesh (NOTE: hpZ)
        secondary = _group(mesh, 1)
        mesh = _flat_mesh(mesh)
    tp = None  # NOTE: ZeRO with tensor parallelism
    if isinstance(param, DTensor):
        tp = TensorParallel(tp_mesh, tuple(param.placements), param.shape, param.stride())
        param = param.to_local()
    hybrid = mesh.ndim == 2
    shard_group = _group(mesh, 1 if hybrid else 0)
    replicate_group = _group(mesh, 0) if hybrid and mesh.size(0) > 1 else None
    # a TP share's size is its TP rank's (uneven splits differ): every TP rank decides by the
    # largest share, so that all of them keep a parameter whole or all shard it (the
    # whole-tensor step's TP exchange pairs them up: zerofx/runtime/whole_step.py)
    size = param.numel() if tp is None else _largest_share(tp)
    # at most the threshold stays whole, as DeepSpeed's numel <= stage3_param_persistence_threshold; 0 keeps none
    threshold = opts.persistence_threshold
    whole = param.dim() == 0 or (opts.stage == 3 and threshold > 0 and size <= threshold)
    dim = 0 if whole else _shard_dim(qualname, param, shard_group.size, opts, tp is not None or tp_mesh is not None)
    placements = [Replicate() if whole else Shard(dim)]
    if hybrid:
        placements = [Replicate(), *placements]
    device = torch.device(mesh.device_type) if param.is_meta else param.device
    if param.is_meta:  # only this rank's rows exist, uninitialized until loaded (NOTE: models built on meta)
        if whole:
            local = torch.empty(param.shape, dtype=param.dtype, device=device)
        else:
            rows_shape = rows_first(param, dim).shape
            rows = local_rows(rows_shape[0], shard_group.size, shard_group.rank)
            local = rows_back(torch.empty((rows, *rows_shape[1:]), dtype=param.dtype, device=device), dim)
        dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride())
    elif dim:  # the shard stored with its sharded dim first (NOTE: the sharded dim)
        by_rows = rows_first(param.detach(), dim).contiguous()
        local = distribute_tensor(by_rows, mesh, [*placements[:-1], Shard(0)], src_data_rank=0).to_local()
        dt = DTensor.from_local(
            rows_back(local, dim), mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    else:
        dt = distribute_tensor(param.detach(), mesh, placements, src_data_rank=0)
    if tp_mesh is not None:
        tp_placements = tp.placements if tp is not None else (Replicate(),)
        shape, stride = (tp.shape, tp.stride) if tp is not None else (param.shape, param.stride())
        dt = _on_dp_and_tp(qualname, dt.to_local(), mesh, placements, tp_mesh, tp_placements, shape, stride)
    master = param.dtype
    compute = opts.param_dtype if opts.param_dtype not in (None, master) and not full_precision else None
    full = None
    if opts.stage in (1, 2) and not whole:
        full = torch.empty(param.shape, dtype=compute or master, device=device)
        # (split along another dim its part is not one block of it; on disk it is a file of its
        # own, which a view of the whole copy in memory cannot be: offload_store.DiskStore.adopt)
        if compute is None and dim == 0 and opts.offload_optimizer not in ("disk", "auto"):
            # the shard is a view of its own rows of the whole copy: no second copy of them
            offset = row_offset(param.shape[0], shard_group.size, shard_group.rank)
            view = full.detach()[offset : offset + dt.to_local().shape[0]]
            view.copy_(dt.to_local())
            dt = DTensor.from_local(view, dt.device_mesh, dt.placements, shape=dt.shape, stride=dt.stride())
    new_param = nn.Parameter(dt, requires_grad=param.requires_grad)
    # gradients are reduced (and accumulated) in reduce_dtype, by default the master dtype; the
    # markers only carry it when it differs from the dtype the gradient is computed in
    reduce = opts.reduce_dtype or master
    # every parameter gets a sink, a frozen one too: unfrozen later (a fine-tuning schedule), it
    # accumulates local gradients as the others do (a stride-0 view of one element: no memory)
    sink = torch.empty_strided(param.shape, (0,) * param.dim(), dtype=reduce, device=device)
    sink.zero_().requires_grad_()
    sink.register_post_accumulate_grad_hook(weak_hook(runtime.on_local_grad))
    state = ParamState(
        qualname,
        new_param,
        whole,
        shard_group,
        replicate_group,
        param.shape[dim] if param.dim() else 1,
        runtime,
        compute_dtype=compute,
        reduce_dtype=None if reduce == (compute or master) else reduce,
        full=full,
        sink=sink,
        secondary_group=None if whole else secondary,
        tp=tp,
        shard_dim=dim,
    )
    track(state)
    for part in (sink, full):  # graph inputs too, where forward reads no shard (stage 1)
        if part is not None:
            part._zerofx_part_of = state
    if opts.plain_graph_inputs and tp is None and new_param.is_floating_point():
        state.make_leaf()
    return state


# NOTE: models built on meta
# A model built under ``torch.device("meta")`` has shapes and no memory. ``shard`` then allocates
# only each rank's rows of each parameter (and the buffers) on the mesh's device, uninitialized,
# so the whole model never exists on any rank (a tensor-parallel model's meta DTensors: the rows
# of their TP-local value, docs/tensor_parallel.md); its weights must be loaded
# (``zerofx.checkpoint.load_hf`` reads each rank's rows from safetensors, ``checkpoint.load``
# from a zerofx checkpoint, ``model.load_state_dict`` from whole tensors every rank holds, or
# from DTensors). Until every parameter and buffer has been loaded, forward is an error naming
# what is missing (``ModelRuntime.unloaded``), never a run on uninitialized memory.
# Buffers no checkpoint holds (non-persistent ones, such as HF's rotary ``inv_freq``) are
# recomputed by ``load_hf`` through the HF model's own ``_init_weights`` for modules that own
# no parameters; any other must be set by the user, who then calls ``mark_loaded``. The whole
# copies of stages 1 and 2 are allocated but not refreshed by ``shard``: a gather of
# uninitialized shards would cost a collective and its buffers at the build's peak for nothing;
# every loader refreshes them (and forward refuses stale ones).


# NOTE: an optimizer built before shard
# ``shard`` puts new parameter objects (DTensors) into the modules. An optimizer built before it
# still holds the old ones, which never get a gradient again: its steps would silently do
# nothing (the model would not train) while holding a whole copy of every parameter. FSDP2 has
# the same trap and documents it. Here each replaced parameter is marked with its name, and a
# global optimizer step pre-hook refuses, at an optimizer's first step (and again after
# ``add_param_group``), an optimizer that holds a marked one: an error naming the parameter
# instead of a run that does not train.

#
# NOTE: a reference to a replaced parameter
# The same mark catches a forward that reads a replaced parameter through a reference kept
# outside its module (``self.ws = [self.a.weight, ...]`` in ``__init__``): such a forward trained
# the old tensor, which no optimizer holds and no rank reduces, while the sharded parameter
# never got a gradient, silently (uncompiled). A compiled frame that reads one is refused by the
# backend (zerofx/backend.py, ``_refuse_parameters_added_after_sharding``); an uncompiled forward
# by a gradient hook on the replaced parameter, which raises when a backward reaches it.

_RETIRED = REPLACED_BY
_RETIRED_HOOK = None
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> groups checked


def _retire(param: nn.Parameter, qualname: str) -> None:
    if not hasattr(param, _RETIRED):  # a tied parameter keeps its first name
        setattr(param, _RETIRED, qualname)
        if param.requires_grad and param.is_leaf:  # NOTE: a reference to a replaced parameter
            param.register_hook(functools.partial(_refuse_replaced_gradient, qualname))


def _refuse_replaced_gradient(qualname: str, grad: torch.Tensor) -> None:
    raise read_after_sharding([(qualname, qualname)])


def _refuse_retired(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    groups = len(optimizer.param_groups)
    if _CHECKED.get(optimizer) == groups or torch.compiler.is_compiling():
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = getattr(p, _RETIRED, None)
            if name is not None:
                raise ZeroFXError(
                    f"{type(optimizer).__name__} holds the parameter {name!r} as it was before zerofx sharded the "
                    "model: zerofx.shard / zerofx.compile put new (sharded) parameters into the model, so this "
                    "optimizer would never see a gradient and the model would not train. Build the optimizer "
                    "after zerofx.compile / zerofx.shard, over model.parameters()"
                )
    _CHECKED[optimizer] = groups


def _install_retired_check() -> None:
    global _RETIRED_HOOK
    if _RETIRED_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _RETIRED_HOOK = register_optimizer_step_pre_hook(_refuse_retired)


def _built_on_meta(model: nn.Module) -> bool:
    named = [*model.named_parameters(), *model.named_buffers()]
    meta = [n for n, t in named if t.is_meta]
    if meta and len(meta) != len(named):
        real = next(n for n, t in named if not t.is_meta)
        raise ZeroFXError(
            f"{meta[0]} is on the meta device but {real} is not: build the whole model under "
            "torch.device('meta') (zerofx then allocates only each rank's shards) or none of it"
        )
    return bool(meta)


def _refuse_unloaded(model: nn.Module, args: Any, kwargs: Any) -> None:
    """Forward pre-hook of a model built on meta: refuse to run while tensors are not loaded (a
    module-level function reading the model's own runtime, so that copies check their own)."""
    runtime = runtime_of(model)
    if runtime.unloaded:
        missing = sorted(runtime.unloaded)
        shown = some_names(missing, 5)
        raise ZeroFXError(
            f"the model was built on the meta device and {len(missing)} of its tensors were never loaded "
            f"({shown}): load its weights first (zerofx.checkpoint.load_hf, zerofx.checkpoint.load or "
            "model.load_state_dict); "
            "set buffers no checkpoint holds yourself, then zerofx.sharding.mark_loaded(model, names)"
        )


def _expect_loading(model: nn.Module, runtime: ModelRuntime) -> None:
    runtime.unloaded = set(model.state_dict()) | {n for n, _ in model.named_buffers()}
    runtime.unloaded_hook = model.register_forward_pre_hook(_refuse_unloaded, with_kwargs=True)

    def loaded(module: nn.Module, incompatible: Any) -> None:  # model.load_state_dict loads too
        mark_loaded(module, set(module.state_dict()) - set(incompatible.missing_keys))

    model.register_load_state_dict_post_hook(loaded)
    owner = weakref.ref(model)
    for path, module in model.named_modules():
        if path:
            module.register_load_state_dict_pre_hook(functools.partial(_note_part_loaded, owner, path))


def _note_part_loaded(owner: weakref.ref, path: str, module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """``load_state_dict`` pre-hook of each submodule of a model built on meta: a load that
    starts at the submodule (``model.encoder.load_state_dict(pretrained)``, a new head, a
    model loaded part by part) marks the names it brings, under the submodule's path; the
    model's own post-hook sees only loads that start at the model. Only where the load starts
    (an empty ``prefix``), and only for the model this submodule was found in at sharding (a
    deepcopy's hooks still name the original, whose module at ``path`` is then another)."""
    model = owner()
    if prefix or model is None or dict(model.named_modules()).get(path) is not module:
        return
    mark_loaded(model, {f"{path}.{key}" for key in state_dict})


def _whole_copy_states(module: nn.Module) -> list:
    return [
        s for p in module.parameters() if (s := getattr(p, "_zerofx_state", None)) is not None and s.full is not None
    ]


def _whole_copy_runtime(module: nn.Module) -> ModelRuntime | None:
    """The runtime of the first parameter below ``module`` with a whole copy (None: none has
    one): what every module a load visits needs, where only the load's root needs the list."""
    first = next(
        (s for p in module.parameters() if (s := getattr(p, "_zerofx_state", None)) and s.full is not None), None
    )
    return None if first is None else first.runtime


def _begin_load(module: nn.Module, *args: Any) -> None:
    """Pre-hook of ``load_state_dict`` on the model and on every submodule holding parameters
    with whole copies (stages 1 and 2): the outermost module a load starts from (the model, a
    new head loaded into ``model.head``, a pretrained backbone into ``model.encoder``) is the
    one whose post-hook refreshes. torch runs every submodule's hooks within one load, the
    post-hooks innermost first: refreshing in each would all-gather once per module, and
    twice for a module's children."""
    runtime = _whole_copy_runtime(module)
    if runtime is None:
        return
    root = runtime.loading_root
    # a load from ``root`` visits only modules below it: one elsewhere means that load raised
    # before its end (its post-hooks never ran), and this one starts a load of its own
    if root is None or id(module) not in root[1]:
        runtime.loading_root = (module, {id(m) for m in module.modules()})


def _end_load(module: nn.Module, incompatible: Any) -> None:
    """Post-hook beside ``_begin_load``: the load's outermost module renews the whole copies of
    every parameter it holds (a collective: on every rank, as the load itself; one bucketed
    all-gather per group and dtype)."""
    runtime = _whole_copy_runtime(module)
    if runtime is not None and runtime.loading_root is not None and runtime.loading_root[0] is module:
        runtime.loading_root = None
        eager_buckets.refresh(_whole_copy_states(module))


def _check_whole_copies(model: nn.Module, args: Any) -> None:
    """Stages 1 and 2: an uncompiled forward (``zerofx.shard`` alone, or a deepcopy such as
    ``AveragedModel``'s, which torch copies without its compiled call) refuses stale whole
    copies as the compiled entry does (NOTE: stale whole copies, zerofx/runtime/params.py)."""
    runtime = runtime_of(model)
    if runtime.gathered is None:  # inside zerofx.gathered the whole copies are not what forward reads
        runtime.check_whole_copies(uncompiled=True)


def _refuse_added_parameters(model: nn.Module, args: Any) -> None:
    """An uncompiled forward of a sharded model refuses trainable parameters zerofx never saw (a
    module added after sharding), as the backend does for a compiled frame
    (``_refuse_parameters_added_after_sharding``, zerofx/backend.py): nothing would average their
    gradients, so each rank would train its own copy. A parameter set in place of a sharded one
    is left to the read that finds it (``ParamState.forward_value``: "the module holds another
    tensor"). One walk over the modules per uncompiled forward; inside a compiled region dynamo
    traces this as nothing."""
    if torch.compiler.is_compiling():
        return
    added = [
        f"{path}.{name}" if path else name
        for path, module in model.named_modules()
        for name, p in module._parameters.items()
        if p is not None
        and p.requires_grad
        and getattr(p, "_zerofx_state", None) is None
        and name not in getattr(module, "_zerofx_params", {})
    ]
    if added:
        raise added_after_sharding(added)


# a parameter whose padded shards exceed it by at least this many bytes is worth a warning
FEW_ROWS_WASTE_BYTES = 1 << 20


def _shard_dim(qualname: str, param: torch.Tensor, ranks: int, opts: Options, tensor_parallel: bool) -> int:
    """The dim ``param`` is split along (NOTE: the sharded dim): ``opts.shard_placement_fn``'s
    ``Shard(k)`` where it returns one, else zerofx's choice (``zerofx.ir.layout.shard_dim``). A
    parameter of a tensor-parallel model is split along dim 0, as the TP exchanges expect."""
    chosen = None if opts.shard_placement_fn is None else opts.shard_placement_fn(param)
    if chosen is None:
        return 0 if tensor_parallel else shard_dim(param.shape, ranks)
    if type(chosen) is not Shard or not -param.dim() <= chosen.dim < param.dim():
        raise ZeroFXError(
            f"option shard_placement_fn returned {chosen!r} for {qualname} {list(param.shape)}: return "
            f"torch.distributed.tensor.Shard(dim) with -{param.dim()} <= dim < {param.dim()}, or None for zerofx's choice"
        )
    dim = chosen.dim % param.dim()
    if dim and tensor_parallel:
        raise ZeroFXError(
            f"option shard_placement_fn returned {chosen!r} for {qualname}: with tensor parallelism zerofx "
            "shards parameters along dim 0 only; return Shard(0) or None"
        )
    return dim


def _warn_few_rows(states: list) -> None:
    """Warn about sharded parameters split along a dim with fewer entries than their shard group
    has ranks (only where no dim has enough, or ``shard_placement_fn`` chose so), where the
    padding costs at least ``FEW_ROWS_WASTE_BYTES``. torch.chunk's split gives the first ranks
    one slice each and the others nothing: those ranks hold up to ranks/slices times an even
    share, and every all-gather and reduce-scatter of the graphs moves each rank's padded slice
    (NOTE: the sharded dim). The same on every rank."""
    few = []
    for s in states:
        n = s.shard_group.size
        if s.whole or s.full_rows >= n or s.param.dim() == 0:
            continue
        row_bytes = s.row_numel * s.param.element_size()
        if (n - s.full_rows) * row_bytes >= FEW_ROWS_WASTE_BYTES:
            few.append((s.qualname, list(s.param.shape), s.shard_dim, n))
    if few:
        warnings.warn(
            f"zerofx: {some_names([f'{name} {shape} (split along dim {d})' for name, shape, d, _ in few])}: fewer "
            f"slices along the sharded dim than the {max(n for *_, n in few)} ranks sharding them, so the first "
            "ranks hold a slice each and the others none (those ranks hold up to ranks/slices times an even "
            "share) and each gather and reduce-scatter moves ranks/slices times their bytes, padding included. "
            "Split them along a larger dim (shard_placement_fn), or shard them over a mesh dimension of at most "
            "that many ranks; `zerofx plan` shows the per-rank bytes",
            stacklevel=3,
        )


def mark_loaded(model: nn.Module, names) -> None:
    """Record that ``names`` (state_dict keys or buffer names) of a model built on the meta
    device now hold their values (the loaders call this; so does a user who sets a buffer no
    checkpoint holds). Names of tied parameters count for every name of the same parameter."""
    runtime = runtime_of(model)
    if runtime is None or not runtime.unloaded:
        return
    names = set(names)
    for group in alias_names(model):
        if names & group:
            names |= group
    runtime.unloaded -= names
    if not runtime.unloaded and runtime.unloaded_hook is not None:
        runtime.unloaded_hook.remove()
        runtime.unloaded_hook = None


def alias_names(model: nn.Module) -> list[set[str]]:
    """The names of each parameter that has more than one (tied parameters)."""
    by_param: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), set()).add(name)
    return [g for g in by_param.values() if len(g) > 1]


# NOTE: hpZ
# ZeRO++'s hierarchical partitioning (``Options.secondary_shard``) is built on the 2-D mesh
# zerofx already has, ``(replicate, shard)`` read as (nodes, ranks per node), rather than on a
# 1-D world with a group size: the inner dimension's process group is exactly the secondary
# group (made once, by the mesh), a 2-D mesh is how users already say which ranks share a node,
# and the planner and the collective counter already split bytes by mesh dimension.
# With it, the primary partition is plain ZeRO-3 over every rank of the mesh: each parameter is
# a ``Shard(0)`` DTensor on the mesh flattened to 1-D (optimizer state, gradients and the
# gradient reduce-scatter are those of ZeRO-3 over the world), not replicated across the outer
# dimension as hybrid sharding is. The forward all-gathers over the whole mesh; the secondary
# pass (passes/secondary.py) keeps this rank's rows of the gathered value, as if sharded over the
# inner dimension only (``zerofx.ir.layout``'s chunking over its size), from forward to backward,
# and the backward all-gathers those over the inner dimension: its re-gather never crosses the
# outer one. The price: ``1/size(shard)`` of every re-gathered parameter (compute dtype) held
# between forward and backward, which the memory estimates count as saved activations.
_FLAT_MESHES: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}  # id(mesh) -> (mesh, flattened)


def _flat_mesh(mesh: DeviceMesh, beside_tp: bool = False) -> DeviceMesh:
    """``mesh`` flattened to 1-D, made once per mesh (flattening makes a process group, collectively);
    a mesh that is not 2-D is an error naming ``secondary_shard``. ``beside_tp``: ``mesh`` is what is
    left of the user's mesh without its tensor-parallel dimension, which the error says."""
    if mesh.ndim != 2:
        got = f"got a {mesh.ndim}-D mesh {tuple(mesh.shape)}"
        build = "build it with init_device_mesh(device, (nodes, ranks_per_node))"
        if beside_tp:
            got = f"the data-parallel part of the mesh, without its tensor-parallel dimension, is {mesh.ndim}-D {tuple(mesh.shape)}"
            build = (
                "next to tensor parallelism build a 3-D mesh, init_device_mesh(device, (nodes, ranks_per_node, tp), "
                "mesh_dim_names=('replicate', 'shard', 'tp')), and pass mesh['replicate', 'shard']"
            )
        raise ZeroFXError(
            f"option secondary_shard=True needs a 2-D mesh (replicate, shard): the secondary partition is the "
            f"shard dimension, which the backward's re-gather stays inside; {got} ({build}, or drop secondary_shard)"
        )
    if 1 in tuple(mesh.shape):
        outer, inner = tuple(mesh.shape)
        waste = (
            "keeps every gathered parameter whole from the forward to the backward (the whole model on every rank)"
            if inner == 1
            else "gathers over the same ranks as plain ZeRO-3 and keeps a secondary copy besides"
        )
        raise ZeroFXError(
            f"option secondary_shard=True on mesh {tuple(mesh.shape)}: the secondary partition is the inner "
            f"(shard) dimension, {inner} rank(s) here, so hpZ {waste}; use a mesh whose two dimensions both "
            "exceed 1 (nodes, ranks per node), or drop secondary_shard"
        )
    if id(mesh) not in _FLAT_MESHES:  # the mesh itself is kept too, so its id is never reused
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # the mesh's rank tensor is real, also under zerofx.plan's fake mode
            _FLAT_MESHES[id(mesh)] = (mesh, mesh._flatten() if mesh.mesh_dim_names else _flatten_unnamed(mesh))
            name_mesh_dims(_FLAT_MESHES[id(mesh)][1], ("whole mesh",))
    return _FLAT_MESHES[id(mesh)][1]


def _flatten_unnamed(mesh: DeviceMesh) -> DeviceMesh:
    """A 1-D mesh over every rank of ``mesh``, whose dimensions have no names (torch's
    ``DeviceMesh._flatten`` names the result after them and refuses a mesh without): a new group
    that only the mesh's own ranks create, as only they shard this model."""
    ranks = mesh.mesh.flatten().tolist()
    group = dist.new_group(ranks, use_local_synchronization=True)
    return DeviceMesh.from_group(group, mesh.device_type, mesh=ranks)


# NOTE: ZeRO with tensor parallelism
# A model parallelized with torch's tensor parallelism (``parallelize_module(model, mesh["tp"],
# plan)``) holds its parameters as DTensors on the TP mesh: each rank's local tensor is its
# TP share (a block of rows for column-wise layers, of columns for row-wise ones, the whole
# value for ``Replicate()`` ones such as sequence-parallel norms). zerofx shards that local
# tensor over the data-parallel dimension exactly as it shards a plain parameter (dim-0 rows,
# zerofx.ir.layout), so every marker, pass and collective of the data-parallel side is
# unchanged: what they call "the full parameter" is the TP-local value. Forward rebuilds the TP
# plan's DTensor from the gathered local value (``DTensor.from_local`` with the recorded
# placements and global shape, ``ParamState.forward_value``), and the TP plan's own
# redistributions (all-gathers, reduce-scatters, all-reduces on the TP group) run as before;
# AOTAutograd traces them into the same graphs as functional collectives, which zerofx's passes
# leave where they are (they only move, merge and rewrite the collectives zerofx inserted).
#
# What the optimizer steps is one 2-D DTensor per parameter on the (dp, tp) mesh (the dp and tp
# submeshes concatenated): the TP placement on "tp", and on "dp" ``Shard(0)``, or, when the TP
# placement already shards dim 0, ``_StridedShard(0, split_factor=tp)`` (dp's chunks are taken
# within each TP chunk: the order the rows were split in, as FSDP2 records it). So optimizer
# state is 1/(dp*tp) of the model's, ``clip_grad_norm_`` reduces over both dimensions and
# ``state_dict()`` holds global shapes that DCP reshards to any other layout. Plain parameters
# left out of the TP plan stay plain in forward and are ``(Shard(0), Replicate())``: as with
# FSDP2, the plan must make their gradients equal across the TP group.
#
# Hybrid sharding next to TP (a ``(replicate, shard, tp)`` mesh, torchtitan's HSDP + TP) is the
# same construction one dimension up: the data-parallel side is the 2-D ``(replicate, shard)``
# mesh it is without TP (gathers and reduce-scatters on "shard", the gradient all-reduce on
# "replicate"), and the optimizer's DTensors live on the 3-D mesh with ``(Replicate(), Shard(0)
# or _StridedShard(0), <TP placement>)``. ZeRO++ hpZ (``secondary_shard``) flattens the two
# data-parallel dimensions as it does without TP: ``(Shard(0) over both, <TP placement>)``, the
# backward re-gathering within "shard". The TP dimension never takes part in zerofx's own
# collectives, so nothing else changes.
_SPMD_MESHES: dict[tuple[int, int], tuple[DeviceMesh, DeviceMesh, DeviceMesh]] = {}


def _spmd_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The (dp..., tp) mesh of the optimizer's DTensors, made once per pair of meshes."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    key = (id(dp_mesh), id(tp_mesh))
    if key not in _SPMD_MESHES:  # the meshes are kept too, so their ids are never reused
        with unset_fake_temporarily():  # the meshes' rank tensors are real, also under zerofx.plan's fake mode
            _SPMD_MESHES[key] = (dp_mesh, tp_mesh, DeviceMesh._concatenate([dp_mesh, tp_mesh]))
    return _SPMD_MESHES[key][2]


def _largest_share(tp: TensorParallel) -> int:
    """Elements of the largest TP share of a tensor-parallel parameter (torch.chunk's split: the
    first shares are the largest)."""
    shape = list(tp.shape)
    for i, placement in enumerate(tp.placements):
        if placement.is_shard():
            shape[placement.dim] = -(-shape[placement.dim] // tp.mesh.size(i))
    return math.prod(shape)


def _on_dp_and_tp(
    qualname: str,
    local: torch.Tensor,
    dp_mesh: DeviceMesh,
    dp_placements: list,
    tp_mesh: DeviceMesh,
    tp_placements: tuple,
    shape: torch.Size,
    stride: tuple[int, ...],
) -> DTensor:
    """``local`` (this rank's dp rows of its TP-local value) as the optimizer's DTensor on the
    (dp..., tp) mesh, checked against DTensor's own idea of which rows those placements hold
    (NOTE: ZeRO with tensor parallelism): a layout the two would disagree on is an error, never a
    wrong state dict. ``dp_placements`` are zerofx's on the data-parallel mesh: ``[Shard(0)]`` or
    ``[Replicate()]``, with hybrid sharding ``[Replicate(), Shard(0) or Replicate()]``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = _spmd_mesh(dp_mesh, tp_mesh)
    *outer, inner = dp_placements
    if isinstance(inner, Shard) and any(isinstance(p, Shard) and p.dim == 0 for p in tp_placements):
        inner = _StridedShard(0, split_factor=tp_mesh.size())
    placements = (*outer, inner, *tp_placements)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # index arithmetic on the mesh's (real) rank tensor
        expected, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    mine = tuple(expected) != tuple(local.shape)
    # Only the strided layout of rows that do not split evenly can disagree, and then at some
    # coordinates only: the ranks agree on the verdict (one small all-reduce per such parameter),
    # so all of them raise together; a rank that passed alone would wait in the next parameter's
    # collective for peers that raised. (Checking every coordinate on every rank instead costs
    # DTensor's strided arithmetic dp x tp times: over a minute per shape at 1024 x 8.)
    uneven = isinstance(inner, _StridedShard) and shape[0] % (tp_mesh.size() * dp_mesh.size(dp_mesh.ndim - 1)) != 0
    first = _lowest_rank_where(mine, [dp_mesh, tp_mesh] if uneven else [])
    if first is not None:
        where = f"this rank ({dist.get_rank()})" if mine else f"rank {first} (not this one)"
        raise ZeroFXError(
            f"{qualname}: its tensor-parallel share {tuple(shape)} -> "
            f"{tuple(local.shape) if mine else 'rows'} on {where} after zerofx's data-parallel split does not match "
            f"DTensor's {placements} layout{f' {tuple(expected)}' if mine else ''}; this happens when dim 0's TP share "
            f"is not divisible by the data-parallel size {dp_mesh.size()} (pad the layer's size, or keep it out of "
            "the TP plan)"
        )
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _lowest_rank_where(flag: bool, meshes: list[DeviceMesh]) -> int | None:
    """The lowest global rank of ``meshes`` (a grid: the data-parallel mesh and the TP one) where
    ``flag`` holds, the same on every rank of them (a MIN all-reduce along each dimension's group:
    over a grid they reach every rank); None where it holds nowhere. With no meshes, or on a fake
    process group (zerofx.plan), this rank's own flag decides."""
    groups = [mesh.get_group(d) for mesh in meshes for d in range(mesh.ndim) if mesh.size(d) > 1]
    rank, world = dist.get_rank(), dist.get_world_size()
    if not groups or any(dist.get_backend(g) == "fake" for g in groups):
        return rank if flag else None
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        low = torch.tensor([rank if flag else world], dtype=torch.int64, device=meshes[0].device_type)
        for group in groups:
            dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        return None if int(low.item()) == world else int(low.item())


def _tp_mesh_of(
    model: nn.Module, mesh: DeviceMesh | None, tp_dim: str | None
) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """(the data-parallel mesh zerofx shards over, the TP mesh of the model's DTensor parameters
    or None), with one clear error for each way the two can be mixed up."""
    on = _dtensor_meshes(model)
    tp_dim = _implied_tp_dim(on, mesh, tp_dim)
    if isinstance(mesh, DeviceMesh) and (tp_dim is not None or (on and mesh.ndim > 2)):
        mesh = _data_parallel_dim(mesh, tp_dim, on)
    if not on:
        if tp_dim is not None:
            raise ZeroFXError(
                f"option tp_dim={tp_dim!r}: no parameter of the model is a DTensor; parallelize it first "
                f"(parallelize_module(model, mesh[{tp_dim!r}], plan)), or drop tp_dim"
            )
        return mesh, None
    if len(on) > 1:
        (m1, n1), (m2, n2) = list(on.values())[:2]
        raise ZeroFXError(
            f"the model's DTensor parameters live on different meshes ({n1} on {m1.mesh_dim_names} "
            f"{tuple(m1.shape)}, {n2} on {m2.mesh_dim_names} {tuple(m2.shape)}); zerofx composes with one "
            "tensor-parallel mesh"
        )
    tp_mesh, name = next(iter(on.values()))
    if mesh is None:
        raise ZeroFXError(
            f"{name} is a DTensor on a tensor-parallel mesh: pass zerofx the data-parallel mesh too "
            "(zerofx.compile(model, mesh['dp']), or the whole mesh with tp_dim=)"
        )
    if tp_mesh.ndim != 1:
        raise ZeroFXError(
            f"{name} is a DTensor on a {tp_mesh.ndim}-D mesh; zerofx composes with 1-D tensor parallelism"
        )
    if mesh.ndim > 2:
        raise ZeroFXError(
            f"mesh {tuple(mesh.shape)}: with tensor parallelism zerofx shards over one data-parallel dimension, or "
            "two for hybrid sharding (replicate, shard); pass those (mesh['dp'] or mesh['replicate', 'shard'])"
        )
    if tp_mesh is mesh or tp_mesh == mesh or set(tp_mesh.mesh_dim_names or ()) & set(mesh.mesh_dim_names or ()):
        raise ZeroFXError(
            f"{name} is tensor-parallel on mesh dimension {tp_mesh.mesh_dim_names}, the one zerofx was told to shard "
            "over: give zerofx the data-parallel dimension (mesh['dp']) and keep the TP plan on the other"
        )
    _check_crossing(name, tp_mesh, mesh)
    _refuse_untied_by_tensor_parallelism(model)
    return mesh, tp_mesh


def _refuse_untied_by_tensor_parallelism(model: nn.Module) -> None:
    """An HF model whose config ties the input and output embeddings, holding two parameters
    there: torch's ``parallelize_module`` gives each module its own DTensor, so a tied model
    comes out untied (its output embedding trained apart, and ``save_pretrained`` drops it as a
    tied copy). zerofx would shard and train what it is given, silently unlike the model the config
    describes; ``zerofx.tensor_parallel.parallelize`` keeps the tie (docs/tensor_parallel.md)."""
    config = getattr(model, "config", None)
    getters = [getattr(model, n, None) for n in ("get_input_embeddings", "get_output_embeddings")]
    if not getattr(config, "tie_word_embeddings", False) or not all(callable(g) for g in getters):
        return
    embeddings = [g() for g in getters]
    weights = [getattr(e, "weight", None) for e in embeddings]
    if any(w is None for w in weights) or weights[0] is weights[1]:
        return
    raise ZeroFXError(
        f"{type(model).__name__}'s config ties the input and output embeddings (tie_word_embeddings), but the "
        "model holds two tensors there: torch's parallelize_module gives each module its own parameter, which "
        "unties them. Parallelize with zerofx.tensor_parallel.parallelize(model, tp_mesh, plan), which keeps "
        "tied parameters tied"
    )


def _dtensor_meshes(model: nn.Module) -> dict:
    """The meshes of the model's DTensor parameters (by value: parallelize_module may slice its
    own copy) -> (the mesh, the first parameter on it)."""
    on = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            on.setdefault(p.device_mesh, (p.device_mesh, name))
    return on


def _implied_tp_dim(on: dict, mesh: DeviceMesh | None, tp_dim: str | None) -> str | None:
    """``tp_dim``, or where a 2-D or 3-D mesh was passed without it and the model's one TP mesh is
    one of its named dimensions, that dimension's name."""
    if tp_dim is not None or not isinstance(mesh, DeviceMesh) or mesh.ndim not in (2, 3) or len(on) != 1:
        return tp_dim
    tp_mesh, _ = next(iter(on.values()))
    names = tp_mesh.mesh_dim_names
    if tp_mesh.ndim == 1 and names and set(names) <= set(mesh.mesh_dim_names or ()):
        return names[0]
    return None


def _data_parallel_dim(mesh: DeviceMesh, tp_dim: str | None, on: dict) -> DeviceMesh:
    """The data-parallel dimensions of a mesh of more than one dimension, named apart from
    ``tp_dim``: one (dp), or two (replicate, shard) for hybrid sharding, in the mesh's order."""
    names = mesh.mesh_dim_names
    if names is None:
        raise ZeroFXError(
            f"mesh: a {mesh.ndim}-D mesh {tuple(mesh.shape)} without dimension names; zerofx cannot tell its "
            "data-parallel dimension from the others: build it with init_device_mesh(..., mesh_dim_names=("
            "'dp', 'tp')) and pass mesh['dp'] (or the mesh and tp_dim='tp')"
        )
    if tp_dim is None:
        raise ZeroFXError(
            f"mesh: a {mesh.ndim}-D mesh {names}; pass the data-parallel submesh (mesh['dp']) or name the "
            "tensor-parallel dimension with tp_dim="
        )
    if tp_dim not in names:
        raise ZeroFXError(f"option tp_dim={tp_dim!r}: the mesh's dimensions are {names}")
    rest = tuple(n for n in names if n != tp_dim)
    if len(rest) > 2:
        raise ZeroFXError(
            f"option tp_dim={tp_dim!r} on mesh {names}: zerofx shards over one data-parallel dimension next to "
            f"tensor parallelism, or two (replicate, shard) for hybrid sharding, not {rest}: flatten some of "
            "them, or pass fewer dimensions"
        )
    tp_expected = mesh[tp_dim]
    if on and all(m is not tp_expected and m != tp_expected for m, _ in on.values()):
        m, name = next(iter(on.values()))
        raise ZeroFXError(
            f"option tp_dim={tp_dim!r}: the model's tensor-parallel parameters ({name}, ...) live on mesh "
            f"{m.mesh_dim_names}, not on that mesh's {tp_dim!r} dimension"
        )
    return mesh[rest[0]] if len(rest) == 1 else mesh[rest]


def _tp_outer(tp_mesh: DeviceMesh, mesh: DeviceMesh) -> bool:
    """Whether the TP dimension comes before a data-parallel one in the mesh both were sliced
    from (by the dimensions' names there; a dimension the root does not name, a flattened one,
    is taken as in order: DTensor says so itself if it is not)."""
    names = tuple(mesh._get_root_mesh().mesh_dim_names or ())
    tp_names, dp_names = tuple(tp_mesh.mesh_dim_names or ()), tuple(mesh.mesh_dim_names or ())
    if not tp_names or not dp_names or not set(tp_names + dp_names) <= set(names):
        return False
    return min(names.index(n) for n in tp_names) < max(names.index(n) for n in dp_names)


def _check_crossing(name: str, tp_mesh: DeviceMesh, mesh: DeviceMesh) -> None:
    """``tp_mesh`` and the data-parallel ``mesh`` are the two dimensions of one layout."""
    # DeviceMesh caches slices by value, so two init_device_mesh calls of one layout share them:
    # what must hold is that both are slices of one layout, crossing each other (every (dp, tp)
    # coordinate one rank), which concatenating them checks
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    problem, outer = None, False
    with unset_fake_temporarily():
        if tp_mesh._get_root_mesh() != mesh._get_root_mesh():
            problem = "their root meshes differ"
        else:
            try:
                _spmd_mesh(mesh, tp_mesh)
            except RuntimeError as e:
                problem = str(e)
            else:
                outer = _tp_outer(tp_mesh, mesh)
        ranks = (tp_mesh.mesh.tolist(), mesh.mesh.tolist())
    if problem is None and outer:
        # DTensor reduces over the (dp..., tp) mesh by flattening it, which needs its dimensions in
        # the root mesh's order: with tp outer, clip_grad_norm_'s norm fails in DTensor's redistribute
        raise ZeroFXError(
            f"{name} is tensor-parallel on mesh dimension {tp_mesh.mesh_dim_names}, which is outer to the "
            f"data-parallel dimension {mesh.mesh_dim_names} in the mesh they were sliced from; zerofx needs "
            "tensor parallelism as the inner (last) dimension, as torchtitan lays it out: "
            "init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))"
        )
    if problem is not None:
        raise ZeroFXError(
            f"{name} is tensor-parallel on mesh {tp_mesh.mesh_dim_names} {ranks[0]}, which is not the "
            f"other dimension of the data-parallel mesh {mesh.mesh_dim_names} {ranks[1]} zerofx was "
            f"given ({problem}): were they made by different init_device_mesh calls? Slice both from one mesh "
            "(mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')); parallelize on mesh['tp'], "
            "pass mesh['dp'])"
        )


def _zero_grad_and_pending(self: nn.Module, set_to_none: bool = True) -> None:
    """``nn.Module.zero_grad`` that also drops the gradients ``zerofx.no_sync`` holds for the
    module's parameters, unreduced (zerofx/runtime/params.py, ``discard_pending``)."""
    type(self).zero_grad(self, set_to_none)
    discard_pending(self.parameters())


def _refuse_replaced_parameters(model: nn.Module) -> None:
    """Refuse parameters that an earlier ``shard`` of another module replaced (NOTE: a reference
    to a replaced parameter): one module shared with a module sharded before (an encoder's and a
    decoder's tied embedding, each compiled alone). The earlier module trains the sharded
    parameter, this one would train the old tensor: the tie would be broken."""
    replaced = [(name, getattr(p, REPLACED_BY)) for name, p in model.named_parameters() if hasattr(p, REPLACED_BY)]
    if replaced:
        said = [f"{name} (which was {old!r} of the module sharded first)" for name, old in replaced]
        raise ZeroFXError(
            f"{some_names(said, 3, '; ')}: shared with a module zerofx sharded before, which now holds a new "
            "(sharded) parameter in its place, so the two would train different tensors. Shard the modules "
            "that share parameters together: zerofx.compile the module that holds both"
        )


def _refuse_hooked_parameters(model: nn.Module) -> None:
    """Refuse parameters with gradient hooks (``register_hook``,
    ``register_post_accumulate_grad_hook``) registered before sharding: each parameter becomes a
    new one, which the hooks and their handles do not follow, so they would never run. Hooks
    registered on ``model.parameters()`` afterwards run when the reduced gradient shard lands
    (once per accumulation window)."""
    hooked = [name for name, p in model.named_parameters() if has_gradient_hooks(p)]
    if hooked:
        raise ZeroFXError(
            f"{some_names(hooked)}: gradient hooks registered before zerofx sharded the model would never run "
            "(sharding gives each parameter a new tensor); register them on model.parameters() after "
            "zerofx.compile / zerofx.shard"
        )


def _refuse_unsupported_parameters(model: nn.Module) -> None:
    """Refuse what zerofx cannot shard, by name, before anything changes:

    - embeddings with ``sparse=True``: their gradient is a sparse tensor, which has no rows to
      reduce-scatter, keep in a flat shard or step locally (DeepSpeed's ZeRO and FSDP have no
      sparse gradients either). It failed deep inside the first backward.
    - complex parameters: gloo's collectives have no complex type ("Invalid scalar type" while
      sharding at stages 1-2; a misleading refusal at stage 3). ``torch.view_as_real`` storage
      (a real parameter with a trailing dim of 2, viewed as complex in forward) shards as any
      other."""
    sparse = [
        name
        for name, module in model.named_modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
    ]
    if sparse:
        raise ZeroFXError(
            f"{some_names(sparse)}: an embedding with sparse=True makes sparse gradients, which zerofx does not "
            "shard or reduce; build it with sparse=False (its gradient is then a dense tensor, reduce-scattered "
            "like any other)"
        )
    complex_ = [name for name, p in model.named_parameters() if p.is_complex()]
    if complex_:
        raise ZeroFXError(
            f"{some_names(complex_)}: complex parameters are not supported by zerofx's collectives; keep each as a "
            "real parameter with a trailing dim of 2 and read it as torch.view_as_complex(self.weight) in forward"
        )


def _fsdp_wrapped(module: nn.Module) -> bool:
    """Whether FSDP2's ``fully_shard`` (its FSDPModule class) or FSDP1's wrapper holds ``module``."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return isinstance(module, (FSDPModule, FullyShardedDataParallel))


def _refuse_sharded_parts(model: nn.Module) -> None:
    """Refuse a model that holds zerofx-sharded parameters already: FSDP2's idiom of sharding
    each block and then the root (``fully_shard`` per block), or a block of a model zerofx has
    sharded. zerofx lays out a whole model in one call and buckets per block by itself, and a
    parameter sharded twice would be read through two layouts."""
    fsdp = next((name or "the model" for name, m in model.named_modules() if _fsdp_wrapped(m)), None)
    if fsdp is not None:
        raise ZeroFXError(
            f"{fsdp} is sharded by FSDP already (fully_shard / FullyShardedDataParallel): zerofx shards the "
            "model itself, and its parameters would be read through two layouts. Pass zerofx the model "
            "without FSDP (zerofx.compile(model, mesh) replaces fully_shard, per-block grouping included)"
        )
    inner = next((name for name, m in model.named_modules() if name and is_sharded(m)), None)
    if inner is not None:
        raise ZeroFXError(
            f"{inner} is already sharded by zerofx (zerofx.compile / zerofx.shard on that submodule): zerofx "
            "shards a whole model in one call and groups each block's collectives by itself, so FSDP2's "
            "per-block fully_shard has no zerofx counterpart. Build the model again and call "
            "zerofx.compile(model, mesh) on the root only"
        )
    taken = next(((name, p._zerofx_state) for name, p in model.named_parameters() if hasattr(p, "_zerofx_state")), None)
    if taken is not None:
        raise ZeroFXError(
            f"{taken[0]} belongs to a model zerofx has sharded already (as its parameter {taken[1].qualname}): a part of a "
            "sharded model trains through the model it belongs to; compile that model, not its parts"
        )


def _cast_floating_inputs(dtype: torch.dtype, module: nn.Module, args: Any, kwargs: Any) -> tuple:
    """Forward pre-hook (bound to ``dtype`` with functools.partial, which pickles and copies):
    floating-point inputs in the compute dtype."""

    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return tree_map(cast, args), tree_map(cast, kwargs)


def _settle_hf_loss_functions(model: nn.Module) -> None:
    """Pick each HF transformers model's loss function now and keep it (transformers' own
    setter, ``module.loss_function = ...``), so that the traced forward does not log.

    transformers looks the loss up on every read of ``loss_function`` and, for a model whose
    class name maps to no loss (GPT-2's ``GPT2LMHeadModel``; every base model, which never
    reads it), calls ``logger.warning_once`` and falls back to the causal-LM loss. dynamo cannot
    trace a logger call: the forward would break into two graphs there (the logits, a whole
    [batch, seq, vocab] activation, handed from one to the other outside any plan) and each
    compile would trace the model twice. The lookup is transformers' own, read with its logger
    quieted: the function kept is the one eager training uses, and the fallback's notice, which
    a base model would print for a loss it never computes, is not printed. A module that
    already has its own (``_loss_function``) is left alone; one whose ``loss_type`` changes after
    sharding keeps the loss it had. Done in ``shard``, so that ``zerofx.compile`` and
    ``torch.compile(backend="zerofx")`` on a sharded model both trace one graph."""
    for module in model.modules():
        prop = getattr(type(module), "loss_function", None)
        if not (
            isinstance(prop, property)
            and prop.fset is not None
            and prop.fget.__module__.startswith("transformers.")  # transformers' own, in a subclass too
            and "_loss_function" not in vars(module)
        ):
            continue
        log = logging.getLogger(prop.fget.__module__)
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            chosen = module.loss_function
        finally:
            log.setLevel(level)
        module.loss_function = chosen


def shard(model: nn.Module, mesh: DeviceMesh | None = None, options: Options | None = None, **kwargs) -> nn.Module:
    """Give every parameter of ``model`` ZeRO's layout over ``mesh``, in place.

    ``options`` (or keyword arguments) are :class:`zerofx.Options`; the ones that shape the
    layout are ``stage``, ``persistence_threshold``, ``param_dtype``, ``reduce_dtype`` and the
    loss-scaling options. Returns ``model``. With a mesh of one rank and no mixed precision
    nothing is sharded: the model trains as is. Unless it has one already, ``model`` gets
    DDP's ``model.no_sync()`` context (``zerofx.no_sync(model)``), which loops written for DDP and
    accelerate's ``accumulate`` call.
    """
    opts = Options.from_kwargs(options, **kwargs)
    if is_sharded(model):
        raise ZeroFXError("model is already sharded by zerofx; call zerofx.shard once per model")
    _refuse_sharded_parts(model)
    _refuse_replaced_parameters(model)
    on_meta = _built_on_meta(model)
    mesh, tp_mesh = _tp_mesh_of(model, mesh, opts.tp_dim)
    mesh = resolve_mesh(model, mesh, on_meta)
    name_mesh_dims(mesh, ("dp",) if mesh.ndim == 1 else ("replicate", "shard"))
    if tp_mesh is not None:
        name_mesh_dims(tp_mesh, ("tp",))
    # before any collective: a rank that differs would leave its peers waiting
    check_ranks_agree(model, [m for m in (mesh, tp_mesh) if m is not None], opts)
    if opts.secondary_shard:
        _flat_mesh(mesh, beside_tp=tp_mesh is not None)  # a 1-D mesh is an error here, before anything changes
    if not (mesh.size() == 1 and opts.param_dtype is None and tp_mesh is None):  # (else nothing is sharded)
        _refuse_hooked_parameters(model)
        _refuse_unsupported_parameters(model)
    full_precision = _full_precision_params(model, opts)
    _settle_hf_loss_functions(model)  # past every check: a call that raises leaves it alone
    runtime = ModelRuntime(stage=opts.stage, mesh=mesh, options=opts, local_step=opts.local_optimizer_step)
    runtime.tp_mesh = tp_mesh
    runtime.lockstep = make_lockstep([m for m in (mesh, tp_mesh) if m is not None], checks=opts.check_lockstep)
    model._zerofx = runtime
    if not hasattr(model, "no_sync"):  # DDP's and FSDP1's spelling, which accelerate's accumulate() calls
        model.no_sync = functools.partial(no_sync, model)
    runtime.scaler = make_loss_scaler(opts, mesh)
    if mesh.size() == 1 and opts.param_dtype is None and tp_mesh is None:
        log.info("zerofx: mesh has one rank; parameters stay whole")
        if on_meta:
            model.to_empty(device=mesh.device_type)
            _expect_loading(model, runtime)
        return model

    states: dict[int, ParamState] = {}  # id(original param) -> its one state
    for module_name, module in model.named_modules():
        names = tuple(n for n, p in module._parameters.items() if p is not None)
        if not names:
            continue
        for name in names:
            param = module._parameters[name]
            qualname = f"{module_name}.{name}" if module_name else name
            if id(param) not in states:
                full_precision_param = id(param) in full_precision
                states[id(param)] = _make_state(qualname, param, mesh, opts, runtime, full_precision_param, tp_mesh)
        module._zerofx_params = {name: states[id(module._parameters[name])] for name in names}
        for name in names:
            _retire(module._parameters[name], module._zerofx_params[name].qualname)
            module._parameters[name] = module._zerofx_params[name].param
        module.__class__ = _sharded_class(type(module), names)
    runtime.states = list(states.values())
    _warn_few_rows(runtime.states)
    for module in model.modules():  # an instance attribute: containers hold no parameter to swap a class for
        module.get_parameter = types.MethodType(_get_parameter, module)
        module.zero_grad = types.MethodType(_zero_grad_and_pending, module)
        if callable(getattr(type(module), "save_pretrained", None)):  # HF transformers' (and PEFT's)
            module.save_pretrained = types.MethodType(_save_pretrained_of_whole_tensors, module)
    if on_meta:
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.is_meta:
                    module._buffers[name] = torch.empty_like(buf, device=mesh.device_type)
        _expect_loading(model, runtime)
    _install_retired_check()
    install_local_step()  # adopts optimizers at their first step (local_optimizer_step only picks the path)
    if not on_meta:  # built on meta, the shards hold nothing yet: every loader refreshes after loading
        runtime.refresh()
    if runtime.whole_copies:
        for module in model.modules():  # module-level hooks: a deepcopy of the model refreshes its own
            if _whole_copy_runtime(module) is not None:
                module.register_load_state_dict_pre_hook(_begin_load)
                module.register_load_state_dict_post_hook(_end_load)
        model.register_forward_pre_hook(_check_whole_copies)
    if any(s.shard_group.size > 1 or s.replicate_group is not None for s in runtime.states):
        model.register_forward_pre_hook(_refuse_added_parameters)
    if opts.param_dtype is not None:
        model.register_forward_pre_hook(functools.partial(_cast_floating_inputs, opts.param_dtype), with_kwargs=True)
    return model
