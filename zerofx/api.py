"""The public entry points: ``compile`` and ``explain``."""

from __future__ import annotations

import builtins
import contextlib
import itertools
import re
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from zerofx.backend import make_backend, recorder_for
from zerofx.dump import Recorder
from zerofx.errors import ZeroFXError, some_names
from zerofx.layer_checkpointing import take_over
from zerofx.options import LAYOUT_OPTIONS, Options
from zerofx.passes.checkpoint import check_module_patterns
from zerofx.passes.modules import module_path
from zerofx.runtime.offload_store import place_model_state, resolve_offload_dir
from zerofx.runtime.params import runtime_of
from zerofx.sharding import is_sharded, mesh_of, shard

__all__ = ["compile", "explain", "gathered", "Gathered"]


def _dp_size(mesh: Any, options: dict[str, Any]) -> int | None:
    """The ranks a batch is split over: the mesh's, less its tensor-parallel dimension
    (``tp_dim``); None without a mesh (or with a ``tp_dim`` it does not have: the options'
    own check says so)."""
    if mesh is None:
        return None
    tp_dim = options.get("tp_dim")
    try:
        return mesh.size() // (mesh[tp_dim].size() if tp_dim else 1)
    except (KeyError, RuntimeError, ValueError):
        return None


def _enter(fn, name: str | None = None):
    """A frame outside torch/ around ``fn``: dynamo does not start tracing in torch.nn's own
    frames, so compiling ``Module._call_impl`` directly would skip torch containers such as
    ``nn.Sequential`` and only compile their children.

    Each call gets its own copy of the code object: dynamo keeps its compiled graphs, and
    counts recompiles against ``recompile_limit``, per code object, so without the copy every
    model compiled in a process would share one cache and one limit (a second model's
    shapes would push the first into eager execution). The copy has a name of its own too:
    dynamo's automatic dynamic shapes remember which input sizes changed per (file, line,
    name), and one model's sizes must not make another's first compile symbolic.
    ``name``: a name given before (explain's, to compile what the model runs: with the sizes its
    entry saw change, symbolic)."""

    def zerofx_entry(*args, **kwargs):
        return fn(*args, **kwargs)

    code = zerofx_entry.__code__.replace(co_name=name or f"zerofx_entry_{next(_entries)}")
    # globals of its own, for what dynamo stores there (NOTE: compiled graphs die with the model)
    scope = {"__builtins__": builtins, "__name__": __name__}
    entry = types.FunctionType(code, scope, code.co_name, None, zerofx_entry.__closure__)
    weakref.finalize(entry, _forget_compiled, code, scope).atexit = False
    return entry


# NOTE: compiled graphs die with the model
# dynamo keeps a frame's compiled graphs in the frame's globals (``__compiled_fn_*``), with a
# hook that removes them once the code object it compiled to dies. That may never happen: the
# compiled code hangs off the entry's code object (its cache entries), and dynamo's map from
# compiled code back to the code it came from holds the entry's code strongly, a cycle through C
# fields the garbage collector cannot see (and with param_dtype set, something outside Python
# still held the compiled code after its cache entries were gone). Every model's graphs (and what
# they hold: constants, the backend's state) stayed alive for the life of the process, growing a
# sweep or a notebook by every model it built. Each entry has globals of its own, and when the
# entry dies (with the model that holds it) the cache entries of its code are dropped and the
# compiled graphs in its globals let go (set to None: dynamo's hook deletes the names if it ever
# runs). Frames dynamo compiles apart from the entry (a module's ``forward`` after a graph break
# inside it) live on that module class's code, shared by its instances, as under torch.compile:
# at most ``recompile_limit`` of them per code object.


def _forget_compiled(code: types.CodeType, scope: dict) -> None:
    torch._dynamo.reset_code(code)
    for name in list(scope):
        if name.startswith(("__compiled_fn", "__resume")):
            scope[name] = None


_entries = itertools.count()


