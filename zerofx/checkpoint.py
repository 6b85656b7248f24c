"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), written crash-safely.

    zerofx.checkpoint.save("ckpt/step100", model, optimizer, extra={"step": 100})   # every rank
    extra = zerofx.checkpoint.load("ckpt/step100", model, optimizer)                 # every rank
    zerofx.checkpoint.export_full_state_dict("ckpt/step100", "model.pt")              # one process

What is saved is what torch's ``torch.distributed.checkpoint.state_dict`` helpers return for
the model and optimizer: parameters and optimizer state are DTensors, so each rank writes only
its shards and DCP records their global shapes and offsets. That is what makes loading on a
different world size or mesh (resharding) work without any zerofx code: DCP reads every rank's
new shards from whichever files hold them. It also makes a checkpoint portable across ZeRO
stages, whose parameters are the same ``Shard(0)`` DTensors (``zerofx.runtime.params``). After loading,
stages 1 and 2 refresh their whole copies (a ``load_state_dict`` post-hook).

# NOTE: crash-safe writes
A checkpoint is loadable only if it is complete. ``save`` writes into a fresh temporary folder
next to the target, waits for every rank, and only then has rank 0 write the completion marker
(``ZEROFX_COMPLETE``: a JSON file with the world size, the loss-scaler state and ``extra``,
fsynced) and rename the folder into place. A crash before the rename leaves only a temporary
folder (never the target); ``load`` refuses any folder without the marker with an error saying
so. Replacing an existing checkpoint moves the old one aside first, so at no instant is a
half-written folder under the target name. Assumes, as DCP's FileSystemWriter does, a file
system every rank sees.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from zerofx.errors import ZeroFXError
from zerofx.runtime.params import runtime_of

__all__ = ["save", "load", "export_full_state_dict", "COMPLETE_MARKER"]

COMPLETE_MARKER = "ZEROFX_COMPLETE"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _same_on_every_rank(value: str) -> str:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    # tensors, not broadcast_object_list: object collectives need NumPy, which zerofx does not
    data = torch.tensor(list(value.encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    dist.broadcast(size, src=0)
    buf = data if dist.get_rank() == 0 else torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return bytes(buf.tolist()).decode()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save ``model`` (and ``optimizer``) sharded to the folder ``path``; a collective.

    ``extra`` is JSON-serializable metadata (say, the step) returned by :func:`load`. An
    existing checkpoint at ``path`` is replaced only once the new one is complete.
    """
    path = Path(path)
    try:
        extra_json = json.dumps(extra or {})
    except TypeError as e:
        raise ZeroFXError(f"checkpoint extra must be JSON-serializable: {e}") from e
    tmp = path.parent / _same_on_every_rank(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    if _rank() == 0:
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(_state(model, optimizer), checkpoint_id=str(tmp))
    _barrier()  # every rank's shards and DCP's metadata are on disk
    if _rank() == 0:
        runtime = runtime_of(model)
        scaler = runtime.scaler.state_dict() if runtime is not None and runtime.scaler is not None else None
        marker = {
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "loss_scaler": scaler,
            "extra": json.loads(extra_json),
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
    _barrier()
    return path


def _check_complete(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise ZeroFXError(f"checkpoint {path} does not exist (or is not a folder)")
    marker = path / COMPLETE_MARKER
    if not marker.is_file():
        raise ZeroFXError(
            f"checkpoint {path} is incomplete: it has no {COMPLETE_MARKER} marker, so its writing never finished "
            "(a crash or interruption during zerofx.checkpoint.save, or a folder zerofx did not write); "
            "refusing to load it"
        )
    return json.loads(marker.read_text())


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` into ``model`` (and ``optimizer``); a collective.

    Works across world sizes and meshes (DCP reshards). Returns the ``extra`` it was saved with.
    """
    path = Path(path)
    info = _check_complete(path)
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    runtime = runtime_of(model)
    if runtime is not None:
        runtime.refresh()  # stages 1 and 2: whole copies from the loaded shards
        if runtime.scaler is not None and info.get("loss_scaler"):
            runtime.scaler.load_state_dict(info["loss_scaler"])
    return info["extra"]


def export_full_state_dict(
    path: str | os.PathLike, out_file: str | os.PathLike | None = None
) -> dict[str, torch.Tensor]:
    """One consolidated, unsharded model ``state_dict`` from a checkpoint (DeepSpeed's zero_to_fp32).

    Runs in a single process, no process group needed. The tensors are the master weights
    (fp32 for a mixed-precision run), loadable by plain ``model.load_state_dict``; the optimizer
    state is not read. Writes it with ``torch.save`` to ``out_file`` when given; returns it.
    """
    path = Path(path)
    _check_complete(path)
    reader = dcp.FileSystemReader(str(path))
    metadata = reader.read_metadata()
    model_sd: dict[str, torch.Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            model_sd[key[len("model.") :]] = torch.empty(item.size, dtype=item.properties.dtype)
    dcp.load({"model": model_sd}, storage_reader=reader, no_dist=True)
    if out_file is not None:
        torch.save(model_sd, out_file)
    return model_sd
