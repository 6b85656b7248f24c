"""Optimizer steps over whole tensors, for optimizers whose update of an element reads others.

# NOTE: whole-tensor steps
Adafactor's factored second moment takes the mean of every row and of every column of a
gradient, and scales the update by the root mean square of the whole parameter; Muon
orthogonalizes each gradient matrix with matmuls over all of it. None of that is a function of
this rank's rows alone. Through DTensor, torch's Adafactor fails (powers of partial sums in
place), transformers' mixes plain state tensors with DTensor gradients and fails, and Muon's
Newton-Schulz iteration runs with a collective per matmul and rounds its partial sums in bf16
where the unsharded step rounds once, so its updates differ from the unsharded run's.

So zerofx steps these optimizers as an unsharded run would, one window of parameters at a time,
each parameter on one rank of its group (its owner; the largest parameters first, each to the
least loaded rank). Every owner receives the shards of the parameters it owns, of their
gradients and of their parameter-shaped state (``eager_buckets.to_owners``: one flat
all-to-all per dtype, every owner's at once), every rank runs the optimizer's own step function
once on the whole tensors it owns (a stand-in optimizer object sharing everything with the real
one but its ``param_groups`` and ``state``), the ranks exchange what each owner's step left (its
state's keys, shapes and plain values, pickled), and one all-to-all per dtype brings every rank
its rows of each stepped parameter and of its parameter-shaped state and a copy of the rest of
its state (``eager_buckets.from_owners``). A collective per owner would cost N of gloo's fixed
price per phase (docs/measurements.md, "whole_step").
So a state tensor shaped like the parameter stays sharded like it (Muon's momentum: 1/N per
rank), and anything else (Adafactor's row and column factors, a step count) is whole and the
same on every rank, as DCP saves a replicated value. A parameter kept whole, or one zerofx does
not manage, is stepped by every rank as it is. One rank computes each update, so the parameters
are bit for bit the unsharded step's.

What it costs: per step, every shard of every parameter and gradient (and of Muon's momentum)
travels to its owner and the stepped rows back, about what one all-gather of them would move
divided by the group size; each rank runs the step's arithmetic for about 1/N of the
parameters; per window and process group, an all-to-all per dtype each way and an object
all-gather; one small all-reduce per group and window, so that a step raising on one rank
raises on all before any row is sent (``_agree``); and at most one window of whole tensors
(``WINDOW_BYTES``) above the shards, spread over the owners; a tensor of at least
``ALONE_BYTES`` (an embedding) travels in an exchange of its own, so that its owner holds it
once, in the exchange's buffer, not also in a copy out of a shared one. docs/measurements.md,
"whole_step", has the numbers. The optimizer's step pre-hooks see the shards, as for any other
optimizer (they run first: zerofx/runtime/local_step.py, NOTE: the last pre-hook); its step
function sees the whole tensors.

Which optimizers: ``whole_step_class`` (torch's Adafactor and Muon, transformers' Adafactor, and
their subclasses: the step runs their own code, whatever it adds). Optimizers that call the
closure more than once in a step (LBFGS) cannot: the closure's forward would read parameters
the step has not written back yet.

# NOTE: whole-tensor steps with tensor parallelism
Over a model that torch's tensor parallelism split (zerofx/sharding.py, NOTE: ZeRO with tensor
parallelism), what the data-parallel owner gathers is the parameter's TP share: a block of rows
or columns of the global tensor. Adafactor's factors and Muon's orthogonalization need the
global tensor, so a second exchange follows over the TP group: ownership over dp is the same on
every TP rank (the same parameters, the same global sizes), so the TP ranks that own a parameter
over dp form one TP group, and one of them (``_owners`` again) receives the others' shares,
concatenated along the TP placement's dim (``Shard(dim)``: moved first, where the exchange
splits), and steps the global tensor. Back, it sends each of them its share of the parameter
and of state shaped like it, and the rest whole; each then sends its data-parallel group its
rows. A parameter kept whole over dp takes the TP exchange on every data-parallel rank alike.
A TP-replicated one (``Replicate()``: sequence-parallel norms) is whole on every TP rank, with
the same gradient, so each steps it as without tensor parallelism. Other TP layouts (a 2-D TP
mesh, strided shards) are refused before the first step. The parameters and state are bit for
bit those of the unsharded step on the global gradients (tests/test_tensor_parallel.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Shard

from zerofx.errors import ZeroFXError
from zerofx.ir.layout import pack_consecutive
from zerofx.runtime.eager_buckets import from_owners, to_owners
from zerofx.runtime.params import GroupInfo

__all__ = [
    "WINDOW_BYTES",
    "Windows",
    "as_a_rank",
    "check_steppable",
    "heaviest_ranks",
    "stand_in",
    "step_whole",
    "whole_step_class",
]

WINDOW_BYTES = 64 << 20  # whole parameters, gradients and parameter-shaped state gathered at once
# a tensor at least this large travels in an all-to-all of its own: its owner then receives it
# whole in the exchange's buffer (rows in rank order), with no copy out of a shared one
ALONE_BYTES = 4 << 20

# torch's classes stepped over whole tensors (Muon is newer than some torch zerofx admits), and
# others by (module, qualified name), so that transformers is never imported for the check
_WHOLE_TORCH = tuple(c for c in (getattr(torch.optim, n, None) for n in ("Adafactor", "Muon")) if c is not None)
_WHOLE_NAMED = {("transformers.optimization", "Adafactor")}


def whole_step_class(optimizer: torch.optim.Optimizer) -> type | None:
    """The class in ``optimizer``'s MRO that makes it step over whole tensors (NOTE above), or None."""
    for cls in type(optimizer).__mro__:
        if cls in _WHOLE_TORCH or (cls.__module__, cls.__qualname__) in _WHOLE_NAMED:
            return cls
    return None


