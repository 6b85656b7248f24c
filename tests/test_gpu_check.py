"""benchmarks/gpu_check.py keeps working while no GPU is around to run it, and will report
what happened on the day one is lent (one call, no second try):

* its CPU smoke mode runs sections through the same child-process driver: the imports line
  first, parity with the determinism settings recorded, the NCCL section's probe plumbing;
* without --cpu-smoke it says there is no CUDA device instead of failing somewhere inside;
* a rank that fails is reported with its own exception, not as an empty ChildFailedError;
* a section that runs out of time is killed with everything it started, and what it had
  printed (result lines, the ranks' lines) or written (gpu_codegen's JSON) is kept;
* gpu_codegen.py rewrites its JSON after every row, counts Triton launches and ATen fallbacks
  per row and lists them as problems (gpu_check: degraded), and drops an inherited
  TRITON_INTERPRET on a GPU;
* a broken import is one failed section, not a crash; the section limits add up to the budget,
  grace included.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
CODEGEN = ROOT / "benchmarks" / "gpu_codegen.py"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped has ended: its state is Z)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def _smoke(sections: str, out, md, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """The script in CPU smoke mode over ``sections``, writing ``out`` (JSON) and ``md``."""
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--cpu-smoke",
        "--sections",
        sections,
        "--json",
        str(out),
        "--markdown",
        str(md),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_cpu_smoke_runs_a_parity_section_and_writes_the_table(tmp_path):
    out, md = tmp_path / "gc.json", tmp_path / "gc.md"
    run = _smoke("imports,parity_w1,parity_w2_nccl", out, md, timeout=400)
    assert run.returncode == 0, run.stdout + run.stderr
    sections = json.loads(out.read_text())["sections"]
    assert list(sections) == ["imports", "parity_w1", "parity_w2_nccl"]  # the versions line comes first
    imports = sections["imports"]
    assert imports["status"] == "ok" and imports["torch"] and imports["triton_launch"] == "ok", imports
    assert imports["triton_kernel"] == "ok"  # one of zerofx's kernels compiled by this Triton, and right
    parity = sections["parity_w1"]
    assert parity["status"] == "ok", parity
    assert all(r["ok"] for r in parity["ranks"]) and len(parity["ranks"][0]["losses"]) == 5
    # what makes CUDA's kernels add in a fixed order is set in the ranks, and recorded
    assert parity["ranks"][0]["determinism"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert parity["determinism"]["deterministic_algorithms"] == "warn_only"
    nccl = sections["parity_w2_nccl"]
    assert nccl["status"] == "skipped"
    assert nccl["probe"]["status"] == "ok" and [r["value"] for r in nccl["probe"]["ranks"]] == [[3.0] * 4] * 2
    table = md.read_text()
    assert "| parity_w1 | ok | bit-identical to the unsharded replica" in table
    assert "| imports | ok | Python " in table and "probe (gloo): ok" in table


def test_without_a_gpu_it_says_so():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "no CUDA device here" in run.stdout


def test_a_failing_rank_is_reported_with_its_cause():
    """A group whose only backend is for CUDA tensors (what an NCCL group is) refuses the CPU
    tensors of a CPU run: each rank's own exception must reach the section's error and the
    table, not ChildFailedError's empty first line."""
    from benchmarks import gpu_check

    out = gpu_check.section_parity(2, "cuda:gloo", True, timeout_s=30)
    assert out["status"] == "failed"
    assert out["error"].startswith("RuntimeError: No backend type associated with device type cpu"), out
    assert "No backend type associated" in gpu_check._summary("parity_w2_nccl", out)


def test_a_rank_that_dies_without_an_exception_is_named_with_its_exit_code():
    from benchmarks import gpu_check

    gpu_check._checkout()
    per_rank = gpu_check._launch(os._exit, 1, 3, name="gpu-check-test-exit")
    assert per_rank == [{"ok": False, "rank": 0, "problem": "rank 0 exit code 3"}]


_STUBBORN = """
import json, subprocess, sys, time
stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("GPU_CHECK_RANK " + json.dumps({"rank": "1", "problem": "RuntimeError: stuck"}), flush=True)
print("GPU_CHECK_RESULT " + json.dumps({"status": "partial", "rows": {"plain": {"step_ms": 1.0}},
                                         "stray": stray.pid, "error": "ended after row plain"}), flush=True)
time.sleep(600)
"""


