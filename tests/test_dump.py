"""The debug dump's files (zerofx/dump.py): a run's own, never in the way of training."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from torch import nn

import zerofx
from zerofx import Options
from zerofx.backend import make_backend


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))


def _step(compiled: nn.Module, rows: int) -> None:
    compiled(torch.randn(rows, 4, requires_grad=True)).sum().backward()


def test_an_earlier_runs_files_are_removed_and_nothing_else(tmp_path):
    """Left beside this run's, an earlier run's frame folders read as this run's graphs (an old
    08_elide.py as the last pass of a graph this run never bucketed)."""
    rank_dir = tmp_path / "rank0"
    (rank_dir / "frame907_forward").mkdir(parents=True)
    (rank_dir / "frame907_forward" / "08_elide.py").write_text("an earlier run's graph")
    (rank_dir / "summary.txt").write_text("an earlier run's summary")
    (rank_dir / "notes.txt").write_text("the user's")
    _step(torch.compile(_model(), backend=make_backend(Options(dump_dir=str(tmp_path)))), 3)
    names = {p.name for p in rank_dir.iterdir()}
    assert "frame907_forward" not in names and "notes.txt" in names, names
    assert "an earlier run" not in (rank_dir / "summary.txt").read_text()
    assert any(n.endswith("_forward") for n in names) and any(n.endswith("_backward") for n in names), names


def test_a_restarted_worker_keeps_the_failed_attempts_dump(tmp_path, monkeypatch):
    """torchrun's elastic agent restarts failed workers in the same folder: the restarted run
    cleared the dump of the attempt that failed, the one the user needs."""
    rank_dir = tmp_path / "rank0"
    (rank_dir / "frame0_forward").mkdir(parents=True)
    (rank_dir / "summary.txt").write_text("the failed attempt's summary")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    _step(torch.compile(_model(), backend=make_backend(Options(dump_dir=str(tmp_path)))), 3)
    assert (rank_dir / "summary.txt").read_text() == "the failed attempt's summary"
    assert (rank_dir / "frame0_forward").is_dir()
    restarted = tmp_path / "restart2" / "rank0"
    assert "frame" in (restarted / "summary.txt").read_text()
    assert any(p.name.endswith("_backward") for p in restarted.iterdir())


def test_a_dump_that_cannot_be_written_warns_once_and_training_goes_on(tmp_path):
    """A rank folder that became a file (or a full disk) failed the frame's compile with
    FileExistsError / "No space left on device", on that rank alone, never naming the dump."""
    compiled = torch.compile(_model(), backend=make_backend(Options(dump_dir=str(tmp_path))))
    _step(compiled, 3)
    written = sorted(p.name for p in (tmp_path / "rank0").iterdir())
    shutil.rmtree(tmp_path / "rank0")
    (tmp_path / "rank0").write_text("a file")  # nothing can be made under it
    torch._dynamo.config.automatic_dynamic_shapes = False  # a new shape: a new compile, which dumps
    try:
        with pytest.warns(UserWarning, match=r"zerofx dump: cannot write under dump_dir .*training goes on") as seen:
            _step(compiled, 5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _step(compiled, 7)  # once: the dump stopped
    finally:
        torch._dynamo.config.automatic_dynamic_shapes = True
    assert sum("zerofx dump" in str(w.message) for w in seen) == 1
    assert written and (tmp_path / "rank0").read_text() == "a file"


def test_explain_writes_its_own_summary_beside_the_models(tmp_path):
    """explain's recorder wrote summary.txt over the compiled model's (the same folder, another
    recorder): the model's frames vanished from it."""
    model = _model()
    compiled = torch.compile(model, backend=make_backend(Options(dump_dir=str(tmp_path))))
    _step(compiled, 3)
    before = (tmp_path / "rank0" / "summary.txt").read_text()
    zerofx.explain(model, torch.randn(3, 4), dump_dir=str(tmp_path))
    assert (tmp_path / "rank0" / "summary.txt").read_text() == before
    report = (tmp_path / "rank0" / "explain.txt").read_text()
    assert report.strip() and report != before


def test_explain_of_something_that_is_not_a_module_says_so():
    """It raised AttributeError: 'function' object has no attribute 'named_modules'."""
    with pytest.raises(zerofx.ZeroFXError, match="zerofx.explain takes an nn.Module, got function"):
        zerofx.explain(lambda x: x, torch.randn(2))


def test_explain_leaves_buffers_and_random_state_as_they_were():
    """Its step moved batch norm's running statistics and step count and the global random
    generator: a run that explained first trained otherwise than without it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Dropout(0.5), nn.Linear(3, 2))
    x = torch.randn(8, 4)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    zerofx.explain(model, x)
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers()), dict(model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)
