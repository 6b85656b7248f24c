"""zerofx.offload_optimizer's windowed step: which optimizers step in windows, windows every rank
agrees on, and a step that fails at the disk tier (zerofx/runtime/offload_store.py, NOTE: windows
every rank agrees on; NOTE: a step that cannot leave half its windows stepped)."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import zerofx
from zerofx import ZeroFXError
from zerofx.runtime import offload_store
from zerofx.runtime.offload_store import place_model_state


class GlobalNormSGD(torch.optim.Optimizer):
    """SGD clipping by the global gradient norm inside ``step`` (timm's Lamb, apex's FusedLAMB)."""

    def __init__(self, params, lr=1e-2, max_grad_norm=0.05):
        super().__init__(params, dict(lr=lr, max_grad_norm=max_grad_norm))

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in grads]))
        for g in self.param_groups:
            clip = (total / g["max_grad_norm"]).clamp(min=1.0)
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad / clip, alpha=-g["lr"])


class GroupCounterSGD(torch.optim.Optimizer):
    """Momentum SGD warmed up by a step counter in its param group (schedule-free's group['k'])."""

    def __init__(self, params, lr=1e-2, warmup=10):
        super().__init__(params, dict(lr=lr, warmup=warmup))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            g["k"] = g.get("k", 0) + 1
            lr = g["lr"] * min(1.0, g["k"] / g["warmup"])
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "buf" not in st:
                    st["buf"] = torch.zeros_like(p)
                st["buf"].mul_(0.9).add_(p.grad)
                p.add_(st["buf"], alpha=-lr)


class Net(nn.Module):
    """Uneven shards over 2 ranks (5 rows), and parameters that take a window each under a small cap."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(16, 5, bias=False)
        self.l2 = nn.Linear(5, 16, bias=False)
        self.l3 = nn.Linear(16, 16)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x))))).pow(2).mean()


def _model(mesh, folder=None, tier="disk", cap=1024):
    torch.manual_seed(0)
    model = Net()
    options = zerofx.Options(
        **({} if folder is None else {"offload_optimizer": tier, "offload_dir": str(folder), "host_memory_cap": cap})
    )
    zerofx.shard(model, mesh, options)
    if folder is not None:
        place_model_state(model, options)
    return model


def _batch(step, rank=0):
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(step * 10 + rank))


def _full(model):
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def _train(model, opt, steps, rank=0):
    for s in range(steps):
        model(_batch(s, rank)).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("cls", [GlobalNormSGD, GroupCounterSGD])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_an_optimizer_outside_elementwise_steps_its_whole_groups_at_once(one_rank, tmp_path, cls, tier):
    """Narrowed to a window, a global-norm clip clipped by the window's norm and a group-level
    counter counted once per window (k=9 after 3 steps of 3 windows): such a class now steps its
    whole groups in one window, as in memory, bit for bit."""
    ref = _model(one_rank)
    ref_opt = cls(ref.parameters())
    _train(ref, ref_opt, 3)
    model = _model(one_rank, tmp_path, tier)
    opt = zerofx.offload_optimizer(cls(model.parameters()))
    assert len(offload_store._windows(list(model.parameters()), 1024 // 8)) > 1  # an elementwise one would window
    _train(model, opt, 3)
    assert [g.get("k") for g in opt.param_groups] == [g.get("k") for g in ref_opt.param_groups]
    for p, q in zip(_full(model), _full(ref)):
        assert torch.equal(p, q)
    if tier == "disk" and cls is GroupCounterSGD:  # its state still went to the files
        store = offload_store.state_store(next(model.parameters()))[1]
        assert all(opt.state[p]["buf"] in store for p in model.parameters())


def _uneven_ranks(rank, world, folder):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    windows = []
    real = offload_store._windows
    offload_store._windows = lambda *a, **k: windows.append(len(real(*a, **k))) or real(*a, **k)
    out = {"local_rows": [p.to_local().shape[0] for p in _model(mesh).parameters()]}
    for name, cls in (("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2)), ("global_norm", GlobalNormSGD)):
        ref = _model(mesh)
        ref_opt = cls(ref.parameters())
        _train(ref, ref_opt, 2, rank)
        model = _model(mesh, f"{folder}/{name}-{rank}", cap=8000)
        opt = zerofx.offload_optimizer(cls(model.parameters()))
        _train(model, opt, 2, rank)
        out[name] = all(torch.equal(p, q) for p, q in zip(_full(model), _full(ref)))
    out["windows"] = windows
    # "auto" near the cap: 3x this rank's shard bytes is 2688 on rank 0 and 2496 on rank 1
    auto = zerofx.Options(offload_optimizer="auto", offload_dir=f"{folder}/auto-{rank}", host_memory_cap=2600)
    out["auto"] = place_model_state(zerofx.shard(Net(), mesh, auto), auto)
    return out


def test_every_rank_steps_the_same_windows_over_uneven_shards(tmp_path):
    """With 5 rows over 2 ranks, windows packed from this rank's shard sizes were 2 on one rank
    and 1 on the other: a step that communicates per window (a global norm through DTensor)
    then hung. Windows are packed from the largest shard now, the same on every rank."""
    from tests.multirank import run_ranks

    results = run_ranks(_uneven_ranks, 2, str(tmp_path), timeout=120)
    assert [r["local_rows"] for r in results] == [[3, 8, 8, 8], [2, 8, 8, 8]]
    assert results[0]["windows"] == results[1]["windows"] and max(results[0]["windows"]) > 1, results
    assert all(r["adamw"] and r["global_norm"] for r in results), results
    # offload_optimizer="auto" picked disk on one rank and host on the other (whose first step then
    # skipped the disk ranks' agreement): it is decided from the largest shards, alike
    assert [r["auto"] for r in results] == ["disk", "disk"], results


def _full_disk_on_rank_one(rank, world, folder, kind):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    if rank == 1:

        def full(self, t, reserved=None):
            if rank == 1 and kind == "runtime":  # not an OSError: it escaped the agreement
                raise RuntimeError("mmap: cannot allocate memory")
            raise ZeroFXError(f"offload folder {folder!r}: no room for 64 more bytes")

        offload_store.DiskStore.adopt = full
    try:
        _model(mesh, f"{folder}/{rank}")
    except (ZeroFXError, RuntimeError) as e:
        return str(e)
    return None


def test_a_disk_that_fails_on_one_rank_at_compile_stops_every_rank(tmp_path):
    """A full disk on one rank raised there alone while placing the shards; the other ranks went
    on, to wait at their next collective for a rank that had stopped."""
    from tests.multirank import run_ranks

    for kind in ("full", "runtime"):
        rank0, rank1 = run_ranks(_full_disk_on_rank_one, 2, str(tmp_path), kind, timeout=120)
        said = "mmap: cannot allocate memory" if kind == "runtime" else f"offload folder {str(tmp_path)!r}: no room"
        assert rank1.startswith(said), (kind, rank1)
        assert rank0 is not None and "another rank could not put its parameter shards in files" in rank0, rank0


def _state_steps(opt):
    return sorted({float(s["step"]) for s in opt.state.values()})


def _stepped_once_after(one_rank, tmp_path, fail, restore):
    """One AdamW step that fails as ``fail`` makes it, then the retry: nothing stepped by the
    failure, and the retry's parameters are those of one step."""
    ref = _model(one_rank)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train(ref, ref_opt, 1)
    folder = tmp_path / "offload"
    model = _model(one_rank, folder)
    opt = zerofx.offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    before = _full(model)
    model(_batch(0)).backward()
    with pytest.raises(ZeroFXError) as failed:
        fail(folder)
        opt.step()
    restore(folder)
    assert all(torch.equal(p, q) for p, q in zip(_full(model), before)), "the failed step changed parameters"
    assert _state_steps(opt) in ([], [0.0])
    opt.step()
    assert _state_steps(opt) == [1.0]
    assert all(torch.equal(p, q) for p, q in zip(_full(model), _full(ref)))
    store = offload_store.state_store(next(model.parameters()))[1]
    assert all(opt.state[p]["exp_avg"] in store for p in model.parameters())
    return str(failed.value)


def test_a_full_disk_at_the_first_step_steps_nothing(one_rank, tmp_path, monkeypatch):
    """The state's files were made window by window, after each window stepped: a disk filling
    up at the third file left two windows stepped, and the retry stepped them twice (Adam step
    counts [1, 2]). Every file is made before any window steps now."""
    from zerofx.ir import offload_ops

    real, made = offload_ops._fallocate, []

    def fills_up(fd, nbytes):
        made.append(nbytes)
        if len(made) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, nbytes)

    def fail(folder):
        monkeypatch.setattr(offload_ops, "_fallocate", fills_up)

    message = _stepped_once_after(one_rank, tmp_path, fail, lambda folder: monkeypatch.undo())
    assert "no room" in message and "offload" in message


