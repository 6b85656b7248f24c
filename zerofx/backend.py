"""The dynamo backend: capture with AOTAutograd, rewrite with the pass pipeline, then execute.

One call of the backend per dynamo frame (a model with a graph break produces two). For each:

    dynamo FX graph
      -> AOTAutograd traces the joint forward+backward graph     (markers from zerofx.ir.markers inside)
      -> passes on the "joint" graph (regather: what the backward must recompute; checkpoint:
                                     what it gets saved, recomputed or reloaded, under the budget)
      -> min-cut partitioner         -> forward graph, backward graph (hpZ's secondary shards moved
                                        across: passes/secondary.py split_secondary); invariants checked:
                                        no gathered parameter is saved for backward, and the
                                        partition saves what the checkpoint plan decided
      -> passes on the "forward" / "backward" / "inference" graphs  (gather, reduce: lower markers)
      -> codegen executor             ("aten", "triton" or "inductor"; see zerofx.codegen.executor),
                                      wrapped by zerofx.measure.instrument (collective counting)

The pipeline itself (which passes, in which order, reading and writing what) is described once,
in docs/architecture.md.

Registered as ``torch.compile(model, backend="zerofx")`` through the ``torch_dynamo_backends``
entry point; options may be given as ``torch.compile(..., options={...})``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.distributed.tensor import DTensor

from zerofx.codegen.executor import make_executor
from zerofx.dump import Recorder
from zerofx.errors import ZeroFXError, some_names
from zerofx.ir.collectives import ALL_GATHER, COLLECTIVE_OPS, backend_of, mesh_dim_or_size
from zerofx.ir.markers import FORWARD_MARKERS
from zerofx.ir.meta import ACTIVATION_PLAN, BORROWED_INPUTS
from zerofx.measure.instrument import graph_collectives, instrument
from zerofx.options import Options
from zerofx.passes.checkpoint import format_bytes, partition_by_plan, wants_plan
from zerofx.passes.cost_model import (
    CostModel,
    MemoryEstimate,
    borrowed_inputs,
    estimate_memory,
    node_bytes,
    saved_activation_bytes,
    saved_values,
    tensor_bytes,
)
from zerofx.passes.modules import module_path
from zerofx.passes.pipeline import PassContext, resolve_disabled, run_pipeline
from zerofx.passes.regather import check_no_gathered_saved
from zerofx.passes.secondary import split_secondary
from zerofx.runtime.lockstep import Lockstep, digest_of
from zerofx.runtime.lockstep import merge as merge_locksteps
from zerofx.runtime.offload_store import resolve_offload_dir
from zerofx.runtime.params import REPLACED_BY, added_after_sharding, read_after_sharding

log = logging.getLogger(__name__)

__all__ = ["zerofx_backend", "make_backend", "CompileState"]

_frame_ids = itertools.count()
_recorders: dict[str, Recorder] = {}
_lock = threading.Lock()


def recorder_for(options: Options) -> Recorder | None:
    """One recorder per dump folder per process, so every frame lands in one summary."""
    if options.dump_dir is None:
        return None
    key = str(Path(options.dump_dir).resolve())  # "dump" and its absolute path are one folder
    with _lock:
        if key not in _recorders:
            _recorders[key] = Recorder(dump_dir=options.dump_dir)
        return _recorders[key]


@dataclass
class CompileState:
    """What one compile (one backend: ``zerofx.compile`` of a model, or one ``torch.compile``)
    keeps across the frames it compiles: its options and cost model, and the cost model's
    memory estimate of every final graph, ``(graph_id, kind) -> MemoryEstimate`` (read by
    ``predict_step_peak`` and tests)."""

    options: Options
    cost: CostModel
    memory_estimates: dict[tuple[str, str], MemoryEstimate] = field(default_factory=dict)
    # hpZ: bytes of secondary shards each frame's forward saves for its backward (passes/secondary.py)
    secondary_bytes: dict[str, int] = field(default_factory=dict)
    # the final graphs, (graph_id, kind) -> GraphModule, when asked for (zerofx.plan reads them)
    graphs: dict[tuple[str, str], fx.GraphModule] | None = None
    # every frame this backend compiled, in order: graph_id -> the size symbols of its inputs
    # (empty: static shapes); its length is how many times this compile compiled
    size_symbols: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # the code name of zerofx.compile's entry (zerofx/api.py ``_enter``), which explain reuses
    entry_name: str | None = None
    # graph_id -> how many of its forward's outputs its caller gets (AOTAutograd's num_fwd_outputs)
    num_fwd_outputs: dict[str, int] = field(default_factory=dict)

    def frames(self) -> list[str]:
        """The graph ids of the frames with a backward, in the order they were compiled (run)."""
        ids = {g for g, kind in self.memory_estimates if kind == "backward"}
        return sorted(ids, key=lambda g: int(g.removeprefix("frame")))


class _FrameCompiler:
    """Compiles the graphs of one dynamo frame; AOTAutograd calls back into it."""

    def __init__(self, state: CompileState, recorder: Recorder | None):
        self.state = state
        self.options = state.options
        self.cost = state.cost
        self.recorder = recorder
        self.graph_id = f"frame{next(_frame_ids)}"
        self.execute = make_executor(self.options.codegen.executor)
        self.num_fwd_outputs: int | None = None
        self.borrowed_inputs: frozenset[str] = frozenset()  # the partition's (BORROWED_INPUTS)
        self.lockstep: Lockstep | None = None  # the per-graph check's group (zerofx/runtime/lockstep.py)
        self.forward_collectives: list[tuple] = []  # those of its forward (or inference) graph
        self.trains = False  # compiled with a backward (not an inference graph)

    def _context(self, kind: str) -> PassContext:
        agree = (lambda: _compiling_in_lockstep(self)) if self.lockstep is not None else None
        return PassContext(
            self.graph_id,
            kind,
            self.options,
            num_fwd_outputs=self.num_fwd_outputs,
            cost=self.cost,
            before_agreement=agree,
        )

    def _run(self, gm: fx.GraphModule, kind: str, ctx: PassContext | None = None) -> fx.GraphModule:
        ctx = ctx or self._context(kind)
        return run_pipeline(
            gm, ctx, disabled=self.options.disable_passes, verify=self.options.verify, observer=self.recorder
        )

    def _compile(self, gm: fx.GraphModule, example_inputs: Any, kind: str) -> Callable:
        ctx = self._context(kind)
        gm = self._run(gm, kind, ctx)
        if "transport" in self.options.disable_passes:
            _warn_if_out_of_place_gathers(gm)
        if kind == "backward":  # the aten executor frees a backward's saved inputs at their last use
            gm.meta[BORROWED_INPUTS] = self.borrowed_inputs  # ... except parameters and user data
        estimate = estimate_memory(gm, inputs_freed_at_last_use=(kind == "backward"))
        self.state.memory_estimates[(self.graph_id, kind)] = estimate
        if self.state.graphs is not None:
            self.state.graphs[(self.graph_id, kind)] = gm
        if self.recorder is not None:
            self.recorder.note(
                self.graph_id,
                kind,
                f"estimated peak {estimate.peak_bytes} B at {estimate.peak_node}; outputs {estimate.output_bytes} B",
            )
        run = instrument(self.execute(gm, example_inputs, ctx, self.recorder), gm, ctx)
        if self.lockstep is None:
            return run
        collectives = _collective_signature(gm)
        if kind != "backward":  # checked where the frame runs, with the parameters it is given
            self.forward_collectives, self.trains = collectives, kind == "forward"
            return run
        return _backward_in_lockstep(run, collectives, self) if collectives else run

    def partition(self, joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any):
        self.num_fwd_outputs = self.state.num_fwd_outputs[self.graph_id] = num_fwd_outputs
        joint = self._run(joint, "joint")
        plan = joint.meta.get(ACTIVATION_PLAN)
        cut = partition_by_plan(joint, num_fwd_outputs, kwargs.get("static_lifetime_input_indices"))
        if cut is None:
            cut = min_cut_rematerialization_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        fw, bw = cut
        # hpZ: the secondary shards cross the partition here, where no partitioner can move them
        secondary = split_secondary(fw, bw, num_fwd_outputs)
        if secondary:
            self.state.secondary_bytes[self.graph_id] = sum(b for _, b in secondary)
            if self.recorder is not None:
                self.recorder.note(
                    self.graph_id,
                    "forward",
                    f"secondary (hpZ): {len(secondary)} secondary shards saved for the backward's re-gather inside "
                    f"the inner dimension, {self.state.secondary_bytes[self.graph_id]} B "
                    f"({', '.join(name for name, _ in secondary)})",
                )
        saved = saved_values(fw, num_fwd_outputs)
        self.borrowed_inputs = borrowed_inputs(fw, saved, num_fwd_outputs)
        activation_bytes = saved_activation_bytes(fw, num_fwd_outputs)
        if self.recorder is not None:
            self.recorder.note(
                self.graph_id,
                "forward",
                f"saved for backward: {len(saved)} tensors, "
                f"{sum(tensor_bytes(n.meta.get('val')) for n in saved)} B ({', '.join(n.name for n in saved)})",
            )
            saved_names = {n.name for n in saved}
            predicted_bw = estimate_memory(bw, owned_inputs=saved_names)
            self.recorder.note(
                self.graph_id,
                "forward",
                f"activation memory (saved, not inputs): {format_bytes(activation_bytes)}; "
                f"predicted peak of forward temporaries {format_bytes(estimate_memory(fw).peak_bytes)}, "
                f"of backward above its saved inputs {format_bytes(predicted_bw.peak_bytes)} "
                f"(before the passes)",
            )
        if plan is not None:  # the plan never saw hpZ's secondary shards: compared without them
            extra = {name for name, _ in secondary}
            resident = self._check_plan(
                plan,
                [n for n in saved if n.name not in extra],
                activation_bytes - self.state.secondary_bytes.get(self.graph_id, 0),
            )
            if self.recorder is not None:
                self.recorder.plans[self.graph_id] = {**plan, "partitioned_resident_bytes": resident}
        if self.options.verify and "regather" not in self.options.disable_passes:
            check_no_gathered_saved(fw, num_fwd_outputs, self.graph_id)
        return fw, bw

    def _check_plan(self, plan: dict, saved: list[fx.Node], activation_bytes: int) -> int:
        """Note whether the partition saves what the checkpoint plan decided; returns the resident
        (not offloaded) saved-activation bytes of the partition."""
        planned = set(plan["saved"]) | set(plan["offloaded"])
        actual = {n.name for n in saved if isinstance(n.meta.get("val"), torch.Tensor)}  # sizes (SymInts) aside
        resident = activation_bytes - sum(node_bytes(n) for n in saved if n.name in plan["offloaded"])
        line = (
            f"checkpoint plan: resident {format_bytes(plan['resident_bytes'])} planned, "
            f"{format_bytes(resident)} partitioned"
        )
        if planned != actual:
            line += (
                f"; partition differs from plan (extra {sorted(actual - planned)[:8]}, "
                f"missing {sorted(planned - actual)[:8]})"
            )
            log.warning("zerofx %s: %s", self.graph_id, line)
        if self.recorder is not None:
            self.recorder.note(self.graph_id, "forward", line)
        return resident

    def forward(self, gm: fx.GraphModule, example_inputs: Any) -> Callable:
        return self._compile(gm, example_inputs, "forward")

    def backward(self, gm: fx.GraphModule, example_inputs: Any) -> Callable:
        if self.state.options.codegen.executor != "inductor":
            _no_donated_buffers()
        return self._compile(gm, example_inputs, "backward")

    def inference(self, gm: fx.GraphModule, example_inputs: Any) -> Callable:
        return self._compile(gm, example_inputs, "inference")


def _no_donated_buffers() -> None:
    """The backward being compiled reuses none of its saved tensors' memory in place ("donated
    buffers", which only Inductor's codegen does): tell AOT autograd so, and
    ``loss.backward(retain_graph=True)`` then works after the first step, as in eager DDP and
    FSDP2. AOT autograd refuses retained graphs for a backward compiled with donated buffers;
    it marks them by default, and this backward is compiled before any step knows whether a
    graph will be retained."""
    context = torch._guards.TracingContext.try_get()
    if context is not None and context.fw_metadata is not None:
        context.fw_metadata.bw_donated_idxs = []


def make_backend(
    options: Options | None = None, recorder: Recorder | None = None, *, cost: CostModel | None = None
) -> Callable:
    """A dynamo backend bound to ``options`` (and to ``recorder``, which ``explain`` uses), pricing
    its decisions with ``cost`` (default constants, or what ``calibrate`` measured). Options are
    checked against the pipeline here (pass names) and the offload folder is proven writable, so
    bad ones fail before anything is traced."""
    options = options or Options()
    options = dataclasses.replace(options, disable_passes=resolve_disabled(options.disable_passes))
    options = resolve_offload_dir(options)
    state = CompileState(options, cost or CostModel())

    def backend(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
        _refuse_parameters_added_after_sharding(gm, example_inputs)
        _refuse_reading_shards(gm, example_inputs)
        _refuse_writes_to_gathered(gm, example_inputs)
        frame = _FrameCompiler(state, recorder if recorder is not None else recorder_for(options))
        # the checks of every model the frame reads (groups is None where a shard's options
        # turned them off): a frame may read models sharded over different meshes
        runtimes = {id(s.runtime): s.runtime for s in map(_state_of, example_inputs) if s is not None}
        locksteps = [r.lockstep for r in runtimes.values() if r.lockstep is not None]
        if options.check_lockstep:
            frame.lockstep = merge_locksteps(locksteps)
        symbols = _size_symbols(example_inputs)
        if symbols:
            _note_symbolic_frame(frame, symbols)
        compile_with_aot = aot_autograd(
            fw_compiler=frame.forward,
            bw_compiler=frame.backward,
            inference_compiler=frame.inference,
            partition_fn=frame.partition,
            keep_inference_input_mutations=True,
        )
        try:
            compiled = compile_with_aot(gm, example_inputs)
        except RecursionError:
            if not symbols or not any(r.tp_mesh is not None for r in runtimes.values()):
                raise
            # torch 2.13: AOTAutograd's trace of a tensor-parallel HF model's backward with symbolic
            # sizes recurses without end (plain torch.compile(backend="aot_eager") of the same model too)
            raise ZeroFXError(
                "tracing this frame with symbolic sizes over tensor-parallel DTensors exceeded Python's recursion "
                "limit in AOTAutograd (torch's own compile of the same model fails the same way, e.g. an HF "
                "model whose sequence length changes): compile it with dynamic=False (a compile per shape) "
                "(docs/tensor_parallel.md, Limits)"
            ) from None
        # after it succeeded: dynamo may restart a frame's analysis and discard what it compiled
        state.size_symbols[frame.graph_id] = symbols
        return _frame_runner(compiled, example_inputs, frame)

    backend.zerofx_options = options  # type: ignore[attr-defined]
    backend.zerofx_state = state  # type: ignore[attr-defined]
    return backend


def _collective_signature(gm: fx.GraphModule) -> list[tuple]:
    """What must be the same on every rank about ``gm``'s collectives, in graph order: kind, mesh
    dimension (or group size: not the group's name, which differs between the data-parallel
    groups of a TP mesh) and wire dtype. Not the bytes: a tensor-parallel plan's collectives
    move activations, whose sizes may differ between data-parallel ranks (a sequence length per
    batch), and zerofx's own follow from the parameters, which the forward's digest names."""
    return [(what, mesh_dim_or_size(group), wire) for what, _, group, wire, _ in graph_collectives(gm)]


def _issues(collectives: list[tuple]) -> str:
    return ", ".join(f"{n} {what}" for what, n in Counter(what for what, *_ in collectives).items()) or "no collective"


def _compiling_in_lockstep(frame: _FrameCompiler) -> None:
    """A checkpoint plan is agreed across ranks while a stage-3 joint graph compiles (a
    collective: passes/checkpoint.py, NOTE: ranks agree). A rank compiling while its peers run
    graphs they compiled already (a guard failed on this rank only: torch specializes a size of 1
    even under dynamic=True, as on a last short batch of one sequence) would meet their
    collectives with its agreement's and wait out the process group's timeout. So right before
    the agreement (``PassContext.before_agreement``) it joins the lockstep check its peers run
    before every stage-3 graph: every rank compiling passes the same digest; otherwise every rank
    raises, naming what each was about to do. Compiles that agree on nothing (stages 1 and 2,
    inference graphs) do not take part."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._mode_utils import no_dispatch

    text = (
        f"compiling a new graph ({frame.graph_id}) whose checkpoint plan the ranks agree on, alone: one of "
        "the frame's guards failed on this rank only (torch specializes a size of 1, and sizes equal to "
        "each other, even under dynamic=True: a batch of one sequence, a square input); give every rank "
        "shapes of one kind, or train without an activation budget or checkpoint policy (the default "
        "plan is each rank's own)"
    )
    with no_dispatch(), unset_fake_temporarily(), torch._C._DisablePythonDispatcher():
        frame.lockstep.check(digest_of("compile", "checkpoint plan"), lambda: text)


