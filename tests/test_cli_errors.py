"""The command line's errors about what it writes and about ranks that fail: one line, said
before any rank starts (or any planning) where it can be, a nonzero exit status, no traceback.

Paths that cannot be written without needing permissions (the tests may run as root, for whom
``os.access`` says yes to everything): a folder under a regular file, a name longer than the
filesystem's limit, and ``/proc``, where even root cannot create files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import zerofx.checkpoint
from zerofx.cli import main

PROC = "/proc"
needs_proc = pytest.mark.skipif(not os.path.isdir(PROC), reason="needs Linux's /proc")
LONG = "x" * 300  # past NAME_MAX (255) on Linux and macOS filesystems

# A verify workload in the test's folder (subprocesses run there): building it leaves a marker,
# so a test sees whether any rank started.
WORKLOAD = """
import pathlib

import torch
from torch import nn


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.lin(x), y)


def build():
    pathlib.Path("factory_called").touch()
    return Regression(), lambda n, g: (torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g))


def broken():
    raise RuntimeError("the factory broke\\nand said more on a second line")


def rank_permuted():
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Regression()
    if dist.get_rank() == 1:  # the same values in other rows: every sum agrees
        with torch.no_grad():
            model.lin.weight.copy_(model.lin.weight.flip(0))
    return model, lambda n, g: (torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g))
"""


@pytest.fixture(autouse=True)
def no_dump_from_the_environment(monkeypatch):
    """``ZEROFX_DUMP`` is checked as the dump folder when no ``--dump`` is given (also in the
    subprocesses, which inherit the environment): only the tests that set it see one."""
    monkeypatch.delenv("ZEROFX_DUMP", raising=False)


def _cli(tmp_path: Path, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """``python -m zerofx.cli ARGS`` run in ``tmp_path``, as a user runs it there (never from the
    repository root, whose zerofx/ lacks zerofx.passes)."""
    (tmp_path / "workload.py").write_text(WORKLOAD)
    return subprocess.run(
        [sys.executable, "-m", "zerofx.cli", *args], cwd=str(tmp_path), capture_output=True, text=True, timeout=timeout
    )


def _one_line(err: str, prefix: str) -> str:
    """``err`` is exactly one line starting with ``prefix``; returns it."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), err[-3000:]
    return lines[0]


# -- zerofx verify ------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["missing folder", "long name", "proc"])
def test_verify_json_that_cannot_be_written_is_refused_before_any_rank_starts(where, tmp_path):
    """Before: the whole run trained, then a FileNotFoundError traceback and exit status 1, which
    means "divergent", with no report printed."""
    if where == "proc" and not os.path.isdir(PROC):
        pytest.skip("needs Linux's /proc")
    path = {
        "missing folder": str(tmp_path / "missing" / "r.json"),
        "long name": str(tmp_path / f"{LONG}.json"),
        "proc": f"{PROC}/zerofx_verify.json",
    }[where]
    run = _cli(tmp_path, "verify", "workload:build", "--steps", "2", "--json", path)
    line = _one_line(run.stderr, f"zerofx verify: --json {path!r}: ")
    assert run.returncode == 2 and run.stdout == "", line
    # no rank built it, no probe is left (the CLI imports workload.py: its bytecode may be cached)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == ["workload.py"]


def test_verify_prints_its_reports_before_the_json_and_a_late_write_failure_is_one_line(tmp_path, monkeypatch, capsys):
    """The folder checked before the run is gone when the run ends: the reports are printed all
    the same, then one line, exit status 2 (not 1, "divergent")."""
    import shutil

    import zerofx.testing

    folder = tmp_path / "reports"
    folder.mkdir()

    def run_and_lose_the_folder(*args, **kwargs):
        shutil.rmtree(folder)
        return [zerofx.testing.VerifyReport(rank, 2).to_json() for rank in range(2)]

    monkeypatch.setattr(zerofx.testing, "verify_ranks", run_and_lose_the_folder)
    path = str(folder / "r.json")
    assert main(["verify", "tests.verify_models:mlp", "--json", path]) == 2
    captured = capsys.readouterr()
    assert "rank 0 of 2:" in captured.out and "rank 1 of 2:" in captured.out
    assert _one_line(captured.err, f"zerofx verify: cannot write --json {path!r}: ").endswith(
        "No such file or directory"
    )