def compile(model: nn.Module, mesh: DeviceMesh | None = None, *, config: Any = None, **options: Any) -> nn.Module:
    """Shard ``model`` over ``mesh`` (ZeRO-3 by default, ``stage=1``/``2`` on request) and
    compile it with the zerofx pipeline, in place.

    Returns ``model`` itself: parameter names, ``state_dict`` keys and the module tree are
    unchanged; ``model.parameters()`` are now this rank's shards, so build the optimizer after
    this call. ``options`` are the fields of :class:`zerofx.Options`; bad options (an unknown
    name, a budget out of range, an ``offload_dir`` that cannot be written) raise here.

    With ``offload_optimizer`` set, the parameter shards move to their tier now; wrap the
    optimizer with :func:`zerofx.offload_optimizer` so its state follows and it steps in windows.

    ``config``: a DeepSpeed config (a dict or a JSON file's path) translated into these options
    (zerofx/ds_config.py); keywords override what it leaves to ``"auto"``, a keyword that
    contradicts it raises, keys with no effect here are named in one warning each, and its
    training-loop settings (clipping, accumulation, ...) are kept in
    ``zerofx.runtime.params.runtime_of(model).training``.

    Called again on a model it compiled, with the same options and no mesh or a mesh over the
    same ranks, it returns the model as it is (Lightning calls ``configure_model`` for every
    stage); other options recompile it (layout options must match the sharding).
    """
    return _compile(model, mesh, config, options)


def _compile(
    model: nn.Module,
    mesh: DeviceMesh | None,
    config: Any,
    options: dict[str, Any],
    *,
    cost: Any = None,
    keep_graphs: bool = False,
    check_patterns: bool = True,
) -> nn.Module:
    """``compile``'s body; ``zerofx.plan`` also passes the cost model its decisions are priced
    with and asks the backend to keep the final graphs, and checks ``checkpoint_modules`` itself
    on the models it traces with fewer blocks than the one it plans."""
    training: dict[str, Any] = {}
    if config is not None:
        from zerofx.ds_config import from_deepspeed, hidden_size_of, merge_with_keywords

        translation = from_deepspeed(
            config, hidden_size=hidden_size_of(model), data_parallel_size=_dp_size(mesh, options)
        )
        for line in translation.warnings:
            warnings.warn(f"zerofx: DeepSpeed config: {line}", stacklevel=3)
        options = merge_with_keywords(translation, options)
        training = translation.training
        if options.get("quantize_grads") == "int8":
            for line in translation.int8_grad_warnings:
                warnings.warn(f"zerofx: DeepSpeed config: {line}", stacklevel=3)
    opts = Options.from_kwargs(**options)
    if config is not None and opts.param_dtype is torch.bfloat16:  # bf16.enabled="auto", turned on
        for line in translation.bf16_warnings:
            warnings.warn(f"zerofx: DeepSpeed config: {line}", stacklevel=3)
    opts = resolve_offload_dir(opts)  # before sharding: a bad folder fails with the model untouched
    if not isinstance(model, nn.Module):
        raise ZeroFXError(f"zerofx.compile takes an nn.Module, got {type(model).__name__}")
    if check_patterns:  # the user's patterns: take_over adds only paths of the model's own modules
        check_module_patterns(opts.checkpoint_modules, model)
    opts, checkpointing = take_over(model, opts)  # NOTE: a model's own layer checkpointing
    if is_sharded(model):
        runtime = runtime_of(model)
        if mesh is not None and not _same_mesh(mesh, runtime, opts.tp_dim):
            raise ZeroFXError(
                f"model was sharded on a mesh of ranks {runtime.mesh.mesh.tolist()} ({runtime.mesh.device_type}), "
                f"this mesh has ranks {mesh.mesh.tolist()} ({mesh.device_type}); pass the same mesh or none"
            )
        sharded_with = runtime.options
        differ = [n for n in LAYOUT_OPTIONS if n in options and getattr(opts, n) != getattr(sharded_with, n)]
        if differ:
            raise ZeroFXError(
                f"option {differ[0]}={getattr(opts, differ[0])!r} differs from the one the model was "
                f"sharded with ({getattr(sharded_with, differ[0])!r}); shard and compile with the same"
            )
        compiled = runtime.compiled
        has_call = model.__dict__.get("_compiled_call_impl") is not None  # a deepcopy has the state, not the call
        if cost is None and not keep_graphs and compiled is not None and compiled.options == opts and has_call:
            runtime.training = training
            return model  # compiled with these options already: a second call (Lightning's configure_model per stage) is a no-op
    else:
        shard(model, mesh, opts)
    mesh = mesh_of(model)
    runtime = runtime_of(model)
    if cost is None and opts.comm.calibrate and mesh.size() > 1:
        from zerofx.passes.cost_model import CostModel, calibrate_comm

        cost = CostModel(comm=calibrate_comm(mesh.get_group(), device=mesh.device_type))
    if place_model_state(model, opts) != "none":
        recorder = recorder_for(opts)
        if recorder is not None:
            recorder.note("model", "state", runtime.state_report)
    runtime.checkpoint_report = checkpointing
    if checkpointing is not None and (recorder := recorder_for(opts)) is not None:
        recorder.note("model", "checkpoint", checkpointing)
    runtime.training = training
    backend = make_backend(opts, cost=cost)
    runtime.compiled = backend.zerofx_state
    if keep_graphs:
        runtime.compiled.graphs = {}
    dynamic = None if opts.codegen.dynamic == "auto" else opts.codegen.dynamic  # None: torch's automatic
    # the guard filter comes with the plain inputs: plain_graph_inputs=False is the build before both
    guards = {"guard_filter_fn": _guard_filter(model)} if runtime.options.plain_graph_inputs else None
    entry = _enter(model._call_impl)
    runtime.compiled.entry_name = entry.__code__.co_name
    compiled = torch.compile(entry, backend=backend, dynamic=dynamic, options=guards)
    model._compiled_call_impl = compiled
    return model