def _backward_in_lockstep(run: Callable, collectives: list[tuple], frame: _FrameCompiler) -> Callable:
    """``run`` (a backward graph), first checking that every rank is about to issue the same
    collectives (zerofx/runtime/lockstep.py). The parameters are not part of it: a backward runs
    for a forward whose parameters were checked when it ran."""
    lockstep, digest = frame.lockstep, digest_of("backward", collectives)
    text = f"the backward graph of {frame.graph_id} ({_issues(collectives)})"

    def checked(args: list) -> object:
        lockstep.check(digest, lambda: text)
        return run(args)

    checked._boxed_call = True  # type: ignore[attr-defined]
    return checked


def _frame_runner(compiled: Callable, example_inputs: list[Any], frame: _FrameCompiler) -> Callable:
    """``compiled`` (one frame), first refusing to run

    - while a stage-1/2 model whose parameters it reads has whole copies older than their
      shards (NOTE: stale whole copies, zerofx/runtime/params.py). Here rather than at
      ``zerofx.compile``'s entry, so that the two-step pairing (``zerofx.shard``, then
      ``torch.compile(model, backend="zerofx")``) is checked too. The runtimes are held weakly:
      dynamo's cache outlives the model;
    - unless every rank is about to run a forward with the same collectives over the same
      parameters (zerofx/runtime/lockstep.py). The parameters are the ones this call is given:
      dynamo passes them as inputs, so one compiled frame runs every module of its shape (the
      ``Linear.forward`` of every expert when the caller's frame is not compiled);

    and, for a frame that trains, a backward that reaches its outputs with a DTensor gradient
    (``_refuse_dtensor_gradient``).
    """
    runtimes = {}
    for x in example_inputs:
        state = _state_of(x)
        if state is not None and state.full is not None:
            runtimes[id(state.runtime)] = weakref.ref(state.runtime)
    refs = list(runtimes.values())
    collectives, lockstep, graph_id = frame.forward_collectives, frame.lockstep, frame.graph_id
    positions = [i for i, x in enumerate(example_inputs) if getattr(x, "_zerofx_state", None) is not None]
    # checked when the forward communicates, or its backward may: stage 2 reads whole copies in
    # forward and reduce-scatters in backward, whose digest cannot name the parameters. Not an
    # inference graph that communicates nothing (stage 2 evaluated on rank 0 alone must not wait)
    checked = lockstep is not None and (
        bool(collectives)
        or (frame.trains and any(example_inputs[i]._zerofx_state.runtime.stage != 1 for i in positions))
    )
    trains = frame.trains
    if not refs and not checked and not trains:
        return compiled
    digests: dict[tuple[str, ...], int] = {}  # the parameters' names -> the digest to compare

    def run(*args: Any, **kwargs: Any) -> Any:  # dynamo calls a frame's compiled graph with its inputs
        for ref in refs:
            runtime = ref()
            if runtime is not None:
                runtime.check_whole_copies()
        if checked:
            reads = tuple(_qualname(args[i]) for i in positions)
            digest = digests.get(reads)
            if digest is None:
                digest = digests[reads] = digest_of("forward", collectives, reads)
            lockstep.check(digest, lambda: _describe_forward(graph_id, collectives, reads))
        outputs = compiled(*args, **kwargs)
        if trains and torch.is_grad_enabled() and isinstance(outputs, (list, tuple)):
            for out in outputs:  # (a DTensor output, tensor parallelism's, was traced with a DTensor gradient)
                if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) and out.grad_fn is not None:
                    out.register_hook(_refuse_dtensor_gradient)
        return outputs

    return run