def test_an_offload_folder_removed_after_compile_is_an_error_naming_it(one_rank, tmp_path):
    """A folder removed under the model: the error was a bare FileNotFoundError naming a random
    zerofx-XXXX.bin, raised mid-step."""
    message = _stepped_once_after(one_rank, tmp_path, shutil.rmtree, lambda folder: folder.mkdir())
    assert f"offload_dir={str(tmp_path / 'offload')!r}" in message and "zerofx-" not in message, message


def test_a_step_failing_after_a_window_stepped_refuses_the_next(one_rank, tmp_path, monkeypatch):
    """A failure after some windows stepped (simulated: parking the second window) marks the
    optimizer: its next step refuses, saying the last one was partly applied, instead of
    stepping the first windows twice; load_state_dict clears the mark."""
    model = _model(one_rank, tmp_path)
    opt = zerofx.offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(model, opt, 1)
    saved = opt.state_dict()
    real, calls = offload_store._park, []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.EIO, "simulated")
        return real(*args, **kwargs)

    monkeypatch.setattr(offload_store, "_park", second_fails)
    model(_batch(1)).backward()
    with pytest.raises(OSError, match="simulated"):
        opt.step()
    monkeypatch.undo()
    with pytest.raises(ZeroFXError, match=r"failed part-way \(OSError: .*simulated\).*stepping again would step"):
        opt.step()
    opt.load_state_dict(saved)
    opt.step()  # a consistent state again: it steps