def test_a_timed_out_section_is_killed_with_its_children_and_keeps_what_it_printed():
    from benchmarks import gpu_check

    t = time.perf_counter()
    out = gpu_check._collect([sys.executable, "-c", _STUBBORN], 8)
    assert time.perf_counter() - t < 8 + gpu_check.KILL_WAIT_S + 5
    assert out["status"] == "failed" and out["timed_out"] and out["partial"], out
    assert out["error"].startswith("timed out after 8 s (ended after row plain)")
    assert out["rows"] == {"plain": {"step_ms": 1.0}}  # the last result line, kept
    assert out["ranks"] == [{"rank": "1", "problem": "RuntimeError: stuck"}]
    deadline = time.monotonic() + 10  # SIGKILL is delivered when the process next runs: on busy cores, later
    while _alive(out["stray"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(out["stray"]), "the section's child process outlived the kill"


def test_a_final_result_is_kept_when_the_process_then_hangs_on_its_way_out():
    """(NCCL's teardown can hang a process that has already reported.)"""
    from benchmarks import gpu_check

    hangs = 'import time; print(\'GPU_CHECK_RESULT {"status": "ok", "x": 1}\', flush=True); time.sleep(600)'
    out = gpu_check._collect([sys.executable, "-c", hangs], 4)
    assert out["status"] == "ok" and out["x"] == 1 and out["note"] == "did not exit; killed at 4 s", out


_SLOW_CODEGEN = """
import argparse, json, subprocess, sys, time
p = argparse.ArgumentParser()
p.add_argument("--out"); p.add_argument("--budget-s"); p.add_argument("--cpu-smoke", action="store_true")
p.add_argument("--skip-inductor", action="store_true")
a = p.parse_args()
stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
rows = [{"executor": "aten", "step_ms": 2.0}]
json.dump({"complete": False, "problems": [], "gpt": rows, "stray": stray.pid, "budget": a.budget_s}, open(a.out, "w"))
time.sleep(600)
"""


def test_a_codegen_run_out_of_time_keeps_its_partial_json(tmp_path):
    from benchmarks import gpu_check

    fake = tmp_path / "slow_codegen.py"
    fake.write_text(_SLOW_CODEGEN)
    out = gpu_check.section_codegen(True, limit_s=10, soft_s=7, script=fake)
    assert out["status"] == "failed" and out["timed_out"], out
    assert out["error"] == "timed out after 10 s; partial results kept"
    assert out["results"]["gpt"] == [{"executor": "aten", "step_ms": 2.0}] and out["results"]["budget"] == "7"
    assert not _alive(out["results"]["stray"]), "gpu_codegen's child outlived the kill"
    assert "incomplete: gpt" in gpu_check._summary("codegen", out)


_FALLING_BACK = """
import runpy, sys, time
sys.path.insert(0, {root!r})
from benchmarks._checkout import import_checkout

import_checkout()
import zerofx.codegen.triton_runtime as runtime
from zerofx.codegen.fused_adamw import FusedAdamW


def refuse(kernel):
    raise RuntimeError("simulated Triton compile error")


runtime.load = refuse  # every generated kernel fails to compile, as on a GPU whose Triton rejects them
FusedAdamW.step = lambda self, closure=None: time.sleep(600)  # and the next section hangs
sys.argv = [{script!r}, "--cpu-smoke", "--skip-inductor", "--sections", "gpt,adamw", "--out", {out!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def test_gpu_codegen_writes_each_row_at_once_and_counts_fallbacks_as_problems(tmp_path):
    """The GPT rows are in the JSON while the run still hangs in the next section; the "triton"
    row, whose kernels all fell back to ATen, says so and makes the section degraded."""
    from benchmarks import gpu_check

    out = tmp_path / "codegen.json"
    wrapper = tmp_path / "falling_back.py"
    wrapper.write_text(_FALLING_BACK.format(root=str(ROOT), script=str(CODEGEN), out=str(out)))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(wrapper)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    try:
        results, deadline = None, time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists():
                results = json.loads(out.read_text())
                if len(results.get("gpt", [])) == 2 and "loss_step2" in results["gpt"][1]:
                    break
            time.sleep(1)
        assert proc.poll() is None, "gpu_codegen ended: " + proc.stdout.read().decode()[-2000:]
        assert results and not results["complete"], "no row was written while the run was still going"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    aten, triton = results["gpt"]
    assert aten["triton_launches"] == 0 and aten["triton_fallbacks"] == 0
    assert triton["triton_launches"] == 0 and triton["triton_fallbacks"] > 0, triton
    assert any(p.startswith("gpt/triton: ") and "ATen fallbacks" in p for p in results["problems"])
    status, why = gpu_check._codegen_status(results)
    assert status == "degraded" and "gpt/triton" in why


def test_gpu_codegen_on_a_gpu_drops_an_inherited_triton_interpret(tmp_path):
    """TRITON_INTERPRET=1 left in the environment would send every kernel to the CPU interpreter,
    which refuses CUDA tensors: on a GPU run it is removed before triton is imported (here there is
    no GPU, so the run stops after its info line)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, str(CODEGEN), "--out", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert run.returncode != 0 and "no CUDA device" in run.stderr
    info = json.loads(run.stdout.splitlines()[0])
    assert info["triton_interpreter"] is False and info["removed_TRITON_INTERPRET"] == "1", info


def test_a_broken_import_is_one_failed_section_not_a_crash(tmp_path):
    """A torch without the APIs the check needs (here: torch.distributed.fsdp made unimportable
    before anything runs) fails the imports section, with the import's own message, and the
    driver still writes its JSON and table."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text('import sys\nsys.modules["torch.distributed.fsdp"] = None\n')
    out, md = tmp_path / "gc.json", tmp_path / "gc.md"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    run = _smoke("imports", out, md, timeout=180, env=env)
    assert run.returncode == 1, run.stdout + run.stderr
    imports = json.loads(out.read_text())["sections"]["imports"]
    assert imports["status"] == "failed" and "torch.distributed.fsdp" in imports["error"], imports
    assert "| imports | failed | " in md.read_text() and "torch.distributed.fsdp" in md.read_text()


@pytest.mark.parametrize("used", [1.0, 0.5, 0.0])
def test_section_limits_add_up_to_the_budget_grace_included(used):
    """Every section killed at its limit (used=1), or ending early and leaving time to the next:
    the limits never add up to more than the budget, and each soft budget keeps its grace
    (min(60 s, a quarter of the limit)) inside the limit."""
    from benchmarks import gpu_check

    budget, spent = 420.0, 0.0
    names = list(gpu_check.SECTIONS)
    for i, name in enumerate(names):
        limit, soft = gpu_check.allot(name, names[i + 1 :], budget - spent, budget)
        assert limit >= gpu_check.SHARE[name] * budget - 1e-9  # every section gets at least its share
        assert soft == pytest.approx(limit - min(gpu_check.GRACE_S, limit / 4))
        spent += used * limit
        assert spent <= budget + 1e-9
    assert sum(gpu_check.SHARE.values()) == pytest.approx(1.0)


def test_peers_rows_are_labelled_and_reported_one_by_one():
    """zerofx in fp32 at one rank shards nothing: its row says so; the bf16 row is the one that
    shards (and is timed against FSDP2 with the same mixed precision). A result line follows
    each row, so a timeout keeps the rows done."""
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from benchmarks import gpu_check
        gpu_check.section_peers(True, methods=("zerofx", "zerofx_bf16", "fsdp2_bf16"))
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(ln.split(" ", 1)[1]) for ln in run.stdout.splitlines() if ln.startswith("GPU_CHECK_RESULT ")]
    assert [list(r["rows"]) for r in lines] == [
        ["zerofx"],
        ["zerofx", "zerofx_bf16"],
        ["zerofx", "zerofx_bf16", "fsdp2_bf16"],
    ]
    rows = lines[-1]["rows"]
    assert rows["zerofx"]["label"] == "zerofx (1 rank: unsharded)" and "error" not in rows["zerofx_bf16"], rows
    assert rows["zerofx_bf16"]["vs"] == "fsdp2_bf16" and rows["zerofx_bf16"]["vs_ratio"] > 0