def _refuse_dtensor_gradient(grad: torch.Tensor) -> None:
    """Gradient hook of a training frame's plain-tensor outputs. A loss that adds to the model's
    output a term computed from ``model.parameters()`` outside forward (an L2 penalty: those are
    this rank's DTensor shards) is a DTensor, and so is the gradient it sends into the compiled
    frame, where AOTAutograd, which traced a plain gradient, fails with an internal error."""
    if isinstance(grad, DTensor):
        raise ZeroFXError(
            "the loss's gradient reaches the zerofx-compiled forward as a DTensor: the loss combines the model's "
            "output with a term computed from DTensor values outside forward (e.g. a penalty over "
            "model.parameters(), which are this rank's shards). Compute that term inside forward, or from whole "
            "values: p.full_tensor(), or the parameters read through their modules (model.fc.weight)"
        )


def _state_of(x: Any) -> Any:
    """The ParamState a graph input belongs to: a parameter's shard (``_zerofx_state``: the
    DTensor, or the plain tensor over its shard), its whole copy or its gradient sink
    (``_zerofx_part_of``, zerofx/sharding.py); None for anything else."""
    if not isinstance(x, torch.Tensor):
        return None
    return getattr(x, "_zerofx_state", None) or getattr(x, "_zerofx_part_of", None)


