"""What a zerofx.checkpoint.load that fails leaves behind (zerofx/checkpoint.py, NOTE: a load
that fails; NOTE: tied parameters in a checkpoint): a refusal leaves the model and optimizer as
they were, a damaged folder is named before anything is read, a read that fails part-way marks
the model (and an optimizer that held state) until a load succeeds. One process, except the
last test (2 gloo ranks, a zerofx model at stage 2).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import zerofx.checkpoint
from tests.multirank import run_ranks
from tests.test_checkpoint import _equal, _model, _train
from zerofx import ZeroFXError


def _groups(opt):
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _zero_the_tail(path: Path) -> None:
    """Damage a shard file inside, keeping its size: DCP reads its first tensors, then fails."""
    n = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(n // 2)
        f.write(b"\0" * (n - n // 2))


_SGD = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
_ADAMW = lambda m: torch.optim.AdamW(m.parameters(), lr=0.1)  # noqa: E731
_AMSGRAD = lambda m: torch.optim.Adam(m.parameters(), lr=0.1, amsgrad=True)  # noqa: E731


@pytest.mark.parametrize(
    "saved_with, loaded_into, load_model",
    [(_SGD, _ADAMW, True), (_ADAMW, _AMSGRAD, True), (_SGD, _ADAMW, False)],
    ids=["sgd_into_adamw", "adamw_into_amsgrad", "sgd_into_adamw_optimizer_only"],
)
def test_a_refused_load_leaves_a_fresh_optimizer_fresh(tmp_path, saved_with, loaded_into, load_model):
    """torch's state-dict helpers give a fresh optimizer state by a step at lr 0; a load refused
    after that (another optimizer's state) left Adam's step count at 1, so "resume, else start
    fresh" trained differently from a clean start. Now the optimizer is as it was, and trains so."""
    model = _model(0)
    opt = saved_with(model)
    _train(model, opt, 1, seed=3)
    zerofx.checkpoint.save(tmp_path / "ck", model, opt)

    clean, tried = _model(1), _model(1)
    clean_opt, tried_opt = loaded_into(clean), loaded_into(tried)
    attrs, groups = set(vars(tried_opt)), _groups(tried_opt)
    with pytest.raises(ZeroFXError, match=r"does not fit this optimizer.*\(nothing was loaded\)"):
        zerofx.checkpoint.load(tmp_path / "ck", tried, tried_opt, load_model=load_model)
    assert not tried_opt.state and set(vars(tried_opt)) == attrs and _groups(tried_opt) == groups
    assert all(p.grad is None for p in tried.parameters())
    _train(clean, clean_opt, 3, seed=5)
    _train(tried, tried_opt, 3, seed=5)
    assert _equal(clean, tried)


def test_another_models_checkpoint_leaves_the_optimizer_unstepped(tmp_path):
    saved = _model(0)
    zerofx.checkpoint.save(tmp_path / "ck", saved, _SGD(saved))
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = _ADAMW(other)
    with pytest.raises(ZeroFXError, match=r"does not fit this Sequential: 0\.weight has shape"):
        zerofx.checkpoint.load(tmp_path / "ck", other, opt)
    assert not opt.state


def test_lbfgs_is_refused_before_anything_is_touched(tmp_path):
    """torch's helper stepped LBFGS without a closure (TypeError: 'NoneType' object is not
    callable), leaving its lr at 0; now one error naming LBFGS, the optimizer as it was."""
    model = _model(0)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    x = torch.randn(3, 4)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    zerofx.checkpoint.save(tmp_path / "ck", model, opt)
    other = _model(1)
    fresh = torch.optim.LBFGS(other.parameters(), lr=0.5, max_iter=3)
    with pytest.raises(ZeroFXError, match=r"cannot read torch\.optim\.LBFGS's state.*Load the model only"):
        zerofx.checkpoint.load(tmp_path / "ck", other, fresh)
    assert not fresh.state and fresh.param_groups[0]["lr"] == 0.5
    assert _equal(other, _model(1))
    zerofx.checkpoint.load(tmp_path / "ck", other)  # the model alone loads
    assert _equal(other, model)


def test_a_missing_or_short_file_is_named_before_anything_is_read(tmp_path):
    model, opt = _model(0), None
    opt = _ADAMW(model)
    _train(model, opt, 1, seed=3)
    zerofx.checkpoint.save(tmp_path / "good", model, opt)
    cases = {
        "no_metadata": (lambda p: (p / ".metadata").unlink(), r"its \.metadata file .* is missing"),
        "no_shard": (lambda p: (p / "__0_0.distcp").unlink(), r"__0_0\.distcp \(listed in its \.metadata\) is missing"),
        "short": (lambda p: os.truncate(p / "__0_0.distcp", 100), r"__0_0\.distcp has 100 bytes, .* \(cut short\)"),
    }
    for name, (damage, message) in cases.items():
        shutil.copytree(tmp_path / "good", tmp_path / name)
        damage(tmp_path / name)
        other = _model(1)
        other_opt = _ADAMW(other)
        with pytest.raises(ZeroFXError, match=rf"checkpoint .*{name} is damaged: {message} \(nothing was loaded\)"):
            zerofx.checkpoint.load(tmp_path / name, other, other_opt)
        assert _equal(other, _model(1)) and not other_opt.state
        other(torch.randn(2, 4))  # not marked: nothing was read
        with pytest.raises(ZeroFXError, match=rf"is damaged: {message}"):
            zerofx.checkpoint.export_full_state_dict(tmp_path / name)


def test_a_read_that_fails_part_way_marks_the_model_until_a_load_succeeds(tmp_path):
    """DCP reads into the model's tensors in place: a shard damaged inside fails the read after
    some tensors were overwritten. The error says so (chained from DCP's); the fresh optimizer is
    as it was, the model's forward and a save refuse until a load into it succeeds."""
    model = _model(0)
    opt = _ADAMW(model)
    _train(model, opt, 2, seed=3)
    zerofx.checkpoint.save(tmp_path / "good", model, opt)
    shutil.copytree(tmp_path / "good", tmp_path / "bad")
    _zero_the_tail(tmp_path / "bad" / "__0_0.distcp")

    other = _model(1)
    fresh = _ADAMW(other)
    with pytest.raises(ZeroFXError, match=r"could not be read .*partly overwritten.*the optimizer was left as") as info:
        zerofx.checkpoint.load(tmp_path / "bad", other, fresh)
    assert isinstance(info.value.__cause__, CheckpointException)
    assert not fresh.state
    with pytest.raises(ZeroFXError, match=r"a zerofx\.checkpoint\.load of .*bad into this model failed part-way"):
        other(torch.randn(2, 4))
    with pytest.raises(ZeroFXError, match=r"save: a zerofx\.checkpoint\.load .* failed part-way.*nothing was written"):
        zerofx.checkpoint.save(tmp_path / "again", other, fresh)
    zerofx.checkpoint.load(tmp_path / "good", other, fresh)
    other(torch.randn(2, 4))
    assert _equal(other, model)

    # an optimizer that held state has it partly overwritten: its step refuses too, until a load
    trained = _ADAMW(other)
    _train(other, trained, 1, seed=4)
    with pytest.raises(ZeroFXError, match=r"the optimizer's state is partly overwritten"):
        zerofx.checkpoint.load(tmp_path / "bad", other, trained)
    with pytest.raises(ZeroFXError, match=r"into this optimizer failed part-way"):
        trained.step()
    other.load_state_dict(model.state_dict())  # every tensor: the model loads again
    other(torch.randn(2, 4))
    zerofx.checkpoint.load(tmp_path / "good", other, trained, load_model=False)
    _train(model, opt, 2, seed=5)
    _train(other, trained, 2, seed=5)
    assert _equal(other, model)


class _LM(nn.Module):
    def __init__(self, tied: bool, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(8, 4)
        self.lm_head = nn.Linear(4, 8, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, x):
        return self.lm_head(self.wte(x))


def test_tied_names_must_be_tied_as_they_were_saved(tmp_path):
    """DCP stores a tied pair as two entries: an untied checkpoint read into a tied model kept
    whichever was read last, silently. Now refused, naming them. The reverse (saved tied, read
    into an untied model) loses nothing and loads; an older checkpoint (no record of its ties)
    loads as before, and so does one whose model's names do not map onto its keys."""
    zerofx.checkpoint.save(tmp_path / "untied", _LM(tied=False, seed=0))
    zerofx.checkpoint.save(tmp_path / "tied", _LM(tied=True, seed=0))
    assert json.loads((tmp_path / "tied" / zerofx.checkpoint.COMPLETE_MARKER).read_text())["aliases"] == [
        ["lm_head.weight", "wte.weight"]
    ]
    tied = _LM(tied=True, seed=1)
    with pytest.raises(
        ZeroFXError,
        match=r"this model ties lm_head\.weight and wte\.weight \(one tensor\), which the checkpoint stored as separate",
    ):
        zerofx.checkpoint.load(tmp_path / "untied", tied)
    assert _equal(tied, _LM(tied=True, seed=1))
    untied_from_tied = _LM(tied=False, seed=1)
    zerofx.checkpoint.load(tmp_path / "tied", untied_from_tied)
    assert torch.equal(untied_from_tied.wte.weight, _LM(tied=True, seed=0).wte.weight)
    assert torch.equal(untied_from_tied.lm_head.weight, untied_from_tied.wte.weight)
    zerofx.checkpoint.load(tmp_path / "tied", tied)
    assert _equal(tied, _LM(tied=True, seed=0))
    untied = _LM(tied=False, seed=1)
    zerofx.checkpoint.load(tmp_path / "untied", untied)
    assert _equal(untied, _LM(tied=False, seed=0))

    marker = tmp_path / "untied" / zerofx.checkpoint.COMPLETE_MARKER
    info = json.loads(marker.read_text())
    del info["aliases"]  # as written before the record existed
    marker.write_text(json.dumps(info))
    zerofx.checkpoint.load(tmp_path / "untied", _LM(tied=True, seed=1))

    class Wrapper(nn.Module):  # a state_dict without the wrapper's own prefix (Fabric's module, DDP's)
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    assert zerofx.checkpoint._tied_keys(Wrapper(_LM(tied=True, seed=0)), ["wte.weight", "lm_head.weight"]) is None


def _steps(model, opt, seeds, rank: int, world: int) -> None:
    """Training steps of UnevenNet on this rank's rows of a batch made from each seed."""
    for s in seeds:
        g = torch.Generator().manual_seed(100 + s)
        x, y = torch.randn(2 * world, 6, generator=g), torch.randn(2 * world, 3, generator=g)
        model(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]).backward()
        opt.step()
        opt.zero_grad()


def _error(f) -> str:
    """``f()``'s ZeroFXError message, or "no error"."""
    try:
        f()
    except ZeroFXError as e:
        return str(e)
    return "no error"


def _stage2_failures(rank: int, world: int, folder: str) -> dict:
    """At stage 2 on 2 ranks: a refused load (SGD's state into AdamW), missing files, and a read
    that fails part-way, each into a fresh model and optimizer."""
    from torch.distributed.device_mesh import init_device_mesh

    import zerofx
    from tests.models import UnevenNet

    mesh = init_device_mesh("cpu", (world,))
    folder = Path(folder)

    def build(seed, make):
        torch.manual_seed(seed)
        model = zerofx.shard(UnevenNet(), mesh, stage=2)  # uncompiled: its forward checks the whole copies
        return model, make(model)

    def steps(model, opt, seeds):
        _steps(model, opt, seeds, rank, world)

    error = _error

    out = {}
    model, opt = build(0, _SGD)
    steps(model, opt, range(2))
    zerofx.checkpoint.save(folder / "sgd", model, opt)
    adamw_model, adamw_opt = build(0, _ADAMW)
    steps(adamw_model, adamw_opt, range(2))
    zerofx.checkpoint.save(folder / "good", adamw_model, adamw_opt)
    if rank == 0:
        for name in ("no_metadata", "no_shard", "bad"):
            shutil.copytree(folder / "good", folder / name)
        (folder / "no_metadata" / ".metadata").unlink()
        (folder / "no_shard" / "__1_0.distcp").unlink()
        _zero_the_tail(folder / "bad" / "__0_0.distcp")
    torch.distributed.barrier()

    clean, clean_opt = build(1, _ADAMW)
    tried, tried_opt = build(1, _ADAMW)
    out["refused"] = error(lambda: zerofx.checkpoint.load(folder / "sgd", tried, tried_opt))
    out["state_after_refusal"] = len(tried_opt.state)
    steps(clean, clean_opt, range(2, 5))
    steps(tried, tried_opt, range(2, 5))
    out["trains_like_a_clean_start"] = all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(clean.parameters(), tried.parameters())
    )

    for name in ("no_metadata", "no_shard", "bad"):
        model, opt = build(1, _ADAMW)
        out[name] = error(lambda: zerofx.checkpoint.load(folder / name, model, opt))
        out[f"{name}_state"] = len(opt.state)
        out[f"{name}_forward"] = error(lambda: model(torch.randn(2, 6), torch.randn(2, 3)))
    zerofx.checkpoint.load(folder / "good", model, opt)  # the model a read failed in, loaded again
    out["forward_after_a_good_load"] = error(lambda: model(torch.randn(2, 6), torch.randn(2, 3)))
    steps(model, opt, range(2, 4))
    steps(adamw_model, adamw_opt, range(2, 4))
    out["resumes_like_the_saved_run"] = all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(adamw_model.parameters(), model.parameters())
    )
    return out