def test_verify_refuses_an_unusable_dump_folder_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    """``ZEROFX_DUMP``: the ranks' default ``dump_dir``; they would fail in their first compile."""
    import zerofx.testing

    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("ZEROFX_DUMP", str(tmp_path / "afile" / "dump"))
    monkeypatch.setattr(zerofx.testing, "verify_ranks", lambda *a, **k: pytest.fail("a rank started"))
    assert main(["verify", "tests.verify_models:mlp"]) == 2
    line = _one_line(capsys.readouterr().err, f"zerofx verify: ZEROFX_DUMP {str(tmp_path / 'afile' / 'dump')!r}: ")
    assert line.endswith(f"{tmp_path / 'afile'} is not a folder")


def _child_failed(tmp_path: Path, exitcode: int, message: str | None):
    """torch elastic's ChildFailedError for rank 1, with an error file holding ``message`` as a
    failing rank writes it (torch's ErrorHandler.record_exception), or none."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = str(tmp_path / "error.json")
    if message is not None:
        extra = {"py_callstack": "Traceback (most recent call last): ...", "timestamp": "0"}
        Path(error_file).write_text(json.dumps({"message": {"message": message, "extraInfo": extra}}))
    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=exitcode, error_file=error_file)
    return ChildFailedError("zerofx-verify", {1: failure})


@pytest.mark.parametrize(
    "exitcode, message, said",
    [
        (
            1,
            "TypeError: the factory must return (model, batch_fn)\nmore",
            "rank 1: TypeError: the factory must return (model, batch_fn)",
        ),
        (-9, None, "rank 1: Signal 9 (SIGKILL) received by PID 4242"),
        (1, None, "rank 1: exit code 1"),
        (  # dynamo's wrapper of an error in zerofx's compile: its first line named no cause
            1,
            "BackendCompilerFailed: backend='backend' raised:\nZeroFXError: l.weight: the compiled forward changes "
            "the parameter in place\n\nSet TORCHDYNAMO_VERBOSE=1 for more",
            "rank 1: ZeroFXError: l.weight: the compiled forward changes the parameter in place",
        ),
    ],
)
def test_verify_names_the_failed_ranks_error(exitcode, message, said, tmp_path, monkeypatch, capsys):
    """Before: ``... finished: ChildFailedError: `` and nothing after it (its text starts with a
    blank line)."""
    import zerofx.testing

    def fail(*args, **kwargs):
        raise _child_failed(tmp_path, exitcode, message)

    monkeypatch.setattr(zerofx.testing, "verify_ranks", fail)
    assert main(["verify", "tests.verify_models:mlp"]) == 2
    prefix = "zerofx verify: a rank failed before the comparison finished: "
    assert _one_line(capsys.readouterr().err, prefix) == prefix + said


def test_verify_names_the_error_of_a_rank_whose_factory_raises(tmp_path):
    """The real launcher: the rank's exception, from its error file, is the last line."""
    run = _cli(tmp_path, "verify", "workload:broken", "--steps", "1")
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 2, run.stderr[-3000:]
    assert last.startswith("zerofx verify: a rank failed before the comparison finished: rank "), last
    assert last.endswith(": RuntimeError: the factory broke"), last


def test_verify_refuses_a_factory_whose_ranks_build_rows_in_another_order(tmp_path):
    """Before: the ranks' parameters were compared by their sums, equal here: training ran and
    reported a divergence (exit 1) instead of refusing the factory (exit 2)."""
    run = _cli(tmp_path, "verify", "workload:rank_permuted", "--steps", "1")
    assert run.returncode == 2, run.stdout + run.stderr[-3000:]
    assert run.stdout.count("ranks built different initial parameters (the factory depends on the rank)") == 2
    assert "'lin.weight' differs between rank 0 and rank 1" in run.stdout