def _qualname(x: Any) -> str:
    state = getattr(x, "_zerofx_state", None)
    return state.qualname if state is not None else "?"


def _describe_forward(graph_id: str, collectives: list[tuple], reads: tuple[str, ...]) -> str:
    reading = f"reading {some_names(list(reads))}" if reads else "reading no sharded parameter"
    return f"the forward graph of {graph_id} ({_issues(collectives)}), {reading}"


def _graph_inputs(gm: fx.GraphModule, example_inputs: list[Any]) -> list[tuple[fx.Node, Any]]:
    """The frame's placeholders, each with the input dynamo gives it."""
    return list(zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs))


def _refuse_parameters_added_after_sharding(gm: fx.GraphModule, example_inputs: list[Any]) -> None:
    """Refuse a frame of a sharded model that trains parameters zerofx has never seen (a module
    added after ``zerofx.shard`` / ``zerofx.compile``: LoRA adapters, a new head). Nothing
    would synchronize their gradients, so each rank would train its own copy and the ranks
    drift apart without a word. Checked once per compiled frame (adding a module makes dynamo
    recompile), so a training step pays nothing."""
    unknown = [
        (_source_name(node), x)
        for node, x in _graph_inputs(gm, example_inputs)
        if isinstance(x, torch.nn.Parameter) and x.requires_grad and _state_of(x) is None
    ]
    replaced = [(name, getattr(x, REPLACED_BY)) for name, x in unknown if hasattr(x, REPLACED_BY)]
    if replaced:  # the model's own parameter as it was before shard, through a reference kept elsewhere
        raise read_after_sharding(replaced)
    sharded = [s for s in map(_state_of, example_inputs) if s is not None]
    if not sharded or all(s.shard_group.size == 1 and s.replicate_group is None for s in sharded):
        return
    if unknown:
        raise added_after_sharding([name for name, _ in unknown])