def test_failed_loads_at_stage_2_on_two_ranks(tmp_path):
    """Every rank alike: a refused load leaves zerofx's optimizer fresh (it trains bit for bit like
    a clean start), a missing file is named before anything is read, and a read that fails
    part-way makes the next forward refuse with an error saying so (it said before that the
    parameters changed in place since the whole copies were refreshed), until a load succeeds."""
    for r in run_ranks(_stage2_failures, 2, str(tmp_path), timeout=300):
        assert "does not fit this optimizer" in r["refused"], r["refused"]
        assert r["state_after_refusal"] == 0 and r["trains_like_a_clean_start"]
        assert "is damaged: its .metadata file (DCP's index of the shards) is missing" in r["no_metadata"]
        assert "is damaged: __1_0.distcp (listed in its .metadata) is missing" in r["no_shard"], r["no_shard"]
        assert "could not be read (rank" in r["bad"] and "partly overwritten" in r["bad"], r["bad"]
        for name in ("no_metadata", "no_shard", "bad"):
            assert r[f"{name}_state"] == 0, name
        assert r["no_metadata_forward"] == r["no_shard_forward"] == "no error"
        assert "into this model failed part-way" in r["bad_forward"], r["bad_forward"]
        assert r["forward_after_a_good_load"] == "no error" and r["resumes_like_the_saved_run"]


