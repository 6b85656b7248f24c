"""Per-parameter runtime state: which markers a parameter's forward goes through, and the few
things that happen outside any graph (the accumulation-boundary reduce, the post-step refresh).

``zerofx.sharding`` builds one :class:`ParamState` per unique parameter and one
:class:`ModelRuntime` per model; a sharded module's parameter property returns
``state.forward_value(param)``, which dynamo traces like any Python code (the stage, the sync
mode and "gradients pending" are plain attributes it guards on, so each mode is its own
compiled graph, compiled once).

# NOTE: markers per stage
One pipeline, one set of markers (``zerofx.ir.markers``); a stage is a choice of markers per parameter::

    stage 3       unshard(shard)           gather in forward (and backward); reduce-scatter grads
    stage 2       read_full(shard, full)   forward reads the whole copy; reduce-scatter grads
    stage 1       local_grad(full, sink)   forward reads the whole copy; gradients accumulate whole
                                           and unreduced, one reduce-scatter at the boundary
    small param   sync_grad(x)             (stage 3, below persistence_threshold) whole; all-reduce
    no_sync       local_grad(value, sink)  any stage: accumulate whole, reduce at the boundary
    2-D mesh      sync_grad(shard, replicate group) wraps the shard: all-reduce across replicas
    hpZ (2-D)     unshard(shard, ..., inner group): sharded over the whole mesh, the marker names
                  the inner dimension for the backward's re-gather (zerofx/sharding.py, NOTE: hpZ)

In every stage the optimizer's parameters are the same ``Shard(0)`` DTensors, so optimizer
state is 1/N and ``state_dict()`` is the same in every stage (a checkpoint from one stage
loads in another). Stages 1 and 2 add ``full``, a whole copy of each parameter in the compute
dtype that forward reads without communication; an optimizer step post-hook all-gathers the
updated shards into it (the second Ψ of ZeRO-1/2's 2Ψ traffic). Without mixed precision the
shard *is* a view of its rows of ``full``, so the copy costs nothing extra.

# NOTE: stale whole copies
``full`` is refreshed after every optimizer step and ``load_state_dict``. Anything else that
writes a shard in place (``p.mul_(...)`` on a parameter from ``model.named_parameters()``,
``torch.distributed.checkpoint.load`` into ``model.state_dict()``'s tensors, weight clipping)
would leave forward reading the old values, each rank's forward a different mix of them.

Every refresh records the shard's version counters (``mark_synced``). Every compiled frame
that reads a whole copy (the backend wraps it: zerofx/backend.py, ``_frame_runner``;
so ``zerofx.compile`` and the two-step pairing ``zerofx.shard`` + ``torch.compile(model,
backend="zerofx")`` alike), a forward pre-hook for uncompiled forwards (dynamo traces it, and
the check is skipped while tracing), and ``zerofx.gathered`` compare them
(``check_whole_copies``, a few attribute reads per parameter) and raise, naming the
parameters. ``state_dict()`` hands out DTensors over the shard itself (zerofx/sharding.py,
``_save_aliasing_shards``) so that DCP's writes into them count.

DTensor's ``_foreach_*_`` in-place ops bump no version counter at all (torch 2.13; open upstream
as pytorch/pytorch#191154 and #197502, which make foreach ops on tensor subclasses bump them),
and ``AveragedModel``'s EMA / SWA update is one. Its copy runs uncompiled (torch deep-copies a
module without its compiled call), so an uncompiled forward also compares each shard's
``torch.hash_tensor`` with the one taken at the last refresh (from its first uncompiled forward
on: one pass over this rank's shards, no communication). A compiled forward keeps to the
counters: hashing every step would cost the training loop a pass over the shards, which the
optimizer writes and its step refreshes.

Not covered: eager ``module.weight`` reads, which torch's state-dict utilities make between an
in-place load and the ``load_state_dict`` that refreshes.

The checks never refresh by themselves: a refresh is a collective, and a rank that saw a change
its peers did not make (a write to one rank's local shard) would issue an all-gather the others
never match.

# NOTE: the accumulation boundary
``local_grad`` keeps gradients out of the graph's collectives: autograd accumulates each
micro-batch's whole, unreduced gradient in ``sink.grad`` (the reduce dtype). At the end of the
first backward that runs outside ``zerofx.no_sync`` (an autograd end-of-backward callback),
:meth:`ModelRuntime.reduce_pending` reduces every pending sum once — reduce-scatter into the
shard's gradient, in flat buckets (zerofx/runtime/eager_buckets.py), plus all-reduce across replicas on a 2-D
mesh, or all-reduce for whole parameters. Once anything is pending, later micro-batches take the local route too, so a whole
accumulation cycle costs exactly one reduction per parameter. This is ZeRO-1 by construction
(DeepSpeed's stage 1 also reduces at the boundary) and gradient accumulation for every stage.
The boundary reduce is issued in the same parameter order on every rank; as with DDP, every
rank must have produced gradients for the same parameters.

# NOTE: plain graph inputs
The optimizer, DCP and clipping see DTensor parameters, but a graph needs only the local shard.
Handed the DTensors, every compiled call pays per parameter: dynamo guards each DTensor's
placements and mesh in Python, AOTAutograd unwraps each one and wraps each gradient back into
a DTensor (``__tensor_unflatten__``), and the forward graph carries a view per parameter for
the unwrapping (docs/measurements.md, "step time: what grows with the number of parameters").
So ``forward_value`` reads ``leaf`` instead of ``param.to_local()``: a plain tensor over the
same storage (``detach()``: it shares the version counter too), a leaf that requires grad. The
graphs see plain tensors, their guards are tensor guards, and autograd accumulates the shard's
gradient into ``leaf.grad`` in C++. A post-accumulate-grad hook then moves it into
``param.grad``, a DTensor over the same buffer (no copy), or adds it to the gradient there; on
the way it runs the parameter's own ``register_hook`` hooks on the DTensor gradient and, after,
its post-accumulate-grad hooks, so hooks users put on parameters see what they would have.
A parameter frozen after sharding reads ``leaf.detach()``. What differs: the parameter itself
is no longer in the autograd graph (as at stage 1 and under ``no_sync``, and as with FSDP2's
sharded parameters): ``torch.autograd.grad(loss, model.parameters())`` raises (with
``allow_unused=True`` it returns None), ``loss.backward(inputs=model.parameters())`` gives them
no gradient, and hooks on a parameter's own AccumulateGrad node never run (an optimizer stepping
in backward through ``_apply_optimizer_in_backward`` is refused here, by name). Not for
tensor-parallel parameters, whose forward is DTensor code. ``plain_graph_inputs=False`` hands
the graphs the DTensors.
"""