def _refuse_reading_shards(gm: fx.GraphModule, example_inputs: list[Any]) -> None:
    """Refuse a frame that computes with a sharded parameter itself, not through its module's
    attribute: ``self.parameters()`` / ``named_parameters()`` inside forward (an L2 penalty)
    give this rank's shard, a DTensor, and mixing it with the activations failed in AOT
    autograd with torch's "got mixed torch.Tensor and DTensor". ``module.weight`` is the
    whole value, through the markers (zerofx/sharding.py), which is what such code means.
    Checked under ``plain_graph_inputs`` (the default), where the markers read each shard as a
    plain tensor and nothing else in a frame reads the DTensor."""
    direct = [
        _qualname(x)
        for node, x in _graph_inputs(gm, example_inputs)
        if any(_holds_dtensor(u.meta.get("example_value")) for u in node.users)  # (x.to(p): a template)
        and isinstance(x, torch.nn.Parameter)
        and isinstance(x, DTensor)
        and getattr(x, "_zerofx_state", None) is not None
        and x._zerofx_state.tp is None  # (a tensor-parallel one enters its frame as the DTensor it is)
        and x._zerofx_state.runtime.options.plain_graph_inputs  # (else the markers read the DTensor)
    ]
    if direct:
        raise ZeroFXError(
            f"{some_names(direct)}: the compiled code computes with the sharded parameter itself (this rank's "
            "shard, a DTensor), as model.parameters() / named_parameters() give it, e.g. for a weight penalty "
            "inside forward. Read parameters through their modules, which give the whole value: "
            "[getattr(m, n) for m in self.modules() for n, _ in m.named_parameters(recurse=False)] "
            "(or use the optimizer's weight_decay)"
        )