def _one_rank_fails(rank: int, world: int, folder: str) -> dict:
    """At stage 2 on 2 ranks, loads that fail on rank 1 only: its folder missing (a disk of its
    own), a check before the read, the step after DCP's read that puts the state in place."""
    from torch.distributed.device_mesh import init_device_mesh

    import zerofx
    from tests.models import UnevenNet

    mesh = init_device_mesh("cpu", (world,))
    folder = Path(folder)

    def build(seed):
        torch.manual_seed(seed)
        model = zerofx.shard(UnevenNet(), mesh, stage=2)
        return model, _ADAMW(model)

    def step(model, opt):
        _steps(model, opt, [0], rank, world)

    error = _error

    model, opt = build(0)
    step(model, opt)
    zerofx.checkpoint.save(folder / "good", model, opt)

    out = {}
    model, opt = build(1)
    where = folder / ("good" if rank == 0 else "elsewhere")
    out["missing_on_one"] = error(lambda: zerofx.checkpoint.load(where, model, opt))
    out["missing_state"] = len(opt.state)

    real = {n: getattr(zerofx.checkpoint, n) for n in ("_check_optimizer_state", "set_state_dict", "_check_compatible")}

    def refuse(*args, **kwargs):
        raise ZeroFXError("injected refusal")

    def set_and_fail(*args, **kwargs):
        real["set_state_dict"](*args, **kwargs)
        raise RuntimeError("injected failure after the read")

    for name, fake in (
        ("before_read", ("_check_optimizer_state", refuse)),
        ("model_check", ("_check_compatible", refuse)),  # a check against the model, then a retry
        ("after_read", ("set_state_dict", set_and_fail)),
    ):
        model, opt = build(1)
        if rank == 1:
            setattr(zerofx.checkpoint, *fake)
        out[name] = error(lambda: zerofx.checkpoint.load(folder / "good", model, opt))
        for n, f in real.items():
            setattr(zerofx.checkpoint, n, f)
        out[f"{name}_state"] = len(opt.state)
        out[f"{name}_forward"] = error(lambda: model(torch.randn(2, 6), torch.randn(2, 3)))
    # the checkpoint seen replaced by rank 1 only (a rename between the ranks' looks; a network
    # file system's cached attributes): rank 0 went on alone into the next collective
    model, opt = build(1)
    real_identity = zerofx.checkpoint._identity
    if rank == 1:
        looks = []

        def identity(path):
            looks.append(path)
            dev, ino, marker = real_identity(path)
            return (dev, ino + len(looks) - 1, marker)  # another inode from the second look on

        zerofx.checkpoint._identity = identity
    out["replaced_on_one"] = error(lambda: zerofx.checkpoint.load(folder / "good", model, opt))
    zerofx.checkpoint._identity = real_identity
    zerofx.checkpoint.load(folder / "good", model, opt)  # every rank can load again
    step(model, opt)
    # saves whose rank-0-only steps fail (NOTE: a save that fails on rank 0), each followed by a
    # step, as a loop that logs a failed save and trains on: the temporary folder under a file
    # (rank 1 waited in save's barrier while rank 0 went into the step), then the completion
    import torch.distributed as dist

    def any_error(f) -> str:
        try:
            f()
        except Exception as e:  # noqa: BLE001 - rank 0 raises the OSError itself
            return f"{type(e).__name__}: {e}"
        return "no error"

    if rank == 0:
        (folder / "a_file").write_text("")
    dist.barrier()
    out["save_mkdir"] = any_error(lambda: zerofx.checkpoint.save(folder / "a_file" / "ckpt", model, opt))
    step(model, opt)
    real_complete = zerofx.checkpoint._complete
    if rank == 0:

        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        zerofx.checkpoint._complete = disk_full
    out["save_complete"] = any_error(lambda: zerofx.checkpoint.save(folder / "good", model, opt))
    zerofx.checkpoint._complete = real_complete
    step(model, opt)
    out["good_after"] = zerofx.checkpoint.load(folder / "good", model, opt) is not None  # the old one, intact
    return out