from __future__ import annotations

import functools
import operator
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from zerofx.errors import ZeroFXError, some_names
from zerofx.ir.layout import local_rows, row_offset, rows_back, rows_first
from zerofx.runtime import eager_buckets
from zerofx.runtime.lockstep import digest_of

__all__ = ["GroupInfo", "ParamState", "ModelRuntime", "TensorParallel"]


@dataclass(frozen=True)
class GroupInfo:
    """A process group as the markers name it, plus this rank's index in it."""

    size: int
    name: str
    rank: int


@dataclass(frozen=True)
class TensorParallel:
    """How a tensor-parallel parameter (a DTensor on the TP mesh, e.g. from
    ``parallelize_module``) was laid out before zerofx sharded it over the data-parallel
    dimension: forward rebuilds that DTensor from the gathered TP-local value (NOTE: ZeRO with
    tensor parallelism, zerofx/sharding.py)."""

    mesh: Any  # the TP DeviceMesh
    placements: tuple  # the parameter's placements on it
    shape: torch.Size  # the global shape
    stride: tuple[int, ...]  # the global stride


@dataclass(eq=False)
class ParamState:
    """What zerofx knows about one (unique) parameter; see NOTE: markers per stage."""

    qualname: str
    param: torch.nn.Parameter  # the DTensor the optimizer steps: Shard(0), or Replicate() if whole
    whole: bool  # kept whole on every rank (persistence threshold)
    shard_group: GroupInfo  # the dimension parameters are sharded over
    replicate_group: GroupInfo | None  # outer dimension of a 2-D (hybrid) mesh
    full_rows: int
    runtime: ModelRuntime
    sink: torch.Tensor  # full-shape stride-0 leaf (every parameter, frozen too); .grad holds pending local gradients
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    full: torch.Tensor | None = None  # stages 1 and 2: whole copy in the compute dtype
    # hpZ (secondary_shard): the inner mesh dimension whose secondary shard the backward re-gathers
    secondary_group: GroupInfo | None = None
    # ZeRO over a TP model: the parameter's tensor-parallel layout (its "full" value is TP-local)
    tp: TensorParallel | None = None
    # stages 1 and 2: the version counters of the parameter and of its local shard when ``full``
    # was last refreshed from them (NOTE: stale whole copies)
    synced_version: tuple[int, int] = (-1, -1)
    synced_hash: int | None = None  # the shard's torch.hash_tensor then, once uncompiled forwards check it
    leaf: torch.Tensor | None = None  # the graph's plain input for the shard (NOTE: plain graph inputs)
    # the dim the parameter is split along; ``full_rows`` is its size (NOTE: the sharded dim)
    shard_dim: int = 0

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (parameter-shaped: whole, or this rank's shard) with the sharded dim first."""
        return rows_first(t, self.shard_dim)

    def unrows(self, t: torch.Tensor) -> torch.Tensor:
        """``rows``' inverse."""
        return rows_back(t, self.shard_dim)

    def make_leaf(self) -> None:
        """(Re)build ``leaf`` over the parameter's local shard as it is now: after sharding, and
        wherever the shard's storage is re-pointed (disk offload's ``set_``, a deep copy)."""
        leaf = self.param._local_tensor.detach().requires_grad_()
        leaf._zerofx_state = self
        leaf.register_post_accumulate_grad_hook(weak_hook(self._land_leaf_grad))
        self.leaf = leaf

    def _land_leaf_grad(self, leaf: torch.Tensor) -> None:
        """Post-accumulate-grad hook of ``leaf``: move its gradient into the parameter's, as
        autograd would have accumulated it into the DTensor (NOTE: plain graph inputs)."""
        local, leaf.grad = leaf.grad, None
        if local is None:
            return
        param = self.param
        if "_in_backward_optimizers" in param.__dict__:
            raise ZeroFXError(
                f"{self.qualname}: an optimizer stepping in backward (torch.distributed.optim."
                "_apply_optimizer_in_backward) hooks the parameter's own AccumulateGrad, which the graphs "
                "do not reach: they read the shard as a plain tensor (NOTE: plain graph inputs). Pass "
                "plain_graph_inputs=False to zerofx.compile / zerofx.shard, or step the optimizer after backward"
            )
        if local.requires_grad:  # backward(create_graph=True): the gradient stays differentiable
            spec = dict(run_check=False, shape=param.shape, stride=param.stride())
            grad = DTensor.from_local(local, param.device_mesh, param.placements, **spec)
        else:
            grad = DTensor(local, param._spec, requires_grad=False)
        grad = self._before_accumulating(grad)
        if param.grad is None:
            param.grad = grad
        elif grad.requires_grad or param.grad.requires_grad:
            param.grad = param.grad + grad  # out of place, as autograd accumulates a graph
        else:
            param.grad._local_tensor.add_(grad._local_tensor)
        self._after_accumulating()

    def _before_accumulating(self, grad: torch.Tensor) -> torch.Tensor:
        """The parameter's ``Tensor.register_hook`` hooks, on the gradient before it accumulates
        (each may return a replacement)."""
        for hook in list(self.param._backward_hooks.values()) if self.param._backward_hooks else ():
            out = hook(grad)
            grad = grad if out is None else out
        return grad

    def _after_accumulating(self) -> None:
        """The parameter's ``register_post_accumulate_grad_hook`` hooks."""
        for hook in (
            list(self.param._post_accumulate_grad_hooks.values()) if self.param._post_accumulate_grad_hooks else ()
        ):
            hook(self.param)

    def mark_synced(self) -> None:
        """Record that ``full`` holds the shard's current values."""
        self.synced_version = self.versions()
        if self.runtime.hash_checked:
            self.synced_hash = self.shard_hash()

    def shard_hash(self) -> int:
        local = self.param._local_tensor
        return torch.hash_tensor(local).item() if local.numel() else 0

    def versions(self) -> tuple[int, int]:
        """The parameter's and its local shard's version counters: DTensor's in-place ops (also
        through a ``detach()``ed alias, as ``state_dict()`` returns) bump the first only, writes
        to ``to_local()`` the second only."""
        return self.param._version, self.param._local_tensor._version

    @property
    def row_numel(self) -> int:
        """Elements in one row along the sharded dim (NOTE: the sharded dim), of the value the
        data-parallel dimension shards: the parameter's, or a tensor-parallel one's TP share
        (whose shape ``sink`` has, not the global one ``param`` has)."""
        return self.sink.numel() // max(self.full_rows, 1)

    @property
    def layout(self) -> str:
        """``name [shape]: Shard(k)``, as explain and the plan name a parameter's split."""
        return f"{self.qualname} {list(self.param.shape)}: Shard({self.shard_dim})"

    @property
    def shard_rows(self) -> int:
        return local_rows(self.full_rows, self.shard_group.size, self.shard_group.rank)

    @property
    def first_row(self) -> int:
        return row_offset(self.full_rows, self.shard_group.size, self.shard_group.rank)

    def check_uncompiled_read(self) -> None:
        """Before an uncompiled read (``zerofx.shard`` without compile, an ``AveragedModel``'s
        copy): every rank must read this parameter now, as every rank must run the same compiled
        graph (zerofx/runtime/lockstep.py), or each rank's gather pairs with another parameter's.
        Only reads that communicate are checked (``_communicates``)."""
        run = self.runtime
        if run.lockstep is None or run.lockstep.groups is None or run.gathered is not None:
            return
        if not self._communicates():  # a read on some ranks only (logging a norm) must not wait
            return
        run.lockstep.check(self.read_digest, lambda: f"an uncompiled read of {self.qualname}")

    def check_uncompiled_reduction(self, value: torch.Tensor) -> None:
        """After an uncompiled read whose backward reduces (``value``: what the read returned):
        the gradient's reduction is checked like the read, when the gradient reaches ``value``
        (a hook, so before the marker's backward issues its collective). A rank that did not read
        this parameter in forward (a data-dependent branch) otherwise met its peers' check of the
        read with its backward's reduce-scatter: gloo aborted on the mismatch, NCCL would wait."""
        run = self.runtime
        if run.lockstep is None or run.lockstep.groups is None or run.gathered is not None:
            return
        if not value.requires_grad or self._reads_locally(self.param):  # its backward reduces nothing now
            return
        lockstep, digest, qualname = run.lockstep, self.reduction_digest, self.qualname

        def check(grad: torch.Tensor) -> None:
            lockstep.check(digest, lambda: f"the uncompiled backward's reduction of {qualname}")

        value.register_hook(check)

    @functools.cached_property
    def read_digest(self) -> int:
        """What an uncompiled read compares across ranks (``check_uncompiled_read``)."""
        return digest_of("uncompiled read", self.qualname)

    @functools.cached_property
    def reduction_digest(self) -> int:
        """What an uncompiled backward's reduction compares (``check_uncompiled_reduction``)."""
        return digest_of("uncompiled reduction", self.qualname)

    def _reads_locally(self, param: torch.nn.Parameter) -> bool:
        """Whether a read takes the ``local_grad`` route (stage 1, no_sync, pending gradients)."""
        run = self.runtime
        return param.requires_grad and (run.stage == 1 or not run.sync or run.pending)

    def _communicates(self) -> bool:
        """Whether a read now issues a collective, in forward (stage 3's gather) or in the
        backward of a value that needs a gradient (what ``_data_parallel_value`` chooses)."""
        if self.full is None and not self.whole:
            return True  # unshard: a gather in forward
        local = self._reads_locally(self.param)  # local_grad of a whole value: none
        return not local and self.param.requires_grad and torch.is_grad_enabled()  # read_full / sync_grad

    def forward_value(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The whole parameter for forward, through the markers of this stage and mode (for a
        tensor-parallel parameter: its TP-local value, as the DTensor the TP plan made)."""
        value = self._data_parallel_value(param)
        if self.tp is None:
            return value
        tp = self.tp
        return DTensor.from_local(value, tp.mesh, tp.placements, run_check=False, shape=tp.shape, stride=tp.stride)

    def _data_parallel_value(self, param: torch.nn.Parameter) -> torch.Tensor:
        if self.shard_dim and self.runtime.gathered is None:  # the markers split rows (NOTE: the sharded dim)
            return self.unrows(self._rows_value(param)).contiguous()
        return self._rows_value(param)

    def _rows_value(self, param: torch.nn.Parameter) -> torch.Tensor:
        if self.runtime.gathered is not None:  # inside zerofx.gathered(model): no communication
            if param.requires_grad and torch.is_grad_enabled():
                raise ZeroFXError(
                    f"{self.qualname}: zerofx.gathered(model) is for inference (generate, evaluation): "
                    "the whole parameters it holds are not connected to the shards' gradients. "
                    "Run the forward under torch.no_grad() / torch.inference_mode(), or outside the context to train"
                )
            at = (self.runtime.gathered_versions or {}).get(self)
            if at is not None and self.versions() != at:
                raise ZeroFXError(
                    f"{self.qualname}: the parameter changed inside zerofx.gathered(model) (an optimizer step or a "
                    "load_state_dict since the context gathered it), and the whole copy the forward reads there "
                    "holds its old values: exit the context and enter it again to gather the new ones"
                )
            return self.runtime.gathered[self]
        if param is not self.param:
            raise ZeroFXError(
                f"{self.qualname}: the module holds another tensor than the parameter zerofx sharded (replaced "
                "after zerofx.shard / zerofx.compile, e.g. `module.weight = nn.Parameter(...)`), while the optimizer, "
                "gradients and checkpoints follow the sharded one. Load new values with model.load_state_dict(...), "
                "or replace the parameter before sharding. (A copy.deepcopy that reached the parameters before their "
                "module, e.g. of {'params': list(model.parameters()), 'model': model}, copies one of them twice: "
                "deep-copy the model on its own.)"
            )
        ops = torch.ops.zerofx
        leaf = self.leaf  # NOTE: plain graph inputs
        local = param.to_local() if leaf is None else leaf if param.requires_grad else leaf.detach()
        # the markers' layout arguments are static (NOTE: static layouts in a frame of their own)
        local = self._static_shape(self.rows(local))
        rows, sg, rg = operator.index(self.full_rows), self.shard_group, self.replicate_group
        size = operator.index(sg.size)
        rdt, cdt = self.reduce_dtype, self.compute_dtype
        if self._reads_locally(param):
            if self.full is not None:
                value = self._static_shape(self.rows(self.full))
            elif self.whole:
                value = local if cdt is None else local.to(cdt)
            else:
                value = self._unshard(local.detach(), rows, cdt, rdt)
            return ops.local_grad(value, self._static_shape(self.rows(self.sink)))
        if rg is not None:
            local = ops.sync_grad(local, operator.index(rg.size), rg.name, None, rdt)
        if self.whole:
            return ops.sync_grad(local, size, sg.name, cdt, rdt)
        if self.full is not None:
            return ops.read_full(local, self._static_shape(self.rows(self.full)), size, sg.name, rdt)
        return self._unshard(local, rows, cdt, rdt)

    def _unshard(
        self, local: torch.Tensor, rows: int, cdt: torch.dtype | None, rdt: torch.dtype | None
    ) -> torch.Tensor:
        sg, sec = self.shard_group, self.secondary_group
        if sec is not None:  # hpZ: passes/secondary.py reads the inner group (under no_sync too)
            return torch.ops.zerofx.unshard(
                local, operator.index(sg.size), sg.name, rows, cdt, rdt, operator.index(sec.size), sec.name
            )
        return torch.ops.zerofx.unshard(local, operator.index(sg.size), sg.name, rows, cdt, rdt)

    @staticmethod
    def _static_shape(t: torch.Tensor) -> torch.Tensor:
        """``t``, whose sizes dynamo is told are static while it traces (see below).

        # NOTE: static layouts in a frame of their own
        A parameter's layout is static: its shard, whole copy and sink have fixed shapes, and the
        markers' ints (``full_rows``, the group sizes) are the passes' arithmetic (padding, bucket
        membership, ``out=`` buffers; docs/architecture.md, Dynamic shapes). Read through a module
        (``module.weight`` inside a compiled frame, the usual case) dynamo takes them as constants:
        ints and tensors of nn.Module attributes are static. But a module dynamo does not trace
        (nn.LSTM / nn.GRU / nn.RNN: ``torch._dynamo.config.allow_rnn`` is off) runs its forward
        eagerly, and dynamo compiles the ``forward_value`` of each weight it reads as a frame of
        its own, recompiled per parameter layout. There this ParamState is a frame local, and
        under the default ``dynamic="auto"`` the first recompile made ``full_rows`` and the
        shard's sizes size symbols (automatic dynamic shapes): the unshard marker reached the
        gather pass with a graph value for its row count (tests/test_rnn.py). ``operator.index`` makes the ints Python ints (dynamo specializes a symbol it is
        given, with a guard on the value), and ``torch._dynamo.mark_static`` does the same for
        the tensors' sizes; both are no-ops where the values are constants already."""
        if torch.compiler.is_compiling():
            torch._dynamo.mark_static(t)  # outside a trace it would mark the tensor itself
        return t

    def reduce_local(self, pending: torch.Tensor) -> torch.Tensor:
        """This rank's part of the average of every rank's ``pending`` whole gradient.

        Uses the gradient markers' eager implementations: the same collectives the reduce
        pass emits, counted the same way."""
        ops = torch.ops.zerofx
        master = self.param.dtype
        sg, rg, rdt = self.shard_group, self.replicate_group, self.reduce_dtype
        if self.whole:
            out = ops.all_reduce_grad(pending, sg.size, sg.name, rdt, master)
        else:
            out = self.unrows(ops.reduce_grad(self.rows(pending), sg.size, sg.name, self.shard_rows, rdt, master))
        if rg is not None:
            out = ops.all_reduce_grad(out, rg.size, rg.name, rdt, master)
        return out

    @torch.no_grad()
    def land_pending(self) -> None:
        """Reduce ``sink.grad`` into the parameter's gradient and clear it (a collective)."""
        pending, self.sink.grad = self.sink.grad, None
        self.land(pending, self.reduce_local(pending))

    @torch.no_grad()
    def land(self, pending: torch.Tensor, reduced: torch.Tensor) -> None:
        """Add ``reduced`` (this rank's rows of the average of every rank's ``pending``) to the
        parameter's gradient, or make it the gradient. The parameter's gradient hooks run here as
        in ``_land_leaf_grad``: once per reduction (stage 1's end of backward, the end of a
        ``no_sync`` window), on the reduced shard."""
        if self.param._backward_hooks:
            hooked = self._before_accumulating(DTensor(reduced, self.param._spec, requires_grad=False))
            reduced = hooked.to_local() if isinstance(hooked, DTensor) else hooked
        self._accumulate(pending, reduced)
        self._after_accumulating()

    def _accumulate(self, pending: torch.Tensor, reduced: torch.Tensor) -> None:
        grad = self.param.grad
        if grad is not None:
            grad.to_local().add_(reduced)
            return
        if self.runtime.stage == 1 and not self.whole and pending.dtype == reduced.dtype:
            # ZeRO-1 keeps the whole gradient buffer: this rank's averaged rows land back in it
            # and the optimizer's gradient shard is a view of them (see docs/zero_stages.md)
            rows = self.unrows(self.rows(pending)[self.first_row : self.first_row + self.shard_rows])
            rows.copy_(reduced)
            reduced = rows
        self.param.grad = DTensor.from_local(
            reduced, self.param.device_mesh, self.param.placements, shape=self.param.shape, stride=self.param.stride()
        )


@dataclass(eq=False)
class ModelRuntime:
    """Everything zerofx keeps for one model (``model._zerofx``; ``runtime_of(model)``): how it
    was sharded, its parameters' states, the mode flags ``forward_value`` and the boundary
    reduce read, where its model state lives, and what the compile of it estimated."""

    stage: int
    mesh: Any = None  # the DeviceMesh it is sharded over
    tp_mesh: Any = None  # the tensor-parallel mesh of its DTensor parameters, if any (zerofx/sharding.py)
    options: Any = None  # the zerofx.Options it was sharded with
    states: list[ParamState] = field(default_factory=list)
    sync: bool = True  # False inside zerofx.no_sync
    pending: bool = False  # some sink holds an unreduced gradient
    _callback_queued: bool = False
    scaler: object | None = None  # a ZeroFXGradScaler (torch's ShardedGradScaler) when loss scaling is on
    local_step: bool = True  # elementwise optimizers step the local shards (zerofx/runtime/local_step.py)
    state_tier: str = "none"  # where parameter shards and optimizer state live (offload_store.place_model_state)
    state_report: str | None = None  # the line saying so, for explain() and the dump
    checkpoint_report: str | None = None  # what zerofx.compile did with the model's own layer checkpointing
    compiled: Any = None  # zerofx.backend.CompileState of the compiled model (its per-graph estimates)
    training: dict = field(default_factory=dict)  # a DeepSpeed config's training-loop settings (zerofx/ds_config.py)
    gathered: dict | None = None  # ParamState -> whole parameter, inside zerofx.gathered(model)
    gathered_versions: dict | None = None  # ParamState -> its versions() when gathered (stage 3's copies)
    unloaded: set = field(default_factory=set)  # built on meta: names not loaded yet (zerofx/sharding.py)
    unloaded_hook: Any = None  # the forward pre-hook that refuses to run while ``unloaded``
    hash_checked: bool = False  # uncompiled forwards compare shard hashes (NOTE: stale whole copies)
    # the module a running load_state_dict started from (it refreshes) and the ids of the modules
    # below it (zerofx/sharding.py, _begin_load)
    loading_root: Any = None
    warned_unquantized: bool = False  # said once that no_sync's reduction ignores quantize_grads
    lockstep: Any = None  # the lockstep checks' groups (zerofx/runtime/lockstep.py); None: one rank, fake groups

    def on_local_grad(self, sink: torch.Tensor) -> None:
        """Post-accumulate-grad hook of every sink: schedule the boundary reduce."""
        self.pending = True
        PENDING.add(self)
        if self.sync and not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.reduce_pending)

    def reduce_pending(self) -> None:
        """Land every pending local gradient in its parameter's gradient (see NOTE: the
        accumulation boundary). A collective: every rank calls it at the same point."""
        self._callback_queued = False
        if self.lockstep is not None:  # a parameter some rank did not use this time gets zeros there
            self.lockstep.pend_everywhere(self.states)
        if self.states and getattr(self.options, "quantize_grads", None) and not self.warned_unquantized:
            self.warned_unquantized = True
            warnings.warn(
                f"zerofx: quantize_grads={self.options.quantize_grads!r} quantizes the reduce-scatters inside the "
                "backward graphs; the reduction closing a no_sync window runs after the backward, unquantized "
                "(fp32 bytes for every accumulated gradient)",
                stacklevel=2,
            )
        eager_buckets.reduce_pending(self.states)
        self.pending = False
        PENDING.discard(self)

    @property
    def whole_copies(self) -> list[ParamState]:
        """The states with a whole copy ``full`` (stages 1 and 2)."""
        return [s for s in self.states if s.full is not None]

    def refresh(self) -> None:
        """Bring every whole copy up to date with its shard (stages 1 and 2; a collective)."""
        self.loading_root = None  # (a load that raised before its end left it set)
        eager_buckets.refresh(self.states)

    def check_whole_copies(self, uncompiled: bool = False) -> None:
        """Refuse to read whole copies older than their shards (NOTE: stale whole copies).
        ``uncompiled``: before an uncompiled forward, which also compares the shards' contents."""
        if torch.compiler.is_compiling():
            return  # traced inside the caller's own torch.compile region: checked by no one
        self.loading_root = None  # no load runs inside a forward (one that raised left it set)
        states = self.whole_copies
        stale = [s.qualname for s in states if s.versions() != s.synced_version]
        if uncompiled and not self.hash_checked:
            self.hash_checked = True  # from now on refreshes record hashes; this is the first baseline
            for s in states:
                s.synced_hash = s.shard_hash()
        elif uncompiled and not stale:
            stale = [s.qualname for s in states if s.shard_hash() != s.synced_hash]
        if stale:
            names = some_names(stale)
            raise ZeroFXError(
                f"{names}: changed in place since zerofx last refreshed the whole copies that stage {self.stage} "
                "reads in forward (an in-place op on the parameter or on its state_dict() tensor, "
                "torch.distributed.checkpoint.load into model.state_dict(), AveragedModel.update_parameters), "
                "so forward would read the old values. Call zerofx.sharding.runtime_of(model).refresh() on every "
                "rank after such a change (model.load_state_dict, zerofx.checkpoint.load and optimizer steps "
                "refresh by themselves)"
            )


_REFRESH_HOOK = None


def _refresh_after_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """Global optimizer step post-hook: refresh the whole copies of the parameters it stepped.

    A global hook (torch.optim's ``register_optimizer_step_post_hook``) because the optimizer
    is built by the user after ``zerofx.compile``; every rank steps the same parameters in
    the same order, so the all-gathers match."""
    states = [getattr(p, "_zerofx_state", None) for group in optimizer.param_groups for p in group["params"]]
    eager_buckets.refresh([s for s in states if s is not None])


def track(state: ParamState) -> None:
    """Register ``state`` so optimizer steps over its parameter refresh its whole copy."""
    global _REFRESH_HOOK
    state.param._zerofx_state = state
    if state.full is not None and _REFRESH_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _REFRESH_HOOK = register_optimizer_step_post_hook(_refresh_after_step)


@dataclass(eq=False)
class OptimizerState:
    """What zerofx keeps for one optimizer (``optimizer._zerofx``; ``optimizer_state(opt)``)."""

    local_step: bool = False  # later steps run on local shards (zerofx/runtime/local_step.py)
    inner_step: Any = None  # the step the local step wraps (the class's, or what already wrapped it)
    local_method: Any = None  # the bound step installed on the optimizer that runs the local step
    offload: tuple | None = None  # (tier, store, window) from zerofx.offload_optimizer
    whole: bool = False  # every step runs over whole tensors (zerofx/runtime/whole_step.py)
    windows: Any = None  # how those steps walk their windows (whole_step.Windows; None: the default)
    first_local: bool = False  # its first step is still to run on local shards (local_step.py)
    last_hook: int | None = None  # the id of its step pre-hook that runs such steps (NOTE: the last pre-hook)


def weak_hook(method: Any) -> Any:
    """A tensor hook calling ``method`` through a weak reference to its object. A hook lives in
    the tensor's C++ hook list, which Python's cycle collector cannot see into: a bound method of
    an object that holds the tensor (a ParamState and its leaf, a ModelRuntime and its sinks)
    would keep both alive forever, with the model's shards and its offload files."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return hook


# runtimes some of whose sinks hold gradients not reduced yet (inside, or left by, a no_sync window)
PENDING: weakref.WeakSet[ModelRuntime] = weakref.WeakSet()


def discard_pending(params: Any) -> None:
    """Drop the unreduced gradients that ``zerofx.no_sync`` holds for ``params``: ``zero_grad``'s
    part (of the model's modules, and of optimizers zerofx adopted), as DDP's ``zero_grad``
    drops the local gradients of an abandoned accumulation window, which the next synced
    backward would otherwise reduce with its own."""
    touched = set()
    for p in params:
        state = getattr(p, "_zerofx_state", None)
        if state is not None and state.sink.grad is not None:
            state.sink.grad = None
            touched.add(state.runtime)
    for runtime in touched:
        runtime.pending = any(s.sink.grad is not None for s in runtime.states)
        if not runtime.pending:
            PENDING.discard(runtime)


def refuse_unreduced(params: list) -> None:
    """An optimizer step over parameters whose last backward ran under ``no_sync`` and was never
    reduced would step without those gradients (their ``.grad`` is not set until the reduction):
    an error, on every rank alike (the window is the same on every rank)."""
    if not PENDING:
        return
    waiting = [p._zerofx_state.qualname for p in params if _unreduced(p)]
    if waiting:
        raise ZeroFXError(
            f"optimizer.step() over {some_names(waiting)}, whose gradients from a backward under zerofx.no_sync "
            "(model.no_sync()) were never reduced: run the accumulation window's last backward outside no_sync "
            "(it reduces the whole window's gradients) before stepping, or drop them with optimizer.zero_grad() "
            "/ model.zero_grad()"
        )


def _unreduced(p: torch.Tensor) -> bool:
    state = getattr(p, "_zerofx_state", None)
    return state is not None and state.sink.grad is not None


def optimizer_state(optimizer: torch.optim.Optimizer, create: bool = False) -> OptimizerState | None:
    """zerofx's state of ``optimizer``: None until zerofx first adopted it (``create`` makes it)."""
    state = getattr(optimizer, "_zerofx", None)
    if state is None and create:
        state = optimizer._zerofx = OptimizerState()
    return state


# set on every parameter ``shard`` replaced, to its name (zerofx/sharding.py, NOTE: an optimizer
# built before shard; NOTE: a reference to a replaced parameter)
REPLACED_BY = "_zerofx_replaced_by"


def read_after_sharding(pairs: list[tuple[str, str]]) -> ZeroFXError:
    """The error for a forward that reads parameters as they were before ``shard`` replaced them
    (``pairs``: where the forward found each, and the parameter it was), through a reference
    kept outside the module (``self.ws = [self.a.weight]`` in ``__init__``)."""
    said = [f"{where} (the model's {name!r})" if where != name else repr(name) for where, name in pairs]
    return ZeroFXError(
        f"forward reads parameters as they were before zerofx sharded the model: {some_names(said, 3, '; ')}. "
        "zerofx.shard / zerofx.compile put a new (sharded) parameter into its module, and a reference kept elsewhere (a list "
        "or attribute set in __init__) still holds the old one, which no optimizer steps and no rank "
        "reduces. Read parameters through their modules in forward (self.a.weight), not through such references"
    )


def added_after_sharding(names: list[str]) -> ZeroFXError:
    """The error for trainable parameters of a sharded model that zerofx never saw (a module
    added after ``zerofx.shard`` / ``zerofx.compile``): raised by the backend for a compiled
    frame and by a forward pre-hook for an uncompiled forward (zerofx/sharding.py)."""
    return ZeroFXError(
        f"{some_names(names)}: trainable parameter(s) of a model zerofx sharded, added after it was sharded "
        "(zerofx.shard / zerofx.compile), so nothing would average their gradients across ranks and every "
        "rank would train its own copy. Add every module before zerofx.compile (e.g. peft's adapters), or "
        "freeze these parameters (requires_grad_(False))"
    )


def runtime_of(model: torch.nn.Module) -> ModelRuntime | None:
    """What zerofx keeps for ``model`` (None: not sharded by zerofx)."""
    return getattr(model, "_zerofx", None)