# what zerofx.shard fixed for every parameter of a model alike (the groups it is sharded and
# replicated over) and a ParamState's __dict__ (no attribute shadows its methods): dynamo guards
# each, for every parameter, at every call of a compiled frame. Not what differs between
# parameters (rows, whole, dtypes, tp): a frame may run for several modules of one class
_FIXED_STATE = re.compile(r"\._zerofx_params\['[^']+'\]\.(?:__dict__|shard_group|replicate_group|secondary_group)\b")
# a parameter's DTensor internals, which a graph reading its plain leaf does not read; only in the
# model's own frame (named from zerofx.compile's entry, ``fn.__self__``), where a path names one
# parameter
_DTENSOR_INSIDES = re.compile(r"^((?:L\['fn'\]|fn)\.__self__\..*\._parameters\['[^']+'\])\.(?:_local_tensor|_spec)\b")


def _guard_filter(model: nn.Module):
    """dynamo's ``guard_filter_fn`` for ``model``: drop the guards, taken per parameter at every
    call of a compiled frame, on what ``zerofx.shard`` fixed and nothing changes:

    - the groups every parameter is sharded and replicated over, the same for the whole model,
      and each ParamState's ``__dict__`` (no attribute shadows its methods);
    - in the model's own frame, for a parameter the graphs read through its plain leaf (NOTE:
      plain graph inputs, zerofx/runtime/params.py), the DTensor's spec and local tensor: the
      graph reads neither, and the guard that the module still holds that very parameter stays.

    The guards on what can change, or differs between two modules a frame may run for, stay:
    the mode flags (stage, sync, pending), requires_grad, the leaf, the whole copy, rows, dtypes,
    whether it is kept whole, the parameter's identity."""
    plain = {
        name
        for name, p in model.named_parameters(remove_duplicate=False)
        if getattr(getattr(p, "_zerofx_state", None), "leaf", None) is not None
    }

    def keep(entries: list) -> list[bool]:
        kept = []
        for entry in entries:
            insides = _DTENSOR_INSIDES.search(entry.name)
            dropped = _FIXED_STATE.search(entry.name) is not None or (
                insides is not None and module_path(insides.group(1)) in plain
            )
            kept.append(not dropped)
        return kept

    return keep