def test_a_load_that_fails_on_one_rank_fails_on_every_rank(tmp_path):
    """A load that failed on one rank only returned normally on the others: a folder on one
    rank's own disk left rank 0 waiting in its file check's broadcast (until gloo's timeout), a
    failure after the read marked only the failing rank, so the next forward ran its gathers on
    one rank and refused on the other. The ranks now agree at each stage of a load: every rank
    raises, naming the rank that failed, and marks what the read may have overwritten; so does a
    checkpoint that one rank sees replaced after its read (rank 0 waited in the next collective).
    A save whose rank-0-only steps fail (making the temporary folder, completing the checkpoint)
    fails on every rank, and the ranks train on together (rank 1 had waited in save's barrier
    while rank 0 went into the next step, until the timeout)."""
    r0, r1 = run_ranks(_one_rank_fails, 2, str(tmp_path), timeout=300)
    assert "refused on rank 1: checkpoint" in r0["missing_on_one"] and "does not exist" in r0["missing_on_one"]
    assert "elsewhere does not exist" in r1["missing_on_one"], r1["missing_on_one"]
    assert "failed on another rank before anything was read (rank 1: injected refusal)" in r0["before_read"]
    assert r1["before_read"] == r1["model_check"] == "injected refusal"
    assert r0["model_check"] == "refused on rank 1: injected refusal", r0["model_check"]
    assert "rank 1: RuntimeError: injected failure after the read" in r0["after_read"], r0["after_read"]
    assert "RuntimeError: injected failure after the read" in r1["after_read"], r1["after_read"]
    assert "refused on rank 1: checkpoint" in r0["replaced_on_one"], r0["replaced_on_one"]
    for r in (r0, r1):
        assert "was replaced while loading" in r["replaced_on_one"], r["replaced_on_one"]
        assert r["missing_state"] == r["before_read_state"] == r["model_check_state"] == 0
        assert r["before_read_forward"] == r["model_check_forward"] == "no error"
        assert "partly overwritten" in r["after_read"]
        assert "into this model failed part-way" in r["after_read_forward"], r["after_read_forward"]
        assert r["good_after"], r
    assert "Not a directory" in r0["save_mkdir"], r0["save_mkdir"]
    assert (
        r1["save_mkdir"].startswith("ZeroFXError: zerofx.checkpoint.save failed on rank 0: ")
        and "Not a directory" in (r1["save_mkdir"])
    ), r1["save_mkdir"]
    assert "No space left on device" in r0["save_complete"], r0["save_complete"]
    assert r1["save_complete"].startswith("ZeroFXError: zerofx.checkpoint.save failed on rank 0: "), r1["save_complete"]


