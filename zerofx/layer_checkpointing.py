"""Activation checkpointing a model turns on itself (HF's ``activation_checkpointing_enable``),
done by zerofx's checkpoint pass instead of torch.utils.checkpoint.

# NOTE: a model's own layer checkpointing
transformers checkpoints a layer by calling its ``_gradient_checkpointing_func`` (torch's
``checkpoint``, through ``functools.partial`` with its keyword arguments) on the layer's forward
whenever the layer's ``gradient_checkpointing`` flag is set (``GradientCheckpointingLayer``:
every ``every_n_layers``-th decoder layer; the HF Trainer sets the flags for
``TrainingArguments(activation_checkpointing=True)``). Under torch.compile dynamo traces each
such call as a ``tag_activation_checkpoint`` region, and the compiled step no longer rounds as
the eager model does (torch's own ``aot_eager`` backend shows it: docs/measurements.md, "layer
checkpointing"), so ``zerofx verify`` would fail on a model that trains correctly, and dynamo
breaks the graph at the first call (two frames where one does).

``zerofx.compile`` therefore takes such layers over: it turns their flags off and asks its
checkpoint pass to recompute the same layers (``checkpoint_modules``, their module paths), which
keeps the eager arithmetic bit for bit and plans the recompute with everything else (re-gathered
parameters, offload, ``activation_budget``). transformers' offload form (``save_on_cpu`` around
the checkpoint) becomes ``offload_activations="host"`` where that option was left unset. Only
plain checkpointing is taken over: torch's ``checkpoint`` with keyword arguments that leave what
is saved as it is (``TAKEN_KWARGS``). A layer checkpointed any other way (a selective policy
through ``context_fn``, a function of the user's) keeps its own checkpointing, and the report
says which. Layers whose flags are set after ``zerofx.compile``, or whose model is compiled by
``torch.compile(backend="zerofx")`` (the backend sees graphs only), run torch's checkpoint calls,
which the checkpoint pass plans as regions (passes/checkpoint.py, NOTE: checkpoint calls in the
model).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
from torch import nn

from zerofx.errors import some_names

__all__ = ["TAKEN_KWARGS", "take_over"]

# torch.utils.checkpoint.checkpoint's keyword arguments that do not change what a layer saves or
# recomputes: a layer checkpointed with these (and no others) is recomputed by zerofx instead
TAKEN_KWARGS = frozenset({"use_reentrant", "preserve_rng_state", "determinism_check", "debug"})


def _form(fn: Any) -> str | None:
    """How a layer's ``_gradient_checkpointing_func`` checkpoints: "plain" (torch's checkpoint),
    "offload" (transformers' ``save_on_cpu`` around it), None (anything else: left alone)."""
    kwargs: dict = {}
    while isinstance(fn, functools.partial):
        kwargs.update(fn.keywords)
        fn = fn.func
    if not set(kwargs) <= TAKEN_KWARGS:
        return None
    if fn is torch.utils.checkpoint.checkpoint:
        return "plain"
    code = getattr(fn, "__code__", None)
    # transformers' offload form: a closure that enters save_on_cpu and calls torch's checkpoint
    if code is not None and {"save_on_cpu", "checkpoint"} <= set(code.co_names) | set(code.co_freevars):
        return "offload"
    return None


def _is_layer(module: nn.Module) -> bool:
    """A layer that checkpoints its own forward (transformers' ``GradientCheckpointingLayer``, by
    name: transformers is not imported for the check)."""
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__)


