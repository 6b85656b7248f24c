"""benchmarks/gpu_check.py keeps working while no GPU is around to run it: its CPU smoke mode
runs a section through the same child-process driver, and without --cpu-smoke it says there
is no CUDA device instead of failing somewhere inside."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_cpu_smoke_runs_a_parity_section_and_writes_the_table(tmp_path):
    out, md = tmp_path / "gc.json", tmp_path / "gc.md"
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--cpu-smoke",
            "--sections",
            "parity_w1,parity_w2_nccl",
            "--json",
            str(out),
            "--markdown",
            str(md),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    sections = json.loads(out.read_text())["sections"]
    assert sections["parity_w1"]["status"] == "ok", sections["parity_w1"]
    assert (
        all(r["ok"] for r in sections["parity_w1"]["ranks"]) and len(sections["parity_w1"]["ranks"][0]["losses"]) == 5
    )
    assert sections["parity_w2_nccl"]["status"] == "skipped"
    table = md.read_text()
    assert "| parity_w1 | ok | bit-identical to the unsharded replica" in table


def test_without_a_gpu_it_says_so():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "no CUDA device here" in run.stdout