def _same_mesh(given: DeviceMesh, runtime: Any, tp_dim: str | None) -> bool:
    """Whether ``given`` lays out the ranks the model was sharded over as its own mesh does (a
    new DeviceMesh object over the same ranks counts: Lightning builds one per stage), or is
    the whole ``(dp, tp)`` or ``(replicate, shard, tp)`` mesh whose dimensions those are."""

    def same(a: DeviceMesh, b: DeviceMesh | None) -> bool:
        return a is b or (b is not None and a.device_type == b.device_type and torch.equal(a.mesh, b.mesh))

    if same(given, runtime.mesh):
        return True
    names = given.mesh_dim_names or ()
    if runtime.tp_mesh is not None and given.ndim in (2, 3) and tp_dim in names:
        dp = tuple(n for n in names if n != tp_dim)
        return same(given[dp if len(dp) > 1 else dp[0]], runtime.mesh) and same(given[tp_dim], runtime.tp_mesh)
    return False


def explain(
    model: nn.Module,
    *example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    backward: bool = True,
    **options: Any,
) -> str:
    """Compile ``model`` on ``example_inputs`` (and ``example_kwargs``: an HF model's
    ``input_ids=``, ``labels=``) once and print what every pass did.

    Runs one forward and, with ``backward=True``, a backward so that backward graphs are
    compiled too: of the output's ``loss`` (an attribute or key, as HF's outputs have), else of
    the first tensor in the output that requires grad (summed unless a scalar); with none, no
    backward. The model's gradients, buffers (batch norm's running statistics) and the random
    generators are left as they were (what the step produces is dropped), and
    a backward inside an accumulation window (``zerofx.no_sync``, or one not reduced yet) is an
    error: it would join the window's reduction. On a sharded model this is a collective:
    every rank calls it. Returns the report it printed.

    Layout options (``zerofx.options.LAYOUT_OPTIONS``: stage, dtypes, ...) were fixed when the
    model was sharded: one that differs from the sharding's is an error. A model (or submodule)
    compiled by ``zerofx.compile`` is compiled again here, every frame of it with this report's
    recorder and with the options it was compiled with (``options`` given here override them;
    ``dump_dir`` is this call's own); its own compiled call is left as it was.
    """
    if not isinstance(model, nn.Module):
        raise ZeroFXError(f"zerofx.explain takes an nn.Module, got {type(model).__name__}")
    runtime = runtime_of(model)
    compiled_with = runtime.compiled.options if runtime is not None and runtime.compiled is not None else None
    if compiled_with is not None:  # what runs is what is explained
        opts = Options.from_kwargs(compiled_with, **{"dump_dir": None, **options})
    else:
        opts = Options.from_kwargs(**options)
    _check_explain_layout(options, opts, runtime)
    check_module_patterns(opts.checkpoint_modules, model)
    recorder = Recorder(dump_dir=opts.dump_dir, summary_name="explain.txt")  # its frames' own summary
    if runtime is not None and runtime.state_report:
        recorder.note("model", "state", runtime.state_report)
    if runtime is not None and runtime.checkpoint_report:
        recorder.note("model", "checkpoint", runtime.checkpoint_report)
    states = runtime.states if runtime is not None else []
    whole = [s for s in states if s.full is not None]
    if whole:  # stages 1-2: collectives outside the compiled graphs, which the passes never see
        eager = [
            f"after each optimizer step, {len(whole)} whole copies are all-gathered from the shards (in flat buckets)"
        ]
        if runtime.stage == 1:
            eager.insert(0, "at the end of each backward, the whole gradients are reduce-scattered (in flat buckets)")
        recorder.note(
            "model",
            "eager",
            "; ".join(eager) + ": run eagerly (zerofx/runtime/eager_buckets.py), not in the graphs below",
        )
    split = [s.layout for s in states if s.shard_dim]
    if split:  # zerofx/ir/layout.py, NOTE: the sharded dim
        recorder.note(
            "model",
            "layout",
            f"split along another dim than 0 (fewer rows than ranks, or shard_placement_fn): {some_names(split, shown=8)}",
        )

    cost = runtime.compiled.cost if compiled_with is not None else None  # (calibrated, where it was)
    # the model's own call, as zerofx.compile compiles it: its module paths are the model's
    entry = _enter(model._call_impl, runtime.compiled.entry_name if compiled_with is not None else None)
    compiled = torch.compile(entry, backend=make_backend(opts, recorder, cost=cost))
    if backward and runtime is not None and (runtime.pending or not runtime.sync):
        raise ZeroFXError(
            "zerofx.explain(backward=True) inside an accumulation window (zerofx.no_sync) would reduce the "
            "window's gradients with its own: call it between steps, or with backward=False"
        )
    # the report's backward must not add into gradients already there (it would double them in
    # place): they are set aside, and put back afterwards as they were
    had_grad = {p: p.grad for p in model.parameters()}
    for p in had_grad:
        p.grad = None
    # and what the step writes besides gradients: buffers (batch norm's running statistics, its
    # step count) and the random generators (dropout): a run that explains first then trains as
    # the same run without it
    had_buffers = {b: b.detach().clone() for b in model.buffers()}
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)
    # NOTE: a compiled model's own frames. A module's compiled call (``_compiled_call_impl``, set
    # by zerofx.compile) runs under its own backend, which has no recorder: at a graph break
    # dynamo resumes the frames after it there, and the report would miss them (or every frame,
    # when dynamo does not inline the call at all). So explain runs the modules' plain calls.
    own_calls = {
        m: m.__dict__["_compiled_call_impl"]
        for m in model.modules()
        if m.__dict__.get("_compiled_call_impl") is not None
    }
    try:
        for m in own_calls:
            m._compiled_call_impl = None
        out = compiled(*example_inputs, **(example_kwargs or {}))
        loss = loss_of(out) if backward else None
        if loss is not None:
            loss.backward()
    finally:
        for m, call in own_calls.items():
            m._compiled_call_impl = call
        for p, g in had_grad.items():
            p.grad = g
        with torch.no_grad():
            for b, value in had_buffers.items():
                b.copy_(value)
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])
    if not recorder.records:
        raise ZeroFXError(
            f"zerofx.explain: no graph of {type(model).__name__} was compiled, so there is nothing to report: "
            "dynamo ran the whole forward eagerly (a recompile limit reached, or torch._dynamo.disable on it). "
            "Run with TORCH_LOGS=recompiles,graph_breaks to see why, or call torch._dynamo.reset() before explain"
        )
    report = recorder.summary()
    print(report)
    return report