def _holds_dtensor(value: Any) -> bool:
    """Whether a node's value is (or holds) a DTensor: what computing with a shard gives."""
    if isinstance(value, (tuple, list)):
        return any(_holds_dtensor(v) for v in value)
    return isinstance(value, DTensor)


def _refuse_writes_to_gathered(gm: fx.GraphModule, example_inputs: list[Any]) -> None:
    """Refuse a frame that changes a gathered parameter in place (``self.w.clamp_(-c, c)`` under
    no_grad, WGAN's weight clipping; ``self.w.div_(norm)``). ``module.weight`` inside a compiled
    forward is the value of a forward marker, a whole copy made for that read: the change reached
    neither the parameter nor the next read of it, and the run went on without it. A marker's
    output starts at version 0 (custom ops return new tensors), so any in-place op on it or on a
    view of it while dynamo traced shows in its fake value's version counter. (Uncompiled, the
    same write is refused by the gathered copy, zerofx/sharding.py.)"""
    reads = dict(_graph_inputs(gm, example_inputs))
    # the frame's graph and those of the regions dynamo captured as subgraphs (torch.utils.checkpoint)
    graphs = [m for m in gm.modules() if isinstance(m, fx.GraphModule)]
    nodes = [n for m in graphs for n in m.graph.nodes]
    # a subgraph's placeholders are the operands its call passes (``hop(get_attr, *operands)``)
    operand_of = {}
    for m in graphs:
        for call in m.graph.nodes:
            first = call.args[0] if call.op == "call_function" and call.args else None
            if isinstance(first, fx.Node) and first.op == "get_attr":
                sub = getattr(m, first.target, None)
                if isinstance(sub, fx.GraphModule):
                    inner = [n for n in sub.graph.nodes if n.op == "placeholder"]
                    operand_of.update(zip(inner, call.args[1:]))
    for node in nodes:
        # dynamo records the op's packet (torch.ops.zerofx.unshard), AOT autograd its overload
        if node.op != "call_function" or getattr(node.target, "default", node.target) not in FORWARD_MARKERS:
            continue
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor) or value._version == 0:
            continue
        source = node.args[0]
        while isinstance(source, fx.Node) and (source.op != "placeholder" or source in operand_of):
            source = operand_of[source] if source.op == "placeholder" else (source.args or [None])[0]
        state = _state_of(reads.get(source)) if isinstance(source, fx.Node) else None
        name = state.qualname if state is not None else "a sharded parameter"
        if any(_renorms(u) for u in node.users):
            raise ZeroFXError(
                f"{name}: an embedding with max_norm renormalizes the rows it looks up in the weight itself, "
                "in place; inside a compiled forward the weight is a whole copy gathered for that read, so "
                "the renormalized rows would not reach the parameter as they do in eager PyTorch. Drop max_norm, "
                "or renormalize the rows yourself between steps"
            )
        raise ZeroFXError(
            f"{name}: the compiled forward changes the parameter in place (an in-place op such as clamp_, mul_ or "
            "copy_ on module.weight, or an assignment into it), but module.weight there is a whole copy gathered "
            "for that read: the change would reach neither the parameter nor its next read. Change the parameter "
            f"itself, outside the compiled forward: dict(model.named_parameters())[{name!r}] is a DTensor of this "
            "rank's rows, and its in-place ops change every rank's rows (at stages 1 and 2, then renew the whole "
            "copies: zerofx.sharding.runtime_of(model).refresh())"
        )


