"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), written crash-safely.

    zerofx.checkpoint.save("ckpt/step100", model, optimizer, extra={"step": 100})   # every rank
    extra = zerofx.checkpoint.load("ckpt/step100", model, optimizer)                 # every rank
    zerofx.checkpoint.export_full_state_dict("ckpt/step100", "model.pt")              # one process
    zerofx.checkpoint.export("ckpt/step100", "hf_out", to="hf")   # sharded safetensors, one process
    zerofx.checkpoint.load_hf("hf_out", model)                     # every rank reads its rows only

What is saved is what torch's ``torch.distributed.checkpoint.state_dict`` helpers return for
the model and optimizer: parameters and optimizer state are DTensors, so each rank writes only
its shards and DCP records their global shapes and offsets. That is what makes loading on a
different world size or mesh (resharding) work without any zerofx code: DCP reads every rank's
new shards from whichever files hold them. It also makes a checkpoint portable across ZeRO
stages, whose parameters are the same ``Shard(0)`` DTensors (``zerofx.runtime.params``). After loading,
stages 1 and 2 refresh their whole copies (a ``load_state_dict`` post-hook). Buffers are plain
tensors, which DCP takes as the same on every rank and writes from one rank only, whichever its
deduplication picks (not necessarily rank 0): buffers that differ between ranks (BatchNorm's
running statistics, which zerofx keeps per rank) are saved as that rank's, and load so on every rank.

# NOTE: crash-safe writes
A checkpoint is loadable only if it is complete. ``save`` writes into a fresh temporary folder
next to the target, waits for every rank, and only then has rank 0 write the completion marker
(``ZEROFX_COMPLETE``: a JSON file with the world size, the loss-scaler state and ``extra``,
fsynced) and rename the folder into place. A crash before the rename leaves only a temporary
folder (never the target); ``load`` refuses any folder without the marker with an error saying
so. Replacing an existing checkpoint moves the old one aside first, so at no instant is a
half-written folder under the target name; a crash between the two renames leaves the new
checkpoint complete in its temporary folder, which ``load`` names. Only a checkpoint (a folder
with the marker) or an empty folder is ever replaced: any other ``path`` is an error, before
anything is written. Assumes, as DCP's FileSystemWriter does, a file system every rank sees.

# NOTE: a checkpoint replaced while it is read
A training job saving to one path (``ckpt/latest``) renames a new folder onto it while an
``export`` of the old one may be running: DCP reads ``.metadata`` once and reopens the shard
files by path, so the rest of the read would come from the new checkpoint's files under the old
one's offsets, two checkpoints mixed without an error. So ``load``, ``export`` and
``export_full_state_dict`` note the folder's identity before they read anything (its device and
inode, which the rename changes, and the completion marker's bytes, which hold an id of their
own per save) and compare it after the read (``export``: after each output file and before its
final rename); a change is an error saying the checkpoint was replaced, with nothing written
(``load``: as a read that failed part-way, NOTE: a load that fails). Read a path that is being
saved to from a copy, or save each step to a folder of its own.