def _saved_during(monkeypatch, owner, name: str, call: int, path: Path, replacement: nn.Module) -> None:
    """Before the ``call``-th call of ``owner.name``, a training job saves ``replacement`` onto
    ``path`` (``save`` renames a new folder onto it) while the checkpoint there is being read."""
    original, calls = getattr(owner, name), []

    def saving_first(*args, **kwargs):
        calls.append(None)
        if len(calls) == call:
            zerofx.checkpoint.save(path, replacement)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, saving_first)


def test_a_checkpoint_replaced_while_it_is_read_is_an_error_with_nothing_written(tmp_path, monkeypatch):
    """zerofx/checkpoint.py, NOTE: a checkpoint replaced while it is read. Before: DCP read the old
    checkpoint's .metadata, then the new one's files under its offsets, and export wrote the two
    checkpoints mixed (some tensors the old model's, some the new one's) without a word."""
    old, new = _model(0), _model(1)
    latest = tmp_path / "latest"
    replaced = r"checkpoint .*latest was replaced while {} .*; {}"
    for to in ("hf", "torch"):  # the save lands after the first output file of four
        zerofx.checkpoint.save(latest, old)
        with monkeypatch.context() as m:
            _saved_during(m, zerofx.checkpoint, "_read_tensors", 2, latest, new)
            with pytest.raises(ZeroFXError, match=replaced.format("exporting it", "nothing was written")):
                zerofx.checkpoint.export(latest, tmp_path / "out", to=to, max_shard_bytes=64)
        assert [p.name for p in tmp_path.iterdir()] == ["latest"]  # no out, no temporary folder

    zerofx.checkpoint.save(latest, old)
    with monkeypatch.context() as m:
        _saved_during(m, zerofx.checkpoint, "_load_in_one_process", 1, latest, new)
        with pytest.raises(ZeroFXError, match=replaced.format("exporting it", "nothing was written")):
            zerofx.checkpoint.export_full_state_dict(latest, tmp_path / "m.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]

    zerofx.checkpoint.save(latest, old)
    other = _model(2)
    with monkeypatch.context() as m:  # DCP reads the new files under the old checkpoint's metadata
        _saved_during(m, zerofx.checkpoint.dcp, "load", 1, latest, new)
        with pytest.raises(ZeroFXError, match=r"could not be read \(ZeroFXError: checkpoint .*latest was replaced"):
            zerofx.checkpoint.load(latest, other)
    with pytest.raises(ZeroFXError, match=r"failed part-way"):
        other(torch.randn(2, 4))
    zerofx.checkpoint.load(latest, other)  # a checkpoint left alone loads, exports
    assert _equal(other, new)
    zerofx.checkpoint.export(latest, tmp_path / "out", max_shard_bytes=64)
    assert _equal(other, new)