def _renorms(node: fx.Node) -> bool:
    """Whether ``node`` is an embedding lookup with ``max_norm`` (it renormalizes the weight's rows
    in place: ``embedding_renorm_``)."""
    if node.op != "call_function" or node.target is not torch.nn.functional.embedding:
        return False
    max_norm = node.kwargs.get("max_norm", node.args[3] if len(node.args) > 3 else None)
    return max_norm is not None


def _source_name(node: fx.Node) -> str:
    """Where dynamo read a graph input from, as a module path (``adapter.weight``), else the
    placeholder's name."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    return module_path(source.name) if source is not None else node.name


def _size_symbols(example_inputs: list[Any]) -> tuple[str, ...]:
    """The size symbols of a frame's inputs, sorted by name (none: every shape is static)."""
    found: set[str] = set()
    for x in example_inputs:
        sizes = list(x.shape) if isinstance(x, torch.Tensor) else [x]
        for size in sizes:
            if isinstance(size, torch.SymInt):
                found.update(str(s) for s in size.node.expr.free_symbols)
    return tuple(sorted(found, key=lambda name: (len(name), name)))


_WARNED: set[str] = set()  # the once-per-process warnings already given, by key


def _warn_once(key: str, message: str) -> None:
    """``warnings.warn(message)`` the first time ``key`` is warned about in this process."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def _note_symbolic_frame(frame: _FrameCompiler, symbols: tuple[str, ...]) -> None:
    """Say in the dump which sizes this frame traced as symbols; and warn (once per process)
    where a checkpoint plan will be agreed across ranks at a recompile torch's automatic dynamic
    shapes started: that agreement is a collective at compile time, so it only matches if every
    rank recompiles at this step (ranks seeing different shapes: use ``dynamic=True``; see
    docs/architecture.md, Dynamic shapes)."""
    import torch.distributed as dist

    if frame.recorder is not None:
        frame.recorder.note(frame.graph_id, "forward", f"dynamic sizes: {', '.join(symbols)}")
    multi_rank = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    options = frame.options
    if options.codegen.dynamic == "auto" and wants_plan(options.memory) and multi_rank:
        _warn_once(
            "plan_recompile",
            f"zerofx: compiling with dynamic sizes ({', '.join(symbols)}) under dynamic='auto' (a recompile after "
            "a shape changed, or torch._dynamo.mark_dynamic) while a checkpoint plan is agreed across ranks at "
            "compile time (a collective): every rank must compile at this same step. If ranks see different "
            "shapes, pass dynamic=True to zerofx.compile (every rank compiles once, at the first step).",
        )


def zerofx_backend(
    gm: fx.GraphModule, example_inputs: list[torch.Tensor], options: Any = None, **kwargs: Any
) -> Callable:
    """Entry point for ``torch.compile(model, backend="zerofx", options={...})``.

    Layout options (``zerofx.options.LAYOUT_OPTIONS``: stage, dtypes, ...) are rejected here: the
    backend only sees graphs, and the layout was fixed when the model was sharded."""
    mode = kwargs.pop("mode", None)
    if mode not in (None, "default"):
        raise ZeroFXError(
            f"torch.compile(mode={mode!r}) picks one of inductor's presets (autotuning, CUDA graphs), which the "
            "zerofx backend does not run: leave mode out and pass zerofx's options=... instead (with "
            "executor='triton' on a GPU, options={'executor': 'triton', 'autotune': True} times Triton's block sizes)"
        )
    opts = Options.from_kwargs(options, **kwargs)
    layout = opts.non_default_layout()
    if layout:
        raise ZeroFXError(
            f"option {layout[0]} is decided when parameters are sharded, not by the backend: pass it to "
            f"zerofx.shard(model, mesh, {layout[0]}=...) before torch.compile(..., backend='zerofx'), "
            "or use zerofx.compile(model, mesh, **options)"
        )
    if opts.codegen.dynamic != "auto":
        raise ZeroFXError(
            f"option dynamic={opts.codegen.dynamic!r} decides how dynamo captures graphs, before any backend "
            f"runs: pass it to torch.compile(..., dynamic={opts.codegen.dynamic!r}) instead"
        )
    _warn_if_unsharded(gm, example_inputs)
    return make_backend(opts)(gm, example_inputs)


def _warn_if_unsharded(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> None:
    """One warning per process when ``torch.compile(backend="zerofx")`` compiles trainable
    parameters that ``zerofx.shard`` never touched, in a job of more than one rank: nothing in
    such a graph synchronizes gradients, so every rank would train its own replica."""
    import torch.distributed as dist

    if "unsharded" in _WARNED or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    trainable = any(isinstance(x, torch.nn.Parameter) and x.requires_grad for x in example_inputs)
    marked = any(str(n.target).startswith("zerofx.") for n in gm.graph.nodes if n.op == "call_function")
    if trainable and not marked:
        _warn_once(
            "unsharded",
            f"torch.compile(backend='zerofx') is compiling trainable parameters that zerofx has not sharded, "
            f"in a job of {dist.get_world_size()} ranks: their gradients are not synchronized, so each rank "
            "trains alone. Call zerofx.shard(model, mesh) before torch.compile, or use zerofx.compile(model, mesh).",
        )


def _warn_if_out_of_place_gathers(gm: fx.GraphModule) -> None:
    """One warning per process when a graph compiled with the transport pass disabled keeps
    torch's out-of-place all-gather on a gloo group: two of those in flight corrupt the heap
    (zerofx/ir/collectives.py, NOTE: gloo all-gathers in flight), so the run may abort or
    compute on corrupted memory."""
    if "gathers" in _WARNED:
        return
    groups = {n.args[COLLECTIVE_OPS[ALL_GATHER].group_name_arg] for n in gm.graph.nodes if n.target is ALL_GATHER}
    if any(backend_of(group) == "gloo" for group in groups):
        _warn_once(
            "gathers",
            "zerofx: disable_passes includes 'transport', so this graph keeps torch's out-of-place "
            "all-gather on a gloo group; two of them in flight corrupt the process's heap (a torch bug, "
            "see zerofx/ir/collectives.py). Disable transport for debugging only.",
        )