def _check_explain_layout(given: dict[str, Any], opts: Options, runtime: Any) -> None:
    """explain compiles the model as it is sharded: a layout option it is given (stage, dtypes,
    ...) that differs from the sharding's would be silently ignored, so it is an error."""
    if runtime is None:
        differ = opts.non_default_layout()
        if differ:
            raise ZeroFXError(
                f"zerofx.explain: option {differ[0]}={getattr(opts, differ[0])!r} is decided when parameters are "
                f"sharded and this model is not: pass it to zerofx.compile(model, mesh, {differ[0]}=...) "
                "(or zerofx.shard) first, then explain the model without it"
            )
        return
    differ = [n for n in LAYOUT_OPTIONS if n in given and getattr(opts, n) != getattr(runtime.options, n)]
    if differ:
        raise ZeroFXError(
            f"zerofx.explain: option {differ[0]}={getattr(opts, differ[0])!r} differs from the one the model was "
            f"sharded with ({getattr(runtime.options, differ[0])!r}); it is decided when parameters are sharded: "
            f"drop it, or shard a fresh model with zerofx.compile(model, mesh, {differ[0]}=...) and explain that"
        )


def loss_of(out: Any) -> torch.Tensor | None:
    """The scalar to backpropagate from a model's output (``explain``'s and the planner's step):
    its ``loss`` (an attribute or key, as HF's outputs have), else its first tensor that requires
    grad, summed unless a scalar; None when no tensor in it requires grad."""
    loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
        leaves = torch.utils._pytree.tree_leaves(out)
        loss = next((t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad), None)
    return loss if loss is None or loss.dim() == 0 else loss.float().sum()