_STAND_IN_OWN = frozenset(
    {"param_groups", "state", "_zerofx_stand_in", "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"}
)


def stand_in(
    optimizer: torch.optim.Optimizer, groups: list[dict], state: Any, attrs: dict | None = None
) -> torch.optim.Optimizer:
    """An object of ``optimizer``'s class sharing every attribute with it (or those of ``attrs``,
    a copy of its ``vars`` from before) but ``param_groups`` and ``state``: what the class's
    step function runs on, so that the real optimizer never holds anything but its own
    parameters (a step that raises leaves it as it was)."""
    other = object.__new__(type(optimizer))  # no __init__ / __setstate__: nothing is re-checked or changed
    other.__dict__.update(optimizer.__dict__ if attrs is None else attrs)
    other.param_groups = groups
    other.state = state
    other._zerofx_stand_in = True  # zerofx's step hooks leave it alone (zerofx/runtime/local_step.py)
    # hooks of its own, none: a subclass's step that calls its parent's (a hooked step) runs no
    # hook of the optimizer a second time
    other._optimizer_step_pre_hooks, other._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
    return other


def _as_held(value: Any, before: Any, param: torch.Tensor, s: Any) -> Any:
    """A state value of a parameter every rank stepped whole (kept whole, or a plain parameter),
    as the DTensor path holds state: a parameter-shaped tensor as a DTensor over it (the one it
    held before, when it was one), anything else as it is."""
    if s is None or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    if value.dim() == 0 or value.shape != _local_shape(param):
        return value
    if isinstance(before, DTensor) and before._local_tensor is value:
        return before
    return DTensor.from_local(
        value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _sharded(p: torch.Tensor) -> Any:
    """The state of a parameter sharded over more than one rank (None: whole, or not zerofx's)."""
    s = getattr(p, "_zerofx_state", None)
    return s if s is not None and not s.whole and s.shard_group.size > 1 else None


_AS_A_RANK = False  # set by as_a_rank


@contextlib.contextmanager
def as_a_rank(rank: int = 0, states: Any = ()) -> Iterator[None]:
    """On torch's fake process group (``zerofx.plan``), step as rank ``rank`` of each data-parallel
    group of a real run would (its index modulo the group's size; over tensor parallelism, TP
    rank 0): own what ``_owners`` gives it, and take what the other owners' steps leave (keys,
    kinds, shapes) from the optimizer's state, which a step after the first leaves as it found
    it. ``states``: the model's ParamStates, whose groups name that rank for the step's duration.
    What the plan measures the step's transient memory on (zerofx/planner.py, NOTE: the
    optimizer step's transient memory); the values are meaningless, and a first step (no state
    yet) cannot."""
    global _AS_A_RANK
    groups = [(s, s.shard_group) for s in states]
    _AS_A_RANK = True
    try:
        for s, group in groups:
            s.shard_group = dataclasses.replace(group, rank=rank % group.size)
        yield
    finally:
        for s, group in groups:
            s.shard_group = group
        _AS_A_RANK = False


# groups of at most this many ranks are planned as every rank (``heaviest_ranks``)
EVERY_RANK_UP_TO = 8


def heaviest_ranks(optimizer: torch.optim.Optimizer) -> list[int]:
    """The data-parallel ranks (by index in their groups) whose whole-tensor step of
    ``optimizer`` may hold the most (``as_a_rank``): every rank of groups up to
    ``EVERY_RANK_UP_TO`` ranks, else rank 0 and each rank that owns the most bytes of some
    window (what a window holds beyond its tensors, the step's own temporaries, depends on their
    shapes, not only their bytes: over tensor parallelism Muon's highest is another rank's, 12%
    above rank 0's, with equal bytes). [0] for an optimizer that does not step over whole
    tensors."""
    if whole_step_class(optimizer) is None:
        return [0]
    sizes = {
        p._zerofx_state.shard_group.size for g in optimizer.param_groups for p in g["params"] if _sharded(p) is not None
    }
    if max(sizes, default=1) <= EVERY_RANK_UP_TO:
        return list(range(max(sizes, default=1)))
    found = {0}
    for window in _windows(optimizer, Windows()):
        by_group: dict[str, list[torch.Tensor]] = {}
        for p in window:
            if _sharded(p) is not None:
                by_group.setdefault(p._zerofx_state.shard_group.name, []).append(p)
        for ps in by_group.values():
            size = ps[0]._zerofx_state.shard_group.size
            load = [0] * size
            for p, o in zip(ps, _least_loaded(ps, size)):
                load[o] += _whole_bytes(optimizer, p)
            found.add(max(range(size), key=lambda r: (load[r], -r)))
    return sorted(found)


def _least_loaded(params: list[torch.Tensor], size: int) -> list[int]:
    """The owner of each parameter among ``size`` ranks: the largest first, each to the rank
    with the fewest elements so far (lowest rank on ties)."""
    load = [0] * size
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        owner[i] = min(range(size), key=lambda r: (load[r], r))
        load[owner[i]] += params[i].numel()
    return owner


def _owners(params: list[torch.Tensor], group: Any) -> list[int]:
    """The rank of ``group`` that steps each parameter (``_least_loaded``), the same on every
    rank. On torch's fake process group (``zerofx.plan``: one process stands for every rank, and
    no data moves) this rank steps them all, so that it ends with the state layout a real step
    leaves (within ``as_a_rank``: what a real rank owns)."""
    if dist.get_backend(_resolve_process_group(group.name)) == "fake" and not _AS_A_RANK:
        return [group.rank] * len(params)
    return _least_loaded(params, group.size)


def check_steppable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse what a whole-tensor step cannot do, before the first step changes anything."""
    name = type(optimizer).__name__
    for g in optimizer.param_groups:
        for p in g["params"]:
            s = getattr(p, "_zerofx_state", None)
            if s is not None and s.tp is not None and not _steppable_tp(s.tp.placements):
                raise ZeroFXError(
                    f"{name} steps over whole tensors (zerofx/runtime/whole_step.py, NOTE: whole-tensor "
                    f"steps), which zerofx does for tensor-parallel parameters laid out Shard(dim) or Replicate() "
                    f"on a 1-D TP mesh; {s.qualname} is {s.tp.placements}. Use an elementwise optimizer "
                    "(AdamW, Adam, SGD, ...) with that layout"
                )
            if (
                s is not None
                and p.grad is not None
                and not (isinstance(p.grad, DTensor) and p.grad.placements == p.placements and p.grad.shape == p.shape)
            ):
                raise ZeroFXError(
                    f"{s.qualname}: its gradient is not a DTensor laid out like the parameter "
                    f"({type(p.grad).__name__}), so {name}'s whole-tensor step cannot gather it. "
                    "Set gradients of zerofx parameters as DTensors of the parameter's placements"
                )


def _steppable_tp(placements: tuple) -> bool:
    return len(placements) == 1 and (placements[0].is_replicate() or type(placements[0]) is Shard)


@dataclass(frozen=True)
class Windows:
    """How a whole-tensor step walks its parameters: windows of at most ``nbytes`` of whole
    tensors (parameters, gradients, parameter-shaped state; a larger tensor is a window of its
    own; None: ``WINDOW_BYTES``), and what runs around each (``zerofx.offload_optimizer``: ``before(window, next)``
    brings the window's state in and starts reading the next one's, ``after(window)`` parks it
    again)."""

    nbytes: int | None = None
    before: Callable[[list, list], None] | None = None
    after: Callable[[list], None] | None = None


def step_whole(
    optimizer: torch.optim.Optimizer, step_fn: Callable[[torch.optim.Optimizer], Any], windows: Windows = Windows()
) -> None:
    """One step of ``optimizer`` by ``step_fn`` (its class's step function, without torch's hook
    wrapper) over whole tensors, window by window (NOTE above; ``windows``). Every rank calls it
    with the same parameters holding gradients, in the same order: the gathers and scatters are
    collectives."""
    check_steppable(optimizer)
    stepped = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    # every group the stepped parameters span, in their order (the same on every rank): where
    # each window's ranks agree whether its step raised anywhere (``_agree``)
    agree: dict[str, tuple] = {}
    for p in stepped:
        s, tp = getattr(p, "_zerofx_state", None), _tp(p)
        for g in (s.shard_group, s.replicate_group, tp and tp[0]) if s is not None else ():
            if g is not None and g.size > 1:
                agree.setdefault(g.name, (g, p.device))
    # every window steps from the groups and attributes as they were before the step, so that
    # what the step sets in them (a subclass counting its steps) is set once, not once per window
    before = _Before(
        [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups], dict(vars(optimizer))
    )
    packed = _windows(optimizer, windows)
    for i, window in enumerate(packed):
        if windows.before is not None:
            windows.before(window, packed[i + 1] if i + 1 < len(packed) else [])
        _step_window(optimizer, step_fn, window, list(agree.values()), before)
        if windows.after is not None:
            windows.after(window)


def _whole_bytes(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> int:
    """What a window holds of ``p`` whole: the parameter, its gradient, its parameter-shaped state."""
    held = sum(1 for v in optimizer.state.get(p, {}).values() if isinstance(v, DTensor))
    return p.numel() * p.element_size() * (2 + held)


def _windows(optimizer: torch.optim.Optimizer, windows: Windows) -> list[list[torch.Tensor]]:
    """The parameters a step of ``optimizer`` steps (those with a gradient), in its windows."""
    stepped = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    nbytes = WINDOW_BYTES if windows.nbytes is None else windows.nbytes
    return pack_consecutive(stepped, lambda p: _whole_bytes(optimizer, p), nbytes)


@dataclass
class _Before:
    """The optimizer's param groups (without their parameters) and attributes before a step."""

    groups: list[dict]
    attrs: dict


def _local_of(optimizer: torch.optim.Optimizer, p: torch.Tensor, key: str | None) -> torch.Tensor:
    """This rank's part of a parameter (``key`` None), of its gradient ("grad"), or of a state entry."""
    if key is None:
        return p._local_tensor
    return p.grad._local_tensor if key == "grad" else optimizer.state[p][key]._local_tensor


def _tp(p: torch.Tensor) -> tuple[GroupInfo, int] | None:
    """(its TP group, the dim its TP placement splits) for a zerofx parameter that tensor
    parallelism shards; None for any other (no TP, or a TP-replicated one: every TP rank holds
    it whole and steps it alike)."""
    s = getattr(p, "_zerofx_state", None)
    if s is None or s.tp is None or not s.tp.placements[0].is_shard():
        return None
    mesh = s.tp.mesh
    return GroupInfo(mesh.size(), mesh.get_group().group_name, mesh.get_local_rank()), s.tp.placements[0].dim


def _local_shape(p: torch.Tensor) -> torch.Size:
    """The shape of ``p``'s whole value over the data-parallel dimension: the parameter's, or for
    a tensor-parallel one its TP share's (zerofx/sharding.py, NOTE: ZeRO with tensor parallelism)."""
    s = getattr(p, "_zerofx_state", None)
    if s is None or s.tp is None:
        return p.shape
    local = p._local_tensor.shape
    return local if s.whole else torch.Size((s.full_rows, *local[1:]))


def _step_window(
    optimizer: torch.optim.Optimizer, step_fn: Callable, window: list[torch.Tensor], agree: list, before: _Before
) -> None:
    state = optimizer.state
    by_group: dict[str, list[torch.Tensor]] = {}  # in window order: the same on every rank
    for p in window:
        if _sharded(p) is not None:
            by_group.setdefault(p._zerofx_state.shard_group.name, []).append(p)
    owner = {p: o for ps in by_group.values() for p, o in zip(ps, _owners(ps, ps[0]._zerofx_state.shard_group))}
    held = {
        p: sorted(k for k, v in state.get(p, {}).items() if isinstance(v, DTensor))
        for p in window
        if hasattr(p, "_zerofx_state")
    }

    # 1. each sharded parameter's whole value, gradient and parameter-shaped state, on its owner
    # (for a tensor-parallel parameter, its TP share's)
    wholes: dict[tuple, torch.Tensor] = {}
    for ps in by_group.values():
        keys = [(p, k) for p in ps for k in (None, "grad", *held[p])]
        got = _to_owners(
            keys,
            owner,
            ps[0]._zerofx_state.shard_group,
            lambda p, k: p._zerofx_state.rows(_local_of(optimizer, p, k)),  # (NOTE: the sharded dim)
            lambda p: p._zerofx_state.full_rows,
        )
        for key in list(got):  # each in its own layout, one at a time: never two copies of a window
            wholes[key] = key[0]._zerofx_state.unrows(got.pop(key)).contiguous()

    def share(p: torch.Tensor, k: str | None) -> torch.Tensor:  # this rank's whole over the data-parallel dim
        return wholes[(p, k)] if p in owner else _local_of(optimizer, p, k)

    # 1b. tensor-parallel parameters whose TP share this rank holds whole: the TP ranks holding
    # them (one data-parallel owner per TP rank: ownership is the same on each) send their shares
    # to one of them, which then holds the parameter's global value (NOTE: whole-tensor steps
    # with tensor parallelism)
    tp_of: dict[torch.Tensor, tuple[GroupInfo, int]] = {}
    for p in window:
        t = _tp(p)
        if t is not None and (p not in owner or owner[p] == p._zerofx_state.shard_group.rank):
            tp_of[p] = t
    tp_groups: dict[str, list[torch.Tensor]] = {}
    for p in tp_of:
        tp_groups.setdefault(tp_of[p][0].name, []).append(p)
    tp_owner = {p: o for ps in tp_groups.values() for p, o in zip(ps, _owners(ps, tp_of[ps[0]][0]))}
    full: dict[tuple, torch.Tensor] = {}
    for ps in tp_groups.values():
        keys = [(p, k) for p in ps for k in (None, "grad", *held[p])]
        got = _to_owners(
            keys,
            tp_owner,
            tp_of[ps[0]][0],
            lambda p, k: share(p, k).movedim(tp_of[p][1], 0),
            lambda p: p.shape[tp_of[p][1]],
        )
        full.update({(p, k): t.movedim(0, tp_of[p][1]).contiguous() for (p, k), t in got.items()})

    # 2. one step of what this rank steps: the parameters it owns, and whole or plain ones (every rank)
    whole_of: dict[torch.Tensor, torch.Tensor] = {}
    stepped: defaultdict = defaultdict(dict)
    groups = optimizer.param_groups
    window_groups: list[dict] = []
    failed = None
    try:
        with torch.no_grad():
            for p in window:
                s = getattr(p, "_zerofx_state", None)
                if p in tp_of and tp_owner[p] != tp_of[p][0].rank:
                    continue
                if p not in tp_of and p in owner and owner[p] != s.shard_group.rank:
                    continue
                if p in tp_of or p in owner:
                    # its other state copied: a step that fails leaves the optimizer's as it was
                    got = full if p in tp_of else wholes
                    w, grad = got[(p, None)].detach(), got[(p, "grad")]
                    parts = {
                        k: v.clone()
                        for k, v in state.get(p, {}).items()
                        if isinstance(v, torch.Tensor) and not isinstance(v, DTensor)
                    }
                    parts.update({k: got[(p, k)] for k in held[p]})
                elif s is not None:  # kept whole: its local tensors are whole
                    w, grad = p._local_tensor.detach(), p.grad._local_tensor
                    parts = {k: v._local_tensor for k, v in state.get(p, {}).items() if isinstance(v, DTensor)}
                else:
                    w, grad, parts = p, p.grad, {}
                if w is not p:
                    w.requires_grad_(p.requires_grad)
                    w.grad = grad
                whole_of[p] = w
                if p in state:
                    stepped[w] = {**state[p], **parts}
        window_groups = [
            {**b, "params": [whole_of[p] for p in g["params"] if p in whole_of]} for b, g in zip(before.groups, groups)
        ]
        other = stand_in(optimizer, window_groups, stepped, before.attrs)
        step_fn(other)
    except Exception as e:  # every rank must learn it before anything is sent
        failed = e
    _agree(optimizer, agree, failed)
    for g, wg in zip(groups, window_groups):  # what the step set in a group (not its parameters)
        g.update({k: v for k, v in wg.items() if k != "params"})
    for k, v in vars(other).items():  # and in the optimizer's attributes
        if k not in _STAND_IN_OWN and (k not in before.attrs or before.attrs[k] is not v):
            vars(optimizer)[k] = v
    # the whole gradients are spent: not held through the exchanges back
    grad = None
    for got in (wholes, full):
        for key in [key for key in got if key[1] == "grad"]:
            del got[key]
    for p, w in whole_of.items():
        if (p in owner or p in tp_of) and w is not p:
            w.grad = None

    # 3. back to the shards: whole or plain parameters hold their result already; each TP owner
    # sends every rank holding a TP share its share, then each data-parallel owner sends every
    # rank of its group its rows of the parameter and of parameter-shaped state, and the rest
    with torch.no_grad():
        for p, w in whole_of.items():
            if p in owner or p in tp_of:
                continue
            if w is not p:
                w.grad = None
            if w in stepped:
                old, s = state.get(p, {}), getattr(p, "_zerofx_state", None)
                state[p] = {k: _as_held(v, old.get(k), p, s) for k, v in stepped[w].items()}
        tp_kinds: dict = {}  # what the TP exchange found each state entry to be (its shape may mislead later)
        for ps in tp_groups.values():
            group = tp_of[ps[0]][0]
            back = _exchange_back(
                ps, tp_owner, group, whole_of, stepped, lambda p: tp_of[p][1], lambda p: p.shape, current=state
            )
            for p, (value, entries, mine) in back.items():
                local = {k: (v.contiguous() if kind == "rows" else _kept(v, kind, mine, p)) for k, kind, v in entries}
                tp_kinds[p] = {k: kind for k, kind, _ in entries}
                if p in owner:  # then to its data-parallel group, as the share it steps
                    whole_of[p] = value.contiguous()
                    stepped[whole_of[p]] = local
                    continue
                s, old = p._zerofx_state, state.get(p, {})
                p._local_tensor.copy_(value)
                state[p] = {
                    k: _as_held(v, old.get(k), p, s) if tp_kinds[p][k] == "rows" else v for k, v in local.items()
                }
        for ps in by_group.values():
            _back_to_shards(optimizer, ps, owner, whole_of, stepped, tp_kinds)


def _batches(items: list, dtype: Callable, nbytes: Callable) -> list[list]:
    """``items`` (in one order on every rank) in the order their exchanges run: each of at least
    ``ALONE_BYTES`` in one of its own, then the others together, one exchange per dtype."""
    alone = [[item] for item in items if nbytes(item) >= ALONE_BYTES]
    rest = [item for item in items if nbytes(item) < ALONE_BYTES]
    return alone + [[i for i in rest if dtype(i) == d] for d in sorted({dtype(i) for i in rest}, key=str)]


def _to_owners(keys: list, owner: dict, group: GroupInfo, local: Callable, whole_rows: Callable) -> dict:
    """The whole tensors of ``keys`` (``(parameter, key)``, in one order on every rank) that this
    rank owns (``owner[parameter]``), from every rank's dim-0 rows (``local(p, key)``; the whole
    has ``whole_rows(p)`` rows): an all-to-all per batch (``_batches``)."""

    def nbytes(pk: tuple) -> int:  # the same on every rank: whole rows, the rows' shape and dtype
        t = local(*pk)
        return whole_rows(pk[0]) * math.prod(t.shape[1:]) * t.element_size()

    out = {}
    for batch in _batches(keys, lambda pk: local(*pk).dtype, nbytes):
        these = [[pk for pk in batch if owner[pk[0]] == o] for o in range(group.size)]
        parts = [[(local(*pk), whole_rows(pk[0])) for pk in owned] for owned in these]
        out.update(zip(these[group.rank], to_owners(parts, group)))
    return out


def _agree(optimizer: torch.optim.Optimizer, agree: list, failed: BaseException | None) -> None:
    """Raise on every rank if the window's step raised on any (each rank steps other parameters,
    so one may raise alone), before any of the window's rows is sent. One small all-reduce per
    group the step spans, every one of them before raising (over a 2-D mesh: its shard, then its
    replicate dimension, so that every rank of the mesh hears it)."""
    flag = 0 if failed is None else 1
    for group, device in agree:
        t = torch.tensor([flag], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_resolve_process_group(group.name))
        flag = max(flag, int(t))
    if failed is not None:
        raise failed
    if flag:
        raise ZeroFXError(
            f"{type(optimizer).__name__}'s whole-tensor step raised on another rank, which stepped other "
            "parameters (zerofx/runtime/whole_step.py): this window's sharded parameters and their state did "
            "not change on any rank (earlier windows of the step, and parameters kept whole, may have); that "
            "rank's error says why"
        )


def _exchange_back(
    ps: list,
    owner: dict,
    group: GroupInfo,
    whole_of: dict,
    stepped: dict,
    dim: Callable,
    shape: Callable,
    kinds: dict | None = None,
    current: dict | None = None,
) -> dict:
    """The exchange after a step over ``group``: each rank stepped the parameters of ``ps`` it
    owns (``owner``), whose whole values split over ``group`` along ``dim(p)`` into torch.chunk's
    parts (the data-parallel rows, or a tensor-parallel share) and have the whole shape
    ``shape(p)``. One exchange of what each owner's step left (keys, shapes, plain values: no
    tensor is pickled), then one all-to-all per dtype: every rank gets its part of each
    parameter and of its state shaped like it, and the rest of its state whole. Returns, per
    parameter, ``(its part, [(key, kind, value)], whether this rank stepped it)``: kind "rows"
    (this rank's part), "tensor" (whole, a view of the exchange's buffer on the owner's device
    where this rank did not step it; where it lives: ``_kept``) or "value". A tensor is "rows"
    when shaped like the whole (``shape(p)``), unless ``kinds[p][key]`` says otherwise: after
    the TP exchange a global factor may have the shape of a TP share by chance. ``current``: the
    optimizer's state, where the other owners' layouts come from on the fake group within
    ``as_a_rank``."""
    me = group.rank
    owned = [[p for p in ps if owner[p] == o] for o in range(group.size)]

    # per parameter: [(key, "rows", dtype), (key, "tensor", (shape, dtype, on the device?)) or (key, "value", value)]
    def entry(p: torch.Tensor, k: str, v: Any) -> tuple:
        if not isinstance(v, torch.Tensor):
            return (k, "value", v)
        known = (kinds or {}).get(p, {}).get(k)  # what an earlier exchange found (a TP share's state)
        if known == "rows" or (known is None and v.dim() > 0 and v.shape == shape(p)):
            return (k, "rows", v.dtype)
        # small (factored moments, counts): whole on every rank, and whether it lives with the
        # parameter or on the host (torch's step counts)
        return (k, "tensor", (v.shape, v.dtype, v.device == whole_of[p].device))

    layout = [[entry(p, k, v) for k, v in stepped.get(whole_of[p], {}).items()] for p in owned[me]]
    pg = _resolve_process_group(group.name)
    layouts: list[Any] = [layout if o == me else [] for o in range(group.size)]
    if dist.get_backend(pg) != "fake":  # (on the fake group this rank owns all: see _owners)
        dist.all_gather_object(layouts, layout, group=pg)
    elif _AS_A_RANK:  # what the others' steps leave: the layout their state has (as_a_rank)

        def held(p: torch.Tensor, k: str, v: Any) -> tuple:
            if isinstance(v, DTensor):
                return (k, "rows", v.dtype)
            if isinstance(v, torch.Tensor):
                return (k, "tensor", (v.shape, v.dtype, v.device == p.device))
            return (k, "value", v)

        for o in range(group.size):
            if o != me:
                layouts[o] = [[held(p, k, v) for k, v in (current or {}).get(p, {}).items()] for p in owned[o]]

    def first(size: torch.Size, d: int) -> torch.Size:  # the split dim first
        return torch.Size((size[d], *size[:d], *size[d + 1 :]))

    # what each owner sends, in one order on every rank: (parameter, state key or None, whole shape, rows?, dtype)
    sends = [
        [(p, None, first(shape(p), dim(p)), True, p.dtype) for p in owned[o]]
        + [
            (
                p,
                k,
                first(shape(p), dim(p)) if kind == "rows" else spec[0],
                kind == "rows",
                spec if kind == "rows" else spec[1],
            )
            for p, entries in zip(owned[o], layouts[o])
            for k, kind, spec in entries
            if kind != "value"
        ]
        for o in range(group.size)
    ]
    got: dict[tuple, torch.Tensor] = {}
    device = ps[0].device
    everything = [e for owned_sends in sends for e in owned_sends]  # (in one order on every rank)
    nbytes = lambda e: math.prod(e[2]) * e[4].itemsize  # noqa: E731
    for batch in _batches(everything, lambda e: e[4], nbytes):
        in_batch = {id(e) for e in batch}
        these = [[e for e in owned_sends if id(e) in in_batch] for owned_sends in sends]
        dtype = batch[0][4]
        sent = [
            (whole_of[p] if k is None else stepped[whole_of[p]][k]).movedim(dim(p), 0)
            if rows
            else stepped[whole_of[p]][k]
            for p, k, _, rows, _ in these[me]
        ]
        expect = [[(size, rows) for _, _, size, rows, _ in owned_sends] for owned_sends in these]
        received = from_owners(sent, expect, dtype, device, group)
        for owned_sends, ts in zip(these, received):
            for (p, k, _, rows, _), t in zip(owned_sends, ts):
                got[(p, k)] = t.movedim(0, dim(p)) if rows else t
    out = {}
    for o in range(group.size):
        for p, entries in zip(owned[o], layouts[o]):
            mine = o == me
            values = []
            for k, kind, spec in entries:
                if kind == "rows":
                    values.append((k, kind, got[(p, k)]))
                elif kind == "tensor":  # with where it lives: with the parameter, or on the host
                    values.append((k, kind, (stepped[whole_of[p]][k] if mine else got[(p, k)], spec[2])))
                else:
                    values.append((k, kind, stepped[whole_of[p]][k] if mine else spec))
            out[p] = (got[(p, None)], values, mine)
    return out


def _kept(value: Any, kind: str, mine: bool, p: torch.Tensor) -> Any:
    """A state entry that is not the parameter's part, as this rank keeps it: the stepping rank
    its own object; the others a copy of a small tensor of their own (not a view of the
    exchange's buffer) where the owner kept it (with the parameter, or on the host)."""
    if kind != "tensor":
        return value
    tensor, on_device = value
    return tensor if mine else tensor.to(p.device if on_device else "cpu", copy=True)


def _back_to_shards(
    optimizer: torch.optim.Optimizer, ps: list, owner: dict, whole_of: dict, stepped: dict, kinds: dict
) -> None:
    """Each rank of the group of ``ps`` stepped the parameters it owns (``owner``; for a
    tensor-parallel one, its TP share): every rank of the group takes its rows of each
    parameter and of its parameter-shaped state, and a copy of the rest of its state (the
    entries the owner's step left, in their order, on every rank)."""
    group = ps[0]._zerofx_state.shard_group
    dim = lambda p: p._zerofx_state.shard_dim  # noqa: E731  (NOTE: the sharded dim)
    back = _exchange_back(ps, owner, group, whole_of, stepped, dim, _local_shape, kinds, optimizer.state)
    state = optimizer.state
    for p, (rows, entries, mine) in back.items():
        p._local_tensor.copy_(rows)
        before, after = state.get(p, {}), {}
        for k, kind, value in entries:
            if kind != "rows":
                after[k] = _kept(value, kind, mine, p)
                continue
            old = before.get(k)
            if isinstance(old, DTensor) and old.dtype == value.dtype and old._local_tensor.shape == value.shape:
                old._local_tensor.copy_(value)
                after[k] = old
            else:
                after[k] = DTensor.from_local(
                    value.clone(), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
        state[p] = after