def _no_cache_in_training(model: nn.Module, taken: list[str]) -> None:
    """A checkpointed transformers model builds no KV cache in a forward with gradients in
    training mode (its decoder stack reads its own flag and forces ``use_cache=False``); with the
    flags off that forward built one, every layer's keys and values kept alive through the
    backward while its output is. A forward pre-hook asks the same of each outermost module with
    a ``config.use_cache`` around the layers ``taken`` over (the model, or the transformers
    model inside a user's wrapper), once per module. Without gradients, or in eval mode, the
    call is left as it is (generation caches as before)."""
    modules = dict(model.named_modules())
    around = lambda outer, inner: outer == "" or inner.startswith(outer + ".")  # noqa: E731
    hosts = [
        path
        for path, m in modules.items()
        if getattr(getattr(m, "config", None), "use_cache", None) is not None
        and any(around(path, layer) for layer in taken)
    ]
    for path in hosts:
        module = modules[path]
        if any(other != path and around(other, path) for other in hosts) or getattr(
            module, "_zerofx_no_training_cache", False
        ):
            continue
        position = _argument_position(module, "use_cache")
        if position is None:
            continue  # no use_cache argument to give (nor **kwargs to take it)
        module.register_forward_pre_hook(functools.partial(_no_cache, position), with_kwargs=True)
        module._zerofx_no_training_cache = True


def _argument_position(module: nn.Module, name: str) -> int | float | None:
    """The position of ``module.forward``'s argument ``name`` (inf: keyword only, or taken by
    ``**kwargs``), or None when the forward takes no such argument."""
    import inspect

    params = list(inspect.signature(module.forward).parameters.values())
    for i, p in enumerate(params):
        if p.name == name:
            return i if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else math.inf
    return math.inf if any(p.kind is p.VAR_KEYWORD for p in params) else None


def _no_cache(position: int | float, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    if not (module.training and torch.is_grad_enabled()):
        return None
    if position < len(args):  # given positionally: replaced where it is
        return (*args[:position], False, *args[position + 1 :]), kwargs
    return args, {**kwargs, "use_cache": False}


def take_over(model: nn.Module, options: Any) -> tuple[Any, str | None]:
    """Turn off the layer checkpointing ``model`` asks for itself and return ``options`` with
    zerofx recomputing those layers instead, and the line saying so (None: nothing to take
    over). NOTE above. Every module's flag goes off when every checkpointing layer is taken
    over: the others' (a decoder stack's, an attention's) only accompany the layers' (no cache
    while recomputing, a leaf bias for reentrant checkpointing), and the model is then the one
    without checkpointing; while a layer keeps its own, all of them stay as they are. A layer
    taken over is marked (``_zerofx_checkpointed``: its form), so that compiling the model
    again (Lightning compiles per stage) takes it over again."""
    flagged = [
        (path, module)
        for path, module in model.named_modules()
        if getattr(module, "gradient_checkpointing", False) is True
        and getattr(module, "_gradient_checkpointing_func", None) is not None
    ]
    forms = {
        path: _form(module._gradient_checkpointing_func) if path else None  # the model itself: not a layer of it
        for path, module in flagged
        if _is_layer(module)
    }
    kept = [path or "(the model)" for path, form in forms.items() if form is None]
    if kept:
        return options, (
            f"{some_names(kept, shown=4)} keep their own activation checkpointing (not plain "
            "torch.utils.checkpoint: a selective policy or another function), which torch.compile "
            "recomputes by torch's rules; zerofx takes over none of the model's checkpointing"
        )
    modules = dict(model.named_modules())
    for path, form in forms.items():
        modules[path]._zerofx_checkpointed = form
    if forms:
        for _, module in flagged:
            module.gradient_checkpointing = False
    taken = {path: m._zerofx_checkpointed for path, m in modules.items() if getattr(m, "_zerofx_checkpointed", None)}
    if not taken:
        return options, None
    _no_cache_in_training(model, list(taken))
    new = tuple(path for path in taken if path not in options.checkpoint_modules)
    changes: dict[str, Any] = {"checkpoint_modules": (*options.checkpoint_modules, *new)}
    if "offload" in taken.values() and options.offload_activations == "none":
        changes["offload_activations"] = "host"
    return dataclasses.replace(options, **changes), (
        f"the model's own activation checkpointing of {len(taken)} layer(s) ({some_names(list(taken), shown=4)}) "
        "is done by zerofx's checkpoint pass (checkpoint_modules"
        + (", offload_activations='host'" if "offload_activations" in changes else "")
        + "), not torch.utils.checkpoint"
    )