# NOTE: optimizer state that does not exist yet
torch's state-dict helpers build an optimizer's state dict from its state, and give an optimizer
that has none (it never stepped) some by running a step at lr 0 with zero gradients, unless a
parameter holds a gradient. Both ways go wrong for a checkpoint: ``save`` before the first step
would leave that step in the live optimizer (Adam's step count 1, so every later bias correction
differs), and ``load`` into a fresh optimizer after a warm-up backward would request no state at
all and silently resume with none. So ``save`` keeps an optimizer that never stepped as it is and
writes no state for it (a parameter's gradient stands in for the duration of the call), and
``load`` holds back the gradients while it builds the state to read into. A parameter with no
state in the checkpoint (it had no gradient before the save: an unused expert) gets none, as in
the uninterrupted run; state of another optimizer, of parameters this optimizer does not hold, or
in another number of parameter groups is one error naming it, raised before anything is read.
Every saved parameter-group key is read, also those a fresh optimizer lacks (``initial_lr``, set
by an LR scheduler), as torch's ``optimizer.load_state_dict`` restores them.

# NOTE: a load that fails
A load that refuses (another model, other tied names, another optimizer, a damaged folder)
leaves the model and the optimizer as they were. What can be checked from the checkpoint's
metadata and the model is checked before the optimizer is touched; the per-parameter state
names need the optimizer's state, which a fresh one gets from torch's step at lr 0 (above), so
``load`` takes a shallow copy of the optimizer's attributes first (its state, its groups' keys,
its hooks, the step methods zerofx and LR schedulers patch in, zerofx's own record of it) and
puts them back on any failure: a fresh optimizer is fresh again, its Adam step count not 1.
LBFGS is refused up front (its state is vectors flattened over all of a rank's parameters,
which do not reshard, and torch's helper steps it without the closure it needs). Before
anything else ``load`` checks that ``.metadata`` and every file it lists are there and long
enough, one error on every rank. (That is all a load can check of the bytes: DCP stores no
checksums, so bytes changed inside a tensor's data, the file keeping its size, load and export
as they are.) A read that still fails (a record DCP cannot decode) does so after
DCP has overwritten some tensors in place, differently on each rank: the optimizer is put back
(one that held state has its state partly overwritten: its ``step`` then refuses, until a load
succeeds), and the model is marked, so that its forward (and ``save``) refuses with an error
saying a load into it failed, until a ``load`` of it succeeds (or ``model.load_state_dict`` of
every tensor); the ``ZeroFXError`` raised says so, chained from DCP's. A load is a collective,
and a failure on one rank (its own disk without the folder, a read that fails there only) must
fail it on every rank: one rank raising while the others go on would leave them waiting in the
load's next collective, or with a model that runs while its peer's refuses, and the next forward
would hang. So every rank checks its files itself and the ranks agree four times, with one small
all-reduce (and, when one failed, a broadcast of the first failing rank's error): after the file
checks, after the checks against the model and the optimizer's groups, right before DCP reads
(after the optimizer's state is made and checked), and after the tensors are set. Every rank
then raises alike, naming the rank that failed, and marks what the read may have overwritten. (A
KeyboardInterrupt on one rank skips the agreements: its peers wait in theirs until the process
group's timeout.)

# NOTE: tied parameters in a checkpoint
DCP stores each state_dict name, so a tied pair (``lm_head.weight`` is ``wte.weight``) is two
entries with the same values. ``save`` records in the completion marker which names were one
tensor (``aliases``); ``load`` refuses a model that ties names the checkpoint stored separately,
naming them (reading two different tensors into one would keep whichever was read last). The
reverse (saved tied, loaded untied) loads: both tensors get the same values. A checkpoint
without the record (older ones, or saved through a wrapper whose state_dict drops its own
prefix, e.g. Lightning Fabric's module) is not checked.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from zerofx.errors import ZeroFXError, some_names
from zerofx.ir.layout import pack_consecutive
from zerofx.ir.offload_ops import bytes_view
from zerofx.runtime.params import runtime_of
from zerofx.sharding import alias_names, mark_loaded

__all__ = ["save", "load", "export_full_state_dict", "export", "load_hf", "COMPLETE_MARKER"]

COMPLETE_MARKER = "ZEROFX_COMPLETE"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _collective_device() -> torch.device:
    """Where the default group's small collectives put their tensors (NCCL's on its GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def same_on_every_rank(value: str, src: int = 0) -> str:
    """Rank ``src``'s ``value`` on every rank (a collective when a process group exists)."""
    if not _distributed():
        return value
    # tensors, not broadcast_object_list: object collectives need NumPy, which zerofx does not
    device = _collective_device()
    data = torch.tensor(list(value.encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    buf = data if dist.get_rank() == src else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src)
    return bytes(buf.tolist()).decode()


def _first_failure(problem: str) -> tuple[int, str] | None:
    """The lowest rank whose ``problem`` is not empty, and that problem, on every rank; None
    where no rank has one. A collective every rank calls alike (NOTE: a load that fails)."""
    if not _distributed():
        return (0, problem) if problem else None
    world = dist.get_world_size()
    first = torch.tensor([dist.get_rank() if problem else world], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    if int(first.item()) == world:
        return None
    return int(first.item()), same_on_every_rank(problem, src=int(first.item()))


def _problem(e: Exception) -> str:
    """What a rank that failed says to the others: a ZeroFXError's message, else its reason."""
    return (str(e) if isinstance(e, ZeroFXError) else _reason(e)) or type(e).__name__


def _on_every_rank_or_none(check: Any, failed_as: str = "refused") -> Any:
    """``check()`` (this rank's own look at the files and the optimizer), then every rank raises
    if any rank's check did: its own error, or the first failing rank's, named (``failed_as``
    on rank N: ...). A collective, so also a barrier."""
    failed: Exception | None = None
    try:
        result = check()
    except Exception as e:
        failed, result = e, None
    first = _first_failure("" if failed is None else _problem(failed))
    if failed is not None:
        raise failed
    if first is not None:
        raise ZeroFXError(f"{failed_as} on rank {first[0]}: {first[1]}")
    return result


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


@contextlib.contextmanager
def _grads_held_back(optimizer: torch.optim.Optimizer):
    """No parameter of ``optimizer`` holds a gradient inside (NOTE: optimizer state that does
    not exist yet): torch's helpers then give a fresh optimizer the state a load reads into."""
    held = [(p, p.grad) for p in _params(optimizer) if p.grad is not None]
    for p, _ in held:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in held:
            p.grad = grad


@contextlib.contextmanager
def _left_unstepped(optimizer: torch.optim.Optimizer):
    """An optimizer that never stepped stays so inside (NOTE: optimizer state that does not
    exist yet): one parameter holds a zero gradient, so torch's helpers run no step at lr 0."""
    params = [p for p in _params(optimizer) if p.requires_grad]
    if optimizer.state or not params or any(p.grad is not None for p in params):
        yield
        return
    params[0].grad = torch.zeros_like(params[0])
    try:
        yield
    finally:
        params[0].grad = None


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None, around: Any) -> dict[str, Any]:
    """What ``save`` writes (``around``: ``_left_unstepped``) or ``load`` reads into
    (``_grads_held_back``), the optimizer's state dict built inside ``around(optimizer)``."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    with around(optimizer):
        model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def _refuse_replacing(path: Path) -> None:
    """``save`` replaces a checkpoint or an empty folder, nothing else: rank 0 looks, every rank
    raises together."""
    problem = ""
    if _rank() == 0 and path.exists():
        if not path.is_dir():
            problem = f"{path} exists and is not a folder"
        elif not (path / COMPLETE_MARKER).is_file() and any(path.iterdir()):
            problem = (
                f"{path} exists and is not a zerofx checkpoint (no {COMPLETE_MARKER} marker): saving would delete "
                "what it holds; choose another path or empty it"
            )
    problem = same_on_every_rank(problem)
    if problem:
        raise ZeroFXError(f"zerofx.checkpoint.save: {problem} (nothing was written)")


def _check_extra(value: Any, where: str) -> None:
    """``extra`` comes back from :func:`load` as it went in: JSON's own types only. A tuple would
    come back a list and an int key a string (JSON has neither), so either is refused here, at
    the save, rather than changed silently."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ZeroFXError(
                    f"checkpoint {where} has the key {key!r} ({type(key).__name__}); extra is saved as JSON, "
                    f"whose keys are strings: it would load as {str(key)!r}. Use string keys"
                )
            _check_extra(item, f"{where}[{key!r}]")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_extra(item, f"{where}[{i}]")
    elif isinstance(value, tuple):
        raise ZeroFXError(
            f"checkpoint {where} is a tuple; extra is saved as JSON, which would load it as a list. Pass a list"
        )
    elif not (value is None or isinstance(value, (str, int, float))):
        raise ZeroFXError(
            f"checkpoint {where} is a {type(value).__name__}; extra is saved as JSON: str, int, float, bool, None, "
            "lists and dicts with string keys (tensors belong in the model's or optimizer's state)"
        )


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save ``model`` (and ``optimizer``) sharded to the folder ``path``; a collective.

    ``extra`` is metadata (say, the step) returned by :func:`load` as it was given: JSON's types
    (str, int, float, bool, None, lists, dicts with string keys; anything else is refused). An
    existing checkpoint at ``path`` is replaced only once the new one is complete; any other
    non-empty ``path`` is an error. An optimizer that never stepped is saved without state and
    left as it was (NOTE: optimizer state that does not exist yet).
    """
    path = Path(path)
    _check_extra(extra or {}, "extra")
    extra_json = json.dumps(extra or {})
    for what in (model, optimizer):
        if what is not None and _FAILED in vars(what):
            raise ZeroFXError(f"zerofx.checkpoint.save: {vars(what)[_FAILED]} (nothing was written)")
    _refuse_replacing(path)
    tmp = path.parent / same_on_every_rank(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    failed_as = "zerofx.checkpoint.save failed"
    # rank 0's own steps fail on every rank (NOTE: a save that fails on rank 0): a peer that went on
    # would wait in its next collective for a rank 0 that raised
    _on_every_rank_or_none(lambda: tmp.mkdir(parents=True) if _rank() == 0 else None, failed_as)
    state = _state(model, optimizer, _left_unstepped)
    dcp.save(state, checkpoint_id=str(tmp))
    _barrier()  # every rank's shards and DCP's metadata are on disk
    _on_every_rank_or_none(lambda: _complete(path, tmp, model, state, extra_json) if _rank() == 0 else None, failed_as)
    return path


# NOTE: a save that fails on rank 0
# Making the temporary folder and completing the checkpoint (marker, renames) are rank 0's alone.
# Behind a plain barrier, a failure there (the parent a file, a full disk, no permission) raised on
# rank 0 only: the other ranks got gloo's "connection reset", or, in a loop that logs a failed
# save and trains on, waited in save's barrier while rank 0 waited in the next forward's
# collective, until the process group's timeout. Both steps now end in an agreement: every rank
# raises, naming rank 0's error. A failed completion leaves the old checkpoint as it was (the
# renames come last) and the temporary folder behind, as a failed DCP write does.


def _complete(path: Path, tmp: Path, model: nn.Module, state: dict, extra_json: str) -> None:
    """Rank 0's end of ``save``: the completion marker, then the new folder in ``path``'s place."""
    runtime = runtime_of(model)
    scaler = runtime.scaler.state_dict() if runtime is not None and runtime.scaler is not None else None
    marker = {
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "loss_scaler": scaler,
        "extra": json.loads(extra_json),
        "hf_config": _hf_config(model),
        "aliases": _tied_keys(model, state["model"]),  # NOTE: tied parameters in a checkpoint
        "save_id": uuid.uuid4().hex,  # NOTE: a checkpoint replaced while it is read
    }
    with open(tmp / COMPLETE_MARKER, "w") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:12]}"
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _check_complete(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        left = sorted(
            (p for p in path.parent.glob(f".{path.name}.tmp-*") if (p / COMPLETE_MARKER).is_file()),
            key=lambda p: p.stat().st_mtime,
        )
        if left and not path.exists():
            raise ZeroFXError(
                f"checkpoint {path} does not exist, but a save into it stopped between its two renames: "
                f"{left[-1]} is complete (it has the {COMPLETE_MARKER} marker); rename it to {path} to load it"
            )
        raise ZeroFXError(f"checkpoint {path} does not exist (or is not a folder)")
    marker = path / COMPLETE_MARKER
    if not marker.is_file():
        raise ZeroFXError(
            f"checkpoint {path} is incomplete: it has no {COMPLETE_MARKER} marker, so its writing never finished "
            "(a crash or interruption during zerofx.checkpoint.save, or a folder zerofx did not write); "
            "refusing to load it"
        )
    return json.loads(marker.read_text())


def _identity(path: Path) -> tuple[int, int, bytes] | None:
    """What tells the checkpoint folder at ``path`` from one saved onto it later (NOTE: a
    checkpoint replaced while it is read): its device and inode and its completion marker's bytes;
    None where either cannot be read (the folder is gone, or not yet renamed into place)."""
    try:
        st = os.stat(path)
        marker = (path / COMPLETE_MARKER).read_bytes()
    except OSError:
        return None
    return st.st_dev, st.st_ino, marker


def _check_unchanged(path: Path, identity: tuple[int, int, bytes] | None, doing: str, after: str) -> None:
    """Raise if the checkpoint at ``path`` is no longer the one ``identity`` noted."""
    if identity is None or _identity(path) != identity:
        raise ZeroFXError(
            f"checkpoint {path} was replaced while {doing} (a save onto the same path renamed another "
            "checkpoint into place: what was read may mix the two); "
            f"{after}. Read a checkpoint no job saves onto meanwhile (a copy, or a folder per step)"
        )


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    load_model: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` into ``model`` (and ``optimizer``); a collective.

    Works across world sizes and meshes (DCP reshards). Returns the ``extra`` it was saved with.
    ``load_model=False`` reads only the optimizer's state (``model`` then only names the
    parameters and is left as it is): for a resume that loaded the model already, before the
    optimizer existed, without reading the parameters twice.

    A load that refuses (``ZeroFXError``: another model, other tied names, another optimizer,
    LBFGS, a missing or short file) leaves the model and optimizer as they were. A read that
    fails part-way (a record DCP cannot decode) raises a ``ZeroFXError`` saying so, after which the
    model refuses to run (or be saved) until a load into it succeeds (NOTE: a load that fails).
    """
    path = Path(path)
    identity = _identity(path)  # NOTE: a checkpoint replaced while it is read
    info, metadata = _on_every_rank_or_none(lambda: _files_and_optimizer(path, optimizer))
    stored = metadata.state_dict_metadata
    if not load_model:
        return _load_optimizer_only(path, identity, info, metadata, model, optimizer)
    model_sd = get_model_state_dict(model)
    _on_every_rank_or_none(lambda: _check_against(path, info, stored, model, model_sd, optimizer))
    state = {"model": model_sd}
    with _left_as_it_was_on_failure(path, model, optimizer, parameters=True) as reading:
        if optimizer is not None:
            with _grads_held_back(optimizer):
                state["optimizer"] = get_optimizer_state_dict(model, optimizer)
            _check_optimizer_state(path, state["optimizer"], stored)
            _request_saved_group_keys(state["optimizer"], metadata)
        _init_unsaved_buffers(model)
        reading()
        dcp.load(state, checkpoint_id=str(path))
        _on_every_rank_or_none(lambda: _check_unchanged(path, identity, "loading", "the load failed"))
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            # not strict: _check_optimizer_state left out the parameters with no saved state, which
            # get none; every key was checked against the checkpoint before the read
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=StateDictOptions(strict=False),
            )
    _clear_failed(model)
    _clear_failed(optimizer)
    mark_loaded(model, state["model"])
    _after_load(model, info)
    return info["extra"]


def _load_optimizer_only(
    path: Path,
    identity: tuple[int, int, bytes] | None,
    info: dict[str, Any],
    metadata: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> dict[str, Any]:
    if optimizer is None:
        raise ZeroFXError(
            "zerofx.checkpoint.load(load_model=False) reads only an optimizer's state: pass the optimizer"
        )
    stored = metadata.state_dict_metadata
    model_sd = get_model_state_dict(model)
    _on_every_rank_or_none(lambda: _check_against(path, info, stored, model, model_sd, optimizer))
    with _left_as_it_was_on_failure(path, model, optimizer, parameters=False) as reading:
        with _grads_held_back(optimizer):
            state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        _check_optimizer_state(path, state["optimizer"], stored)
        _request_saved_group_keys(state["optimizer"], metadata)
        reading()
        dcp.load(state, checkpoint_id=str(path))
        _on_every_rank_or_none(lambda: _check_unchanged(path, identity, "loading", "the load failed"))
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(strict=False))
    _clear_failed(optimizer)
    _after_load(model, info, parameters_changed=False)
    return info["extra"]


# -- what a load checks first, and what it puts back when it fails (NOTE: a load that fails) ----------


def _damage(path: Path) -> tuple[str, Any]:
    """What is missing from checkpoint ``path`` that DCP would need (``""``: nothing), and its
    metadata: ``.metadata``, then every file it lists, each at least as long as the metadata's
    last byte in it. Cheap (file sizes), and before anything is read into the model; bytes
    changed inside a file of the right size pass (DCP keeps no checksums to compare them with)."""
    if not (path / ".metadata").is_file():
        return "its .metadata file (DCP's index of the shards) is missing", None
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a damaged index: unpickling fails in many ways
        return f"its .metadata file cannot be read ({type(e).__name__}: {str(e)[:200]})", None
    need: dict[str, int] = {}
    for item in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(item, "relative_path", None)
        if name is not None:
            need[name] = max(need.get(name, 0), int(item.offset) + int(item.length))
    missing = sorted(name for name in need if not (path / name).is_file())
    if missing:
        return f"{some_names(missing)} (listed in its .metadata) {'is' if len(missing) == 1 else 'are'} missing", None
    short = [
        f"{name} has {size} bytes, its .metadata says at least {n}"
        for name, n in sorted(need.items())
        if (size := (path / name).stat().st_size) < n
    ]
    if short:
        return f"{some_names(short, 3, '; ')} (cut short)", None
    return "", metadata


def _check_against(
    path: Path,
    info: dict[str, Any],
    stored: dict[str, Any],
    model: nn.Module,
    model_sd: dict[str, Any],
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """What ``load`` checks against the model and the optimizer's groups before anything touches
    the optimizer (whose fresh state takes a step, a collective at stages 1-2): this rank's look,
    which ``_on_every_rank_or_none`` makes every rank's."""
    _check_compatible(f"checkpoint {path}", model, model_sd, _model_entries(path, stored), exact=True)
    _check_ties(path, info, model, model_sd)
    if optimizer is not None:
        _check_optimizer_groups(path, len(optimizer.param_groups), stored)


def _files_and_optimizer(path: Path, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], Any]:
    """What ``load`` checks in the files, and of the optimizer's class, before anything else (this
    rank's look; ``_on_every_rank_or_none`` makes every rank raise together): the checkpoint's
    marker and DCP's metadata, after ``_damage`` found nothing missing."""
    info = _check_complete(path)
    problem, metadata = _damage(path)
    if problem:
        raise ZeroFXError(f"checkpoint {path} is damaged: {problem} (nothing was loaded)")
    if optimizer is not None:
        _refuse_lbfgs(path, optimizer)
    return info, metadata


def _raise_if_damaged(path: Path) -> None:
    """``_damage`` in one process (export)."""
    problem, _ = _damage(path)
    if problem:
        raise ZeroFXError(f"checkpoint {path} is damaged: {problem}")


def _refuse_lbfgs(path: Path, optimizer: torch.optim.Optimizer) -> None:
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ZeroFXError(
            f"checkpoint {path}: zerofx.checkpoint.load cannot read torch.optim.LBFGS's state: LBFGS keeps its "
            "history as vectors flattened over all of a rank's parameters, which do not reshard, and torch's "
            "state-dict helpers step it without the closure it needs. Load the model only "
            "(zerofx.checkpoint.load(path, model)) and start LBFGS afresh (nothing was loaded)"
        )


def _check_optimizer_groups(path: Path, groups: int, stored: dict[str, Any]) -> None:
    """What ``_check_optimizer_state`` refuses that needs no optimizer state (no optimizer state
    saved, another number of parameter groups): checked also before anything makes state for a
    fresh optimizer (NOTE: a load that fails)."""
    if not any(key.startswith("optimizer.") for key in stored):
        raise ZeroFXError(f"checkpoint {path} holds no optimizer state (it was saved without an optimizer)")
    saved = {key.split(".")[2] for key in stored if key.startswith("optimizer.param_groups.")}
    if len(saved) != groups:
        raise ZeroFXError(
            f"checkpoint {path} has {len(saved)} optimizer parameter group(s), this optimizer "
            f"{groups}: build the optimizer with the groups it was saved with (nothing was loaded)"
        )


def _tied_keys(model: nn.Module, keys: Any) -> list[list[str]] | None:
    """The state_dict ``keys`` that name one tensor (tied parameters), in sorted groups of two
    or more (NOTE: tied parameters in a checkpoint); None where the parameters' names do not map
    onto the keys (a wrapper whose ``state_dict`` drops a prefix of its own, as Lightning
    Fabric's module and DDP's ``module.`` do): unknown, so neither recorded nor checked. Wrapper
    prefixes that torch's state-dict helpers leave out (``torch.compile``'s ``_orig_mod``) are
    left out here too."""
    wrappers = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}
    keys = set(keys)
    groups = []
    for names in alias_names(model):
        named = {".".join(part for part in n.split(".") if part not in wrappers) for n in names} & keys
        if not named:
            return None
        if len(named) > 1:
            groups.append(sorted(named))
    return sorted(groups)


def _check_ties(path: Path, info: dict[str, Any], model: nn.Module, keys: Any) -> None:
    """Refuse a model that ties names the checkpoint stored as separate tensors (NOTE: tied
    parameters in a checkpoint); a checkpoint without the record, or a model whose ties cannot be
    mapped onto its keys, is not checked. The reverse (saved tied, loaded untied) reads the same
    values into both tensors: nothing is lost, so it loads."""
    saved = info.get("aliases")
    here = _tied_keys(model, keys)
    if saved is None or here is None:
        return
    saved_groups = [frozenset(g) for g in saved]
    problems = [
        f"this model ties {' and '.join(sorted(g))} (one tensor), which the checkpoint stored as separate tensors"
        for g in map(frozenset, here)
        if not any(g <= other for other in saved_groups)
    ]
    if problems:
        raise ZeroFXError(
            f"checkpoint {path} does not fit this {type(model).__name__}: {some_names(problems, 3, '; ')}: "
            "build the model tied as it was saved (nothing was loaded)"
        )


def _keep_optimizer(optimizer: torch.optim.Optimizer) -> Any:
    """A function that puts ``optimizer`` back as it is now: its attributes (what torch's step at
    lr 0 and zerofx's adoption at a first step add: state, group keys, hooks, a patched ``step``
    and ``zero_grad``, the LR scheduler's ``_opt_called``, zerofx's ``_zerofx`` record), the
    contents of its containers (``state`` and each parameter's entry in it, ``param_groups`` and
    each group, the hook dicts), shallowly: tensors are not copied."""
    attrs = dict(vars(optimizer))
    contents = {
        k: (list(v) if isinstance(v, list) else dict(v)) for k, v in attrs.items() if isinstance(v, (list, dict))
    }
    entries = [(entry, dict(entry)) for entry in optimizer.state.values() if isinstance(entry, dict)]
    groups = [(group, dict(group)) for group in optimizer.param_groups]
    record = attrs.get("_zerofx")
    record_vars = dict(vars(record)) if hasattr(record, "__dict__") else None

    def restore() -> None:
        for key in [k for k in vars(optimizer) if k not in attrs]:
            del vars(optimizer)[key]
        vars(optimizer).update(attrs)
        for key, items in contents.items():
            if isinstance(attrs[key], list):
                attrs[key][:] = items
            else:
                attrs[key].clear()
                attrs[key].update(items)
        for obj, items in [*entries, *groups]:
            obj.clear()
            obj.update(items)
        if record_vars is not None:
            vars(record).clear()
            vars(record).update(record_vars)

    return restore


class _FailedElsewhere(ZeroFXError):
    """Raised on the ranks that learn from an agreement that another rank's load failed."""


@contextlib.contextmanager
def _left_as_it_was_on_failure(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, parameters: bool):
    """Inside, any failure puts ``optimizer`` back as it was on entry. The body calls the function
    it is given right before DCP reads into the tensors: a failure from then on (the tensors
    read in place, partly) also marks the model (``parameters``) and an optimizer that held
    state, and is raised as a ``ZeroFXError`` chained from it. The ranks agree twice, at that
    call and at the end, so that a failure on any rank fails the load on every rank alike
    (NOTE: a load that fails)."""
    restore = _keep_optimizer(optimizer) if optimizer is not None else None
    had_state = optimizer is not None and bool(optimizer.state)
    reading = []

    def agree() -> None:  # this rank got here: did every rank?
        elsewhere = _first_failure("")
        if elsewhere is not None:
            raise _FailedElsewhere(f"rank {elsewhere[0]}: {elsewhere[1]}")

    def begin_reading() -> None:
        agree()
        reading.append(True)

    try:
        yield begin_reading
        agree()
    except BaseException as e:
        if isinstance(e, Exception) and not isinstance(e, _FailedElsewhere):
            # the agreement this rank's peers are in: at the read's start, or after it
            with contextlib.suppress(Exception):
                _first_failure(_reason(e) if reading else _problem(e))
        if restore is not None:
            restore()
        if not reading:
            if isinstance(e, _FailedElsewhere):
                raise ZeroFXError(
                    f"zerofx.checkpoint.load of {path} failed on another rank before anything was read ({e}); "
                    "the model and optimizer were left as they were"
                ) from None
            raise
        reason = str(e) if isinstance(e, _FailedElsewhere) else _reason(e)
        told = []
        if parameters:
            _mark_failed(
                model,
                f"a zerofx.checkpoint.load of {path} into this model failed part-way ({reason}), leaving its "
                "parameters partly overwritten: load again (zerofx.checkpoint.load of a checkpoint that reads, "
                "or model.load_state_dict of every tensor) before using it",
            )
            told.append(
                "the model's tensors are partly overwritten (differently on each rank): its forward and "
                "zerofx.checkpoint.save refuse until a load into it succeeds"
            )
        if had_state:
            _mark_failed(
                optimizer,
                f"a zerofx.checkpoint.load of {path} into this optimizer failed part-way ({reason}), leaving its "
                "state partly overwritten: load again (zerofx.checkpoint.load with it, or "
                "optimizer.load_state_dict) before stepping it",
            )
            told.append("the optimizer's state is partly overwritten: its step refuses until a load into it succeeds")
        elif optimizer is not None:
            told.append("the optimizer was left as it was")
        if not isinstance(e, (Exception, CheckpointException)):
            raise  # KeyboardInterrupt and the like, as they are (the marks are set)
        raise ZeroFXError(
            f"checkpoint {path} could not be read ({reason}): {'; '.join(told)}. Load another checkpoint "
            "(or this one, repaired)"
        ) from e


def _reason(e: BaseException) -> str:
    """A line of what went wrong: the first rank's exception of a DCP ``CheckpointException``."""
    failures = getattr(e, "failures", None) if isinstance(e, CheckpointException) else None
    if failures:
        rank, (exc, _) = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
        e, where = exc, f"rank {rank}: "
    else:
        where = ""
    text = str(e).strip().splitlines()
    line = (text[0] if text else "").split(". ")[0]  # its first sentence (torch's go on with advice)
    return f"{where}{type(e).__name__}: {line[:200]}"


_FAILED = "_zerofx_failed_load"  # a model's or optimizer's attribute: why it refuses (NOTE: a load that fails)
_FAILED_HOOKS = "_zerofx_failed_load_hooks"  # whether it has the hooks that read it (kept: removing a hook
# inside the load_state_dict hooks that clear the mark would change the dict torch iterates over)


def _mark_failed(obj: nn.Module | torch.optim.Optimizer, message: str) -> None:
    vars(obj)[_FAILED] = message
    if vars(obj).get(_FAILED_HOOKS):
        return
    if isinstance(obj, nn.Module):
        obj.register_forward_pre_hook(_refuse_failed, prepend=True, with_kwargs=True)
        obj.register_load_state_dict_post_hook(_loaded_again)
    else:
        obj.register_step_pre_hook(_refuse_failed)
        obj.register_load_state_dict_post_hook(_clear_failed)
    vars(obj)[_FAILED_HOOKS] = True


def _clear_failed(obj: Any) -> None:
    """Remove the mark of a failed load (a load into ``obj`` succeeded)."""
    if obj is not None:
        vars(obj).pop(_FAILED, None)


def _refuse_failed(obj: Any, args: Any, kwargs: Any) -> None:
    """Forward pre-hook of a model, step pre-hook of an optimizer, that a load failed in."""
    message = vars(obj).get(_FAILED)
    if message is not None:
        raise ZeroFXError(message)


def _loaded_again(model: nn.Module, incompatible: Any) -> None:
    """``model.load_state_dict`` of every tensor loads the model again."""
    if not incompatible.missing_keys:
        _clear_failed(model)


def _after_load(model: nn.Module, info: dict[str, Any], parameters_changed: bool = True) -> None:
    runtime = runtime_of(model)
    if runtime is not None:
        if parameters_changed:
            runtime.refresh()  # stages 1 and 2: whole copies from the loaded shards
        if runtime.scaler is not None and info.get("loss_scaler"):
            runtime.scaler.load_state_dict(info["loss_scaler"])


def _load_in_one_process(state: dict[str, Any], reader: dcp.FileSystemReader) -> None:
    """``dcp.load`` with no process group, without DCP's warning that there is none (which is
    the point here, not something the user did)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)


def export_full_state_dict(
    path: str | os.PathLike, out_file: str | os.PathLike | None = None
) -> dict[str, torch.Tensor]:
    """One consolidated, unsharded model ``state_dict`` from a checkpoint (DeepSpeed's zero_to_fp32).

    Runs in a single process, no process group needed. The tensors are the master weights
    (fp32 for a mixed-precision run), loadable by plain ``model.load_state_dict``; the optimizer
    state is not read. Writes it with ``torch.save`` to ``out_file`` when given; returns it.
    """
    path = Path(path)
    identity = _identity(path)  # NOTE: a checkpoint replaced while it is read
    _check_complete(path)
    _raise_if_damaged(path)
    reader = dcp.FileSystemReader(str(path))
    metadata = reader.read_metadata()
    model_sd: dict[str, torch.Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            model_sd[key[len("model.") :]] = torch.empty(item.size, dtype=item.properties.dtype)
    _load_in_one_process({"model": model_sd}, reader)
    _check_unchanged(path, identity, "exporting it", "nothing was written")
    if out_file is not None:
        torch.save(model_sd, out_file)
    return model_sd


# -- checkpoints users take anywhere ----------------------------------------------------------------


def _hf_config(model: nn.Module) -> dict[str, Any] | None:
    """An HF transformers model's config as config.json would hold it (None for other models),
    kept in the completion marker so that :func:`export` can write a folder ``from_pretrained``
    loads without the user finding the config again."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_json_string", None)):
        return None
    out = json.loads(config.to_json_string(use_diff=False))
    if not out.get("architectures"):
        cls = type(model)
        while cls.__name__.startswith("ZeroFX") and cls.__bases__:  # zerofx's sharded subclass
            cls = cls.__bases__[0]
        out["architectures"] = [cls.__name__]
    return out


_FORMATS = {
    # to: (single file, shard file pattern, index file)
    "hf": ("model.safetensors", "model-{i:05d}-of-{n:05d}.safetensors", "model.safetensors.index.json"),
    "torch": ("pytorch_model.bin", "pytorch_model-{i:05d}-of-{n:05d}.bin", "pytorch_model.bin.index.json"),
}


def _model_tensors(path: Path) -> tuple[dcp.FileSystemReader, dict[str, TensorStorageMetadata]]:
    reader = dcp.FileSystemReader(str(path))
    return reader, _model_entries(path, reader.read_metadata().state_dict_metadata)


def _model_entries(path: Path, stored: dict[str, Any]) -> dict[str, TensorStorageMetadata]:
    """The model's tensors among a checkpoint's stored entries, by state_dict key."""
    tensors = {
        key[len("model.") :]: item
        for key, item in stored.items()
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
    }
    if not tensors:
        raise ZeroFXError(f"checkpoint {path} holds no model tensors (was it written by zerofx.checkpoint.save?)")
    return tensors


def _exported_dtype(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype :func:`export` writes a tensor stored as ``stored`` in: ``dtype`` casts floating-point
    tensors only, as ``Module.to(dtype)`` and HF's save_pretrained do; integer and bool tensors
    (BatchNorm's ``num_batches_tracked``, HF's ``position_ids``) keep their dtype and values."""
    return dtype if dtype is not None and stored.is_floating_point else stored


def _plan_files(
    tensors: dict[str, TensorStorageMetadata], dtype: torch.dtype | None, max_shard_bytes: int
) -> list[list[str]]:
    """Consecutive keys (the model's state_dict order) in files of at most ``max_shard_bytes``
    (a tensor larger than that is a file of its own, as in HF's save_pretrained)."""

    def nbytes(key: str) -> int:
        return tensors[key].size.numel() * _exported_dtype(tensors[key].properties.dtype, dtype).itemsize

    return pack_consecutive(list(tensors), nbytes, max_shard_bytes)


def export(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    to: str = "hf",
    max_shard_bytes: int = 2 << 30,
    dtype: torch.dtype | None = None,
    config: Any = None,
) -> Path:
    """Write the model of checkpoint ``path`` unsharded into a new folder ``out``, one file at a time.

    ``to="hf"``: safetensors files (``model.safetensors``, or ``model-00001-of-0000N.safetensors``
    plus ``model.safetensors.index.json`` past ``max_shard_bytes``), loadable by HF's
    ``from_pretrained(out)`` and by ``safetensors.torch.load_file``; ``to="torch"``: the same
    layout in ``torch.save`` files (``pytorch_model*.bin``). ``config.json`` is written from
    ``config`` (an HF config, a dict or a config.json path) or else from the HF config the
    checkpoint recorded when an HF model was saved. ``dtype`` casts the floating-point tensors on
    the way (default: the stored master dtype, fp32 for a mixed-precision run); integer and bool
    tensors keep their dtype and values, as in HF's save_pretrained.

    One process, no process group. Each output file is read from the checkpoint (DCP reads just
    those tensors' chunks from whichever rank's file holds them) and written before the next is
    read, so memory stays near one output file, never the whole model (DeepSpeed's zero_to_fp32
    holds the whole model). Writes into a temporary folder renamed into place at the end: an
    error or a crash leaves no ``out``; an existing ``out`` is an error, never overwritten.
    """
    if to not in _FORMATS:
        raise ZeroFXError(f"export: to={to!r}; choose one of {sorted(_FORMATS)}")
    if max_shard_bytes < 1:
        raise ZeroFXError(f"export: max_shard_bytes must be positive, got {max_shard_bytes}")
    path, out = Path(path), Path(out)
    identity = _identity(path)  # NOTE: a checkpoint replaced while it is read
    info = _check_complete(path)
    _raise_if_damaged(path)
    if out.exists():
        raise ZeroFXError(f"export: {out} already exists; choose a new folder (nothing was written)")
    hf_config = _config_dict(config) if config is not None else info.get("hf_config")
    reader, tensors = _model_tensors(path)
    groups = _plan_files(tensors, dtype, max_shard_bytes)
    single, pattern, index_name = _FORMATS[to]
    names = [single] if len(groups) == 1 else [pattern.format(i=i + 1, n=len(groups)) for i in range(len(groups))]
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir(parents=True)
    try:
        weight_map: dict[str, str] = {}
        total = 0
        for name, keys in zip(names, groups):
            total += _write_file(tmp / name, to, keys, tensors, reader, dtype)
            _check_unchanged(path, identity, "exporting it", "nothing was written")
            weight_map.update(dict.fromkeys(keys, name))
        if len(names) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / index_name).write_text(json.dumps(index, indent=2))
        if hf_config is not None:
            stored_as = str(_float_dtype(tensors, dtype)).removeprefix("torch.")
            keys = [k for k in ("dtype", "torch_dtype") if k in hf_config] or ["dtype"]
            hf_config = {**hf_config, **dict.fromkeys(keys, stored_as)}
            (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        for f in tmp.iterdir():
            if f.suffix == ".json" or to == "torch":
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        _fsync_dir(tmp)
        _check_unchanged(path, identity, "exporting it", "nothing was written")
        os.rename(tmp, out)  # fails if a non-empty out appeared meanwhile (POSIX rename)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _float_dtype(tensors: dict[str, TensorStorageMetadata], dtype: torch.dtype | None) -> torch.dtype:
    """config.json's ``dtype``: that of the exported floating-point tensors (HF's save_pretrained
    records its first floating-point parameter's), never an integer buffer's that comes first."""
    if dtype is not None:
        return dtype
    floats = (t.properties.dtype for t in tensors.values() if t.properties.dtype.is_floating_point)
    return next(floats, torch.float32)


def _read_tensors(
    keys: list[str], tensors: dict[str, TensorStorageMetadata], reader: dcp.FileSystemReader, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """The whole tensors ``keys`` of the checkpoint's model (DCP reads their chunks from every
    rank's file), the floating-point ones cast to ``dtype`` (``_exported_dtype``)."""
    part = {k: torch.empty(tensors[k].size, dtype=tensors[k].properties.dtype) for k in keys}
    _load_in_one_process({"model": part}, reader)
    return {k: v.to(_exported_dtype(v.dtype, dtype)) for k, v in part.items()}


# safetensors' dtype names (its format: 8-byte little-endian header length, a JSON header of
# dtype / shape / byte offsets per tensor, then the tensors' bytes)
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def _write_file(
    file: Path,
    to: str,
    keys: list[str],
    tensors: dict[str, TensorStorageMetadata],
    reader: dcp.FileSystemReader,
    dtype: torch.dtype | None,
) -> int:
    """Write one output file; returns its tensors' bytes.

    torch files hold the file's tensors at once (``torch.save`` of a dict). safetensors files
    are written here rather than by ``safetensors.torch.save_file``, which first copies every
    tensor into one bytes object (twice the file in memory): the header follows from the
    checkpoint's metadata alone, then each tensor is read from the checkpoint and its bytes
    written straight from the tensor, so memory holds one tensor, not one file. Reading is
    left to the safetensors library (the tests load these files with it)."""
    if to == "torch":
        part = _read_tensors(keys, tensors, reader, dtype)
        torch.save(part, file)
        return sum(v.numel() * v.element_size() for v in part.values())
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for k in keys:
        kind = _exported_dtype(tensors[k].properties.dtype, dtype)
        if kind not in _SAFETENSORS_DTYPES:
            raise ZeroFXError(f"export: {k} is {kind}, which safetensors cannot hold")
        nbytes = tensors[k].size.numel() * kind.itemsize
        header[k] = {
            "dtype": _SAFETENSORS_DTYPES[kind],
            "shape": list(tensors[k].size),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(file, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for k in keys:
            (value,) = _read_tensors([k], tensors, reader, dtype).values()
            f.write(bytes_view(value.contiguous()))
            del value
        f.flush()
        os.fsync(f.fileno())
    return offset


def _config_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        try:
            return json.loads(Path(config).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ZeroFXError(f"export: cannot read config {config}: {e}") from None
    if callable(getattr(config, "to_json_string", None)):
        return json.loads(config.to_json_string(use_diff=False))
    raise ZeroFXError(f"export: config must be an HF config, a dict or a config.json path, got {type(config).__name__}")


def _check_compatible(
    what: str,
    model: nn.Module,
    state: dict[str, Any],
    stored: dict[str, TensorStorageMetadata],
    exact: bool = False,
) -> None:
    """Every tensor ``state`` (the model's state_dict) needs is stored with its shape, and with
    ``exact`` (a checkpoint of zerofx's own, written from a model's state_dict) nothing else is
    stored; else one error naming the differences, raised before anything is read into the model."""
    problems = []
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        item = stored.get(key)
        if item is None:
            problems.append(f"{key} is missing")
        elif tuple(item.size) != tuple(value.shape):
            problems.append(f"{key} has shape {tuple(item.size)} there, {tuple(value.shape)} in the model")
    if exact:
        problems += [f"{key} is not in the model" for key in stored if key not in state]
    if problems:
        shown = some_names(problems, 5, "; ")
        raise ZeroFXError(f"{what} does not fit this {type(model).__name__}: {shown} (the model was not changed)")


def _check_optimizer_state(path: Path, request: dict[str, Any], stored: dict[str, Any]) -> None:
    """Fit the optimizer state ``load`` reads (``request``, torch's fqn-keyed optimizer state
    dict) to what the checkpoint holds (NOTE: optimizer state that does not exist yet): a
    parameter with no state there is left out, to have none after the load; state of another
    optimizer, of parameters this optimizer does not hold, or another number of parameter
    groups is one ``ZeroFXError``, raised before anything is read."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    _check_optimizer_groups(path, len(request["param_groups"]), stored)
    saved = {key for key in stored if key.startswith("optimizer.state.")}
    claimed: set[str] = set()
    problems = []
    for fqn in list(request["state"]):
        prefix = f"optimizer.state.{fqn}."
        here = set(flatten_state_dict({"optimizer": {"state": {fqn: request["state"][fqn]}}})[0])
        there = {key for key in saved if key.startswith(prefix)}
        claimed |= there
        if not there:
            del request["state"][fqn]  # no state before the save: none after the load
        elif here != there:
            names = lambda keys: sorted(k[len(prefix) :] for k in keys)  # noqa: E731
            problems.append(f"{fqn} has {names(there)} there, {names(here)} here")
    if saved - claimed:
        problems.append(
            f"state of {len(saved - claimed)} value(s) for parameters this optimizer does not hold "
            f"({some_names(sorted(k.removeprefix('optimizer.state.') for k in saved - claimed), 3)})"
        )
    if problems:
        raise ZeroFXError(
            f"checkpoint {path}: its optimizer state does not fit this optimizer (another optimizer, "
            f"or other parameters): {some_names(problems, 4, '; ')} (nothing was loaded)"
        )


def _request_saved_group_keys(request: dict[str, Any], metadata: Any) -> None:
    """Ask DCP for every parameter-group key the checkpoint holds, also those this optimizer's
    groups lack (``initial_lr``, which an LR scheduler adds before the save): DCP reads only the
    keys requested, and torch's ``optimizer.load_state_dict`` restores all of a saved group's keys
    but ``params``. Each missing key gets a placeholder the read replaces; the key paths are DCP's
    own (``planner_data``), else the stored names split at their dots. After
    ``_check_optimizer_state`` (the same number of groups)."""
    paths = getattr(metadata, "planner_data", None) or {}
    groups = request["param_groups"]
    had = [set(group) for group in groups]
    for key in metadata.state_dict_metadata:
        if not key.startswith("optimizer.param_groups."):
            continue
        path = tuple(paths.get(key) or key.split("."))
        if len(path) < 4 or not all(isinstance(part, str) for part in path[3:]):
            continue  # a list inside a group: left to the optimizer's own value, as before
        index = int(path[2])
        if path[3] in had[index]:
            continue
        node = groups[index]
        for part in path[3:-1]:
            node = node.setdefault(part, {})
        stored = metadata.state_dict_metadata[key]
        # a tensor value (a tensor lr's initial_lr) is read into a tensor of its size; others as bytes
        size = getattr(stored, "size", None)
        node[path[-1]] = None if size is None else torch.empty(size, dtype=stored.properties.dtype)


def _init_unsaved_buffers(model: nn.Module) -> None:
    """A model built on the meta device (zerofx/sharding.py, NOTE: models built on meta) has
    buffers no checkpoint holds (non-persistent: HF's rotary ``inv_freq``). For an HF model,
    its own ``_init_weights`` recomputes them, module by module, for modules that own no
    parameters (so nothing loaded is overwritten); other models set theirs and call ``mark_loaded``."""
    runtime = runtime_of(model)
    init = getattr(model, "_init_weights", None)
    if runtime is None or not runtime.unloaded or not callable(init):
        return
    saved = set(model.state_dict())
    done = []
    for prefix, module in model.named_modules():
        names = [f"{prefix}.{n}" if prefix else n for n, b in module._buffers.items() if b is not None]
        unsaved = [n for n in names if n in runtime.unloaded and n not in saved]
        if unsaved and not any(True for _ in module.parameters(recurse=False)):
            with torch.no_grad():
                init(module)
            done += names
    mark_loaded(model, done)


_HF_SINGLE, _HF_INDEX = "model.safetensors", "model.safetensors.index.json"


def _hf_weight_files(path: Path) -> list[str]:
    """The safetensors files of the HF folder ``path`` that ``from_pretrained`` reads, by name:
    ``model.safetensors`` when it is there (transformers looks for it first), else those
    ``model.safetensors.index.json`` names. Each file's keys are checked against the index's
    ``weight_map`` and against the other files' (headers only): a tensor the index puts in
    another file, or found in two files, is an error naming it."""
    from safetensors import safe_open

    found = sorted(f.name for f in path.glob("*.safetensors")) if path.is_dir() else []
    if not found:
        raise ZeroFXError(f"load_hf: {path} is not a folder with .safetensors files")
    if (path / _HF_SINGLE).is_file():
        return [_HF_SINGLE]
    if not (path / _HF_INDEX).is_file():
        raise ZeroFXError(
            f"load_hf: {path} has neither {_HF_SINGLE} nor {_HF_INDEX}, the files from_pretrained reads "
            f"(it holds {some_names(found, 3)}): name the weights {_HF_SINGLE}, or add the index"
        )
    try:
        weight_map = json.loads((path / _HF_INDEX).read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not an object of file names")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ZeroFXError(
            f"load_hf: {path / _HF_INDEX} cannot be read as an HF index ({type(e).__name__}: {e})"
        ) from None
    names = sorted(set(weight_map.values()))
    bad = [n for n in names if Path(n).name != n or not n.endswith(".safetensors")]
    missing = [n for n in names if n not in bad and not (path / n).is_file()]
    if bad or missing:
        what = [f"{n} (not a .safetensors file of the folder)" for n in bad] + [f"{n} (missing)" for n in missing]
        raise ZeroFXError(f"load_hf: {path / _HF_INDEX} names {some_names(what, 3, '; ')}")
    held: dict[str, str] = {}
    problems = []
    for name in names:
        with safe_open(str(path / name), framework="pt") as f:
            keys = list(f.keys())
        for key in keys:
            if key in held:
                problems.append(f"{key} is in {held[key]} and in {name}")
            elif weight_map.get(key, name) != name:
                problems.append(f"{key} is in {name}, which the index does not name for it ({weight_map[key]})")
            held.setdefault(key, name)
    problems += [
        f"{key} is not in {name}, which the index names for it" for key, name in weight_map.items() if key not in held
    ]
    if problems:
        raise ZeroFXError(
            f"load_hf: {path} does not hold each tensor once, where its {_HF_INDEX} says: "
            f"{some_names(problems, 3, '; ')} (nothing was loaded)"
        )
    return names


def load_hf(path: str | os.PathLike, model: nn.Module) -> None:
    """Load HF safetensors weights (a ``save_pretrained`` or :func:`export` folder) into ``model``;
    a collective when ``model`` is sharded.

    The files read are those HF's ``from_pretrained`` reads: ``model.safetensors`` when there is
    one, else the files ``model.safetensors.index.json`` names, each tensor from the file the
    index names for it; other ``.safetensors`` files in the folder (a stale save, adapters) are
    not read, and a tensor in two of the files read is an error.

    Through DCP's ``HuggingFaceStorageReader``: every rank reads only the rows of its own shards
    out of the files, into the model's own tensors, so no rank holds the whole checkpoint (the
    transient is one safetensors file at a time, which the reader holds while it slices it). With
    a model built on the meta device (zerofx/sharding.py, NOTE: models built on meta) the whole
    model never exists on any rank. Works before
    or after ``zerofx.compile``, at any stage and mesh; stored dtypes are converted to the
    model's. Keys and shapes are checked first: a checkpoint of another model is one error
    naming what differs, with the model untouched. Tensors the model ties to another (HF leaves
    ``lm_head.weight`` out when it is the embedding) are read through the tensor they share.
    """
    try:
        import safetensors  # noqa: F401  (the reader imports it lazily: fail here, clearly)
        from torch.distributed.checkpoint import HuggingFaceStorageReader
    except ImportError:
        raise ZeroFXError("load_hf reads safetensors: pip install 'zerofx[hf]' (or safetensors)") from None
    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="zerofx-load_hf-") as chosen:

        def files() -> tuple[Any, dict[str, TensorStorageMetadata]]:
            # DCP's reader indexes every *.safetensors file of its folder: give it a folder of
            # links to the files from_pretrained reads, and only those
            for name in _hf_weight_files(path):
                os.symlink((path / name).resolve(), Path(chosen) / name)
            reader = HuggingFaceStorageReader(chosen)
            metadata = reader.read_metadata().state_dict_metadata
            return reader, {k: v for k, v in metadata.items() if isinstance(v, TensorStorageMetadata)}

        reader, stored = _on_every_rank_or_none(files)
        _load_hf_files(path, model, reader, stored)


def _load_hf_files(path: Path, model: nn.Module, reader: Any, stored: dict[str, TensorStorageMetadata]) -> None:
    """``load_hf``'s read of ``stored`` through ``reader`` into ``model``."""
    # the model's own tensors (a state_dict shares their storage), loaded in place: DCP's
    # get/set_model_state_dict would add two transient copies of every shard
    state = model.state_dict()
    # a tied parameter missing from the files is loaded through the name that is there
    for names in alias_names(model):
        if names & stored.keys():
            for n in names - stored.keys():
                state.pop(n, None)
    _on_every_rank_or_none(lambda: _check_compatible(f"checkpoint {path}", model, state, stored))
    with _left_as_it_was_on_failure(path, model, None, parameters=True) as reading:
        _init_unsaved_buffers(model)
        reading()
        dcp.load(state, storage_reader=reader)
        model.load_state_dict(state, strict=False)  # a no-op copy where storage is shared; stages 1-2 refresh here
    _clear_failed(model)
    mark_loaded(model, state)