# -- zerofx demo --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, where",
    [("--dump", "under a file"), ("--plot", "a file"), ("--plot", "long name"), ("--dump", "proc"), ("--plot", "proc")],
)
def test_demo_folders_that_cannot_be_made_are_refused_before_any_rank_starts(
    flag, where, tmp_path, monkeypatch, capsys
):
    """Before: ``--dump`` failed in every rank's first compile (about 190 lines of launcher and
    dynamo traceback), ``--plot`` after the whole run."""
    import zerofx.cli

    if where == "proc" and not os.path.isdir(PROC):
        pytest.skip("needs Linux's /proc")
    (tmp_path / "afile").write_text("")
    path, why = {
        "under a file": (str(tmp_path / "afile" / "sub"), f"{tmp_path / 'afile'} is not a folder"),
        "a file": (str(tmp_path / "afile"), "exists and is not a folder"),
        "long name": (str(tmp_path / LONG / "plots"), f"cannot create a folder in {tmp_path} (File name too long)"),
        "proc": (f"{PROC}/zerofx_demo", f"cannot create a folder in {PROC} ("),
    }[where]
    monkeypatch.setattr(zerofx.cli, "run_demo", lambda cfg: pytest.fail("the demo started"))
    assert main(["demo", flag, path]) == 2
    line = _one_line(capsys.readouterr().err, f"zerofx demo: {flag} {path!r}: ")
    assert why in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # the check left nothing behind