@dataclass(frozen=True)
class Gathered:
    """What :func:`gathered` holds: ``nbytes`` of whole parameters beyond the shards (per rank)."""

    params: int
    nbytes: int


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[Gathered]:
    """Gather every sharded parameter once; forwards inside read them with no communication.

        with torch.no_grad(), zerofx.gathered(model) as g:   # g.nbytes: the memory it costs
            tokens = model.generate(ids, max_new_tokens=64)

    For inference on a ZeRO-3 model: generation calls forward once per token, and each forward
    otherwise all-gathers every parameter (what makes ZeRO-3 generation slow in RLHF loops).
    Entering is a collective (one all-gather per parameter, the same order on every rank); the
    whole parameters, in the compute dtype, stay until the context exits, so each rank holds
    the whole model for that long: ``nbytes`` says how much that adds (0 for stages 1 and 2,
    which keep whole copies anyway). Inside, the model runs eagerly (not through its compiled
    graphs: shapes change every token) and a forward that would need gradients for a trainable
    parameter is an error: the gathered copies are detached from the shards. At stage 3 they also
    do not follow the shards: a forward after an optimizer step or a ``load_state_dict`` inside
    the context is an error (exit and enter again to gather the new values); stages 1 and 2 read
    their whole copies, which steps and loads refresh.
    """
    runtime = runtime_of(model)
    if runtime is None:
        raise ZeroFXError("zerofx.gathered: the model is not sharded by zerofx (zerofx.compile or zerofx.shard)")
    if runtime.gathered is not None:  # nested: the outer context already holds them
        yield Gathered(len(runtime.gathered), 0)
        return
    runtime.check_whole_copies()
    whole: dict = {}
    extra = 0
    with torch.no_grad():
        for state in runtime.states:
            if state.full is not None:  # stages 1 and 2: the whole copy forward already reads
                whole[state] = state.full
                continue
            if runtime.tp_mesh is not None:  # (dp..., tp): the TP share, replicated over the dp dims
                dp_dims = state.param.device_mesh.ndim - 1
                placements = (*(Replicate(),) * dp_dims, state.param.placements[-1])
                value = state.param.redistribute(placements=placements).to_local()
            else:
                value = state.param.full_tensor()  # an all-gather unless the parameter is kept whole
            if state.compute_dtype is not None:
                value = value.to(state.compute_dtype)
            whole[state] = value
            if not state.whole or state.compute_dtype is not None:  # not the shard itself
                extra += value.numel() * value.element_size()
    compiled = model.__dict__.get("_compiled_call_impl")
    runtime.gathered = whole
    # stage 3's copies do not follow the shards (stages 1-2 read the whole copies steps refresh):
    # a read after the shard changed refuses instead of computing with the old values
    runtime.gathered_versions = {state: state.versions() for state in whole if state.full is None}
    model._compiled_call_impl = None
    try:
        yield Gathered(len(whole), extra)
    finally:
        runtime.gathered = runtime.gathered_versions = None
        model._compiled_call_impl = compiled