def test_demo_checks_zerofx_dump_and_leaves_good_folders_as_they_were(tmp_path, monkeypatch, capsys):
    """Without ``--dump`` the ranks dump to ``ZEROFX_DUMP``: checked the same. Folders that can be
    made are made by the run, not by the check."""
    import zerofx.cli

    (tmp_path / "afile").write_text("")
    started = []
    monkeypatch.setattr(zerofx.cli, "run_demo", started.append)
    monkeypatch.setenv("ZEROFX_DUMP", str(tmp_path / "afile"))
    assert main(["demo"]) == 2
    _one_line(capsys.readouterr().err, f"zerofx demo: ZEROFX_DUMP {str(tmp_path / 'afile')!r}: exists and is not")
    assert main(["demo", "--dump", str(tmp_path / "new" / "dump"), "--plot", str(tmp_path)]) == 0
    assert [cfg.dump_dir for cfg in started] == [str(tmp_path / "new" / "dump")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_demo_names_the_failed_ranks_error_in_one_line(tmp_path, monkeypatch, capsys):
    """Before: the launcher's ChildFailedError traceback and table after the rank's own traceback.
    Other errors are not the ranks': they still raise."""
    import zerofx.cli

    def fail(cfg):
        raise _child_failed(tmp_path, 1, "RuntimeError: gloo connection reset\nmore")

    monkeypatch.setattr(zerofx.cli, "run_demo", fail)
    assert main(["demo"]) == 1
    prefix = "zerofx demo: a rank failed: "
    assert _one_line(capsys.readouterr().err, prefix) == prefix + "rank 1: RuntimeError: gloo connection reset"
    monkeypatch.setattr(zerofx.cli, "run_demo", lambda cfg: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        main(["demo"])


@needs_proc
def test_demo_with_an_unwritable_dump_is_one_line_from_the_command(tmp_path):
    run = _cli(tmp_path, "demo", "--steps", "1", "--dump", f"{PROC}/zerofx_dump")
    assert run.returncode == 2 and run.stdout == "", run.stderr[-3000:]
    _one_line(run.stderr, f"zerofx demo: --dump '{PROC}/zerofx_dump': cannot create a folder in {PROC} (")


# -- zerofx convert -----------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path) -> str:
    """A zerofx checkpoint of a small plain model, saved in this process."""
    torch.manual_seed(0)
    zerofx.checkpoint.save(tmp_path / "ck", nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    return str(tmp_path / "ck")


@pytest.mark.parametrize("where", ["under a file", "proc"])
def test_convert_into_a_folder_that_cannot_be_made_is_one_line(where, checkpoint, tmp_path, capsys):
    """Before: a NotADirectoryError (or, for /proc, FileNotFoundError) traceback."""
    if where == "proc" and not os.path.isdir(PROC):
        pytest.skip("needs Linux's /proc")
    (tmp_path / "afile").write_text("")
    out = str(tmp_path / "afile" / "out") if where == "under a file" else f"{PROC}/zerofx_convert"
    assert main(["convert", checkpoint, out, "--to", "torch"]) == 1
    line = _one_line(capsys.readouterr().err, f"zerofx convert: cannot write OUT {out!r}: ")
    assert ("Not a directory" if where == "under a file" else "No such file or directory") in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ck"]


# -- zerofx plan --------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--json", "--plot"])
@pytest.mark.parametrize("where", ["long name", "proc"])
def test_plan_outputs_the_filesystem_refuses_are_said_before_planning(flag, where, tmp_path, monkeypatch, capsys):
    """Permission bits said yes (as they do to root, and for a name too long): the plan ran, maybe
    for minutes, and only then failed to write."""
    from zerofx import planner

    if where == "proc" and not os.path.isdir(PROC):
        pytest.skip("needs Linux's /proc")
    suffix = ".json" if flag == "--json" else ".png"
    path = str(tmp_path / f"{LONG}{suffix}") if where == "long name" else f"{PROC}/zerofx_plan{suffix}"
    monkeypatch.setattr(planner, "plan", lambda *a, **k: pytest.fail("planned"))
    assert main(["plan", "gpt2", "--mesh", "2", flag, path]) == 1
    line = _one_line(capsys.readouterr().err, f"zerofx plan: {flag} {path!r}: not writable (")
    assert ("File name too long" if where == "long name" else "No such file or directory") in line, line
    assert list(tmp_path.iterdir()) == []


def test_plan_without_ranks_names_the_flags(monkeypatch, capsys):
    """Neither --world-size nor --mesh: the planner's "give mesh_shape or world_size" named its
    Python keywords, not the command's flags."""
    from zerofx import planner

    monkeypatch.setattr(planner, "plan", lambda *a, **k: pytest.fail("planned"))
    assert main(["plan", "gpt2"]) == 1
    _one_line(
        capsys.readouterr().err, "zerofx plan: give the ranks: --world-size N (-n N) or --mesh, e.g. --mesh 128x8"
    )


@pytest.mark.parametrize("command", [["demo"], ["verify", "tests.verify_models:mlp"]])
def test_demo_and_verify_under_torchrun_say_they_start_their_own_ranks(command, monkeypatch, capsys):
    """Under torchrun every worker started its own --world-size ranks: the run and its report
    twice (or N times), each writing the same --json and dump files."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "1234")
    with pytest.raises(SystemExit) as exit_:
        main(command)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"zerofx {command[0]}: error: zerofx {command[0]} starts its own ranks (--world-size); run it as a " in err
    assert err.rstrip().endswith("not under torchrun"), err


@pytest.mark.parametrize("command", [["plan", "gpt2", "-n", "2"], ["demo"], ["verify", "m:f"], ["convert", "a", "b"]])
def test_an_unknown_flag_is_the_subcommands_error_with_its_usage(command, capsys):
    """argparse reported an unknown flag under the top-level usage (``usage: zerofx [-h]
    {demo,verify,convert,plan} ...``), which lists none of the subcommand's flags."""
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--bogus", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: zerofx {command[0]} "), err
    assert err.rstrip().endswith(f"zerofx {command[0]}: error: unrecognized arguments: --bogus 1"), err


def test_plan_names_its_own_flags_for_ranks_and_budgets(monkeypatch, capsys):
    """``--world-size -2`` was answered with the planner's "mesh (-2,): give (world,) or ...",
    ``--activation-budget 10MB`` with argparse's "invalid <lambda> value"; a budget may be a size
    now (10MiB = 10485760 bytes), and 0 stays 0."""
    from zerofx import planner

    monkeypatch.setattr(planner, "plan", lambda *a, **k: pytest.fail("planned"))
    assert main(["plan", "gpt2", "--world-size", "-2"]) == 1
    _one_line(capsys.readouterr().err, "zerofx plan: --world-size -2: give at least 1 rank")
    with pytest.raises(SystemExit):
        main(["plan", "gpt2", "-n", "2", "--activation-budget", "10MX"])
    assert "argument --activation-budget: '10MX' is neither bytes (e.g. 1048576, 10MiB, 3GB) nor a fraction" in (
        capsys.readouterr().err
    )
    budgets = []

    def planned(*args, **kwargs):
        budgets.append(kwargs["activation_budget"])
        raise _Planned

    monkeypatch.setattr(planner, "plan", planned)
    for given in ("10MiB", "0", "0.5", "3GB", "5e-1"):
        with pytest.raises(_Planned):
            main(["plan", "gpt2", "-n", "2", "--activation-budget", given])
    assert budgets == [10 * 2**20, 0, 0.5, 3 * 10**9, 0.5], budgets


class _Planned(Exception):
    """Raised by a stand-in planner: the command got as far as planning."""


def test_plan_asks_whether_a_device_memory_without_a_unit_meant_gib(monkeypatch, capsys):
    """``--device-memory 80`` is 80 bytes (documented), and the plan only said "device memory
    0.00 MiB: DOES NOT FIT"; below a MiB without a unit it asks whether GiB was meant."""
    from zerofx import planner

    def planned(*args, **kwargs):
        raise _Planned

    monkeypatch.setattr(planner, "plan", planned)
    for memory, asked in (("80", True), ("80GiB", False), ("2097152", False)):
        with pytest.raises(_Planned):  # asked, not refused: planned all the same
            main(["plan", "gpt2", "-n", "2", "--device-memory", memory])
        err = capsys.readouterr().err
        assert ("is 80 bytes (no unit); did you mean 80GiB?" in err) is asked, (memory, err)


@pytest.mark.parametrize("size", ["1.5", "2.5b", "1000.5B"])
def test_plan_refuses_a_device_memory_that_is_not_whole_bytes(size, monkeypatch, capsys):
    """``--device-memory 1.5`` was planned as 1 byte (truncated): a byte count that is not whole is
    one line, before planning; with a unit a fraction of a byte rounds down (0.3GiB)."""
    from zerofx import planner
    from zerofx.cli import parse_size
    from zerofx.errors import ZeroFXError

    monkeypatch.setattr(planner, "plan", lambda *a, **k: pytest.fail("planned"))
    assert main(["plan", "gpt2", "--mesh", "2", "--device-memory", size]) == 1
    line = _one_line(capsys.readouterr().err, f"zerofx plan: --device-memory: {size!r} is ")
    assert "not a whole number" in line, line
    monkeypatch.undo()
    with pytest.raises(ZeroFXError, match="not a whole number"):
        planner.plan("gpt2-xl", 2, device_memory=size)  # refused before the model is built
    assert parse_size("1.5GiB") == 3 << 29 and parse_size("1.5KB") == 1500 and parse_size("0.1GB") == 10**8
    assert parse_size("1e3") == 1000 and parse_size("1_024") == 1024
    assert parse_size("0.3GiB") == 322122547 and parse_size("1.0001KB") == 1000
    assert parse_size(str(2**63 - 1)) == 2**63 - 1  # exact at the bound (a float rounded it up)
    for bad in ("0.00099999999999999999999KB", "0.9999999999999999999", str(2**63), "1e-999999999", "1e999999999"):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(bad)
