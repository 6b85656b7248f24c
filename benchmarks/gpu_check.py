"""The one-call GPU check: what works on a CUDA GPU, and how fast, in under 8 minutes.

    python benchmarks/gpu_check.py --json gpu_check.json --markdown gpu_check.md
    python benchmarks/gpu_check.py --cpu-smoke      # the same sections on CPU, tiny: checks the script

On a machine with one NVIDIA GPU. Each section runs in its own process (a CUDA error or a hang
in one cannot take the others down) under a share of the time budget (``--budget-s``, default
420), and reports ``ok``, ``failed`` (with the first line of the error) or ``skipped`` (budget):

* ``parity_w1``     ``zerofx.testing.verify`` (the exact-parity oracle) of the GPT on the GPU,
                    1 rank, 5 AdamW steps: losses, gradients and parameters against the
                    unsharded replica, bit for bit;
* ``parity_w2_gloo`` the same on 2 processes sharing the GPU, gloo moving CUDA tensors
                    (ZeRO-3: real all-gathers and reduce-scatters of device memory);
* ``parity_w2_nccl`` 2 processes on the one GPU with NCCL: NCCL refuses two ranks on one device
                    (expected to fail; reported so that it is known, not guessed);
* ``peers_w1``      one training step of the medium GPT at 1 rank: zerofx (default), FSDP2 eager,
                    FSDP2 + torch.compile and the plain model, step time (median, CUDA-synchronized)
                    and peak device memory (``torch.cuda.max_memory_allocated`` above what was
                    allocated before the model was built);
* ``codegen``       benchmarks/gpu_codegen.py (Triton kernels vs ATen vs Inductor, FusedAdamW vs
                    torch's fused AdamW, the GPT step per executor), its JSON folded in.

The markdown table is what goes in the README, with the command; the JSON has every number.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks._checkout import import_checkout  # noqa: E402

import_checkout()  # here, not in main: the ranks' processes import this module too

RESULT = "GPU_CHECK_RESULT "
SECTIONS = ("parity_w1", "parity_w2_gloo", "parity_w2_nccl", "peers_w1", "codegen")
SHARE = {"parity_w1": 0.12, "parity_w2_gloo": 0.2, "parity_w2_nccl": 0.08, "peers_w1": 0.25, "codegen": 0.35}


# -- the model --------------------------------------------------------------------------------------


def gpt_config(smoke: bool, size: str = "small"):
    from zerofx.models import GPTConfig

    if smoke:
        return GPTConfig(vocab_size=96, seq_len=16, n_layer=2, n_head=4, d_model=32)
    if size == "medium":
        return GPTConfig(vocab_size=8192, seq_len=512, n_layer=6, n_head=12, d_model=768)
    return GPTConfig(vocab_size=1024, seq_len=128, n_layer=4, n_head=8, d_model=256)


def gpt_factory(device: str, smoke: bool):
    """``zerofx.testing.verify``'s factory: the GPT on ``device`` and batches made there."""
    import torch

    from zerofx.models import GPT, random_batch

    cfg = gpt_config(smoke)
    model = GPT(cfg).to(device)

    def batch_fn(n: int, gen: torch.Generator):
        return tuple(t.to(device) for t in random_batch(cfg, n, gen))

    return model, batch_fn


def _device(smoke: bool) -> str:
    return "cpu" if smoke else "cuda"


# -- sections (each in its own process) ----------------------------------------------------------------


def _verify_rank(device: str, smoke: bool, backend: str) -> dict:
    """One rank of a parity section: the oracle's report, summarized."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from zerofx.testing import verify

    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    try:
        mesh = init_device_mesh(device, (dist.get_world_size(),))
        report = verify(gpt_factory, mesh, steps=5, factory_kwargs={"device": device, "smoke": smoke}).to_json()
    finally:
        dist.destroy_process_group()
    return {
        "ok": report["ok"],
        "problem": report["problem"],
        "losses": [s["loss"] for s in report["steps"]],
        "first_divergence": report["first_divergence"],
    }


def section_parity(world: int, backend: str, smoke: bool) -> dict:
    from benchmarks import gpu_check  # the ranks import the function from the package, not __main__
    from zerofx.launch import local_ranks

    device = _device(smoke)
    per_rank = local_ranks(gpu_check._verify_rank, world, device, smoke, backend, name=f"gpu-check-{backend}")
    ok = all(r["ok"] for r in per_rank)
    out = {"status": "ok" if ok else "failed", "world": world, "backend": backend, "ranks": per_rank}
    if not ok:
        bad = next(r for r in per_rank if not r["ok"])
        out["error"] = bad["problem"] or f"divergence: {bad['first_divergence']}"
    return out


def _step_fn(model, opt, x, y):
    def step():
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def section_peers(smoke: bool) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import zerofx
    from zerofx.models import GPT, random_batch

    device = _device(smoke)
    store = Path(tempfile.mkdtemp()) / "store"
    dist.init_process_group("gloo" if smoke else "nccl", init_method=f"file://{store}", rank=0, world_size=1)
    mesh = init_device_mesh(device, (1,))
    cfg = gpt_config(smoke, "medium")
    batch = 2 if smoke else 8
    x, y = (t.to(device) for t in random_batch(cfg, batch, torch.Generator().manual_seed(0)))
    cuda = device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def build(method: str):
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        if method == "zerofx":
            return zerofx.compile(model, mesh)
        if method.startswith("fsdp2"):
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return torch.compile(model) if method == "fsdp2_compile" else model
        return model

    rows = {}
    try:
        for method in ("plain", "zerofx", "fsdp2", "fsdp2_compile"):
            row: dict[str, Any] = {}
            try:
                sync()
                before = torch.cuda.memory_allocated() if cuda else 0
                model = build(method)
                opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
                step = _step_fn(model, opt, x, y)
                t = time.perf_counter()
                for _ in range(3):  # compiles, optimizer state
                    step()
                sync()
                row["warmup_s"] = time.perf_counter() - t
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                times = []
                for _ in range(3 if smoke else 10):
                    sync()
                    t = time.perf_counter()
                    step()
                    sync()
                    times.append(time.perf_counter() - t)
                row["step_ms"] = statistics.median(times) * 1e3
                if cuda:
                    row["peak_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20
                del model, opt, step
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            torch._dynamo.reset()
            if cuda:
                torch.cuda.empty_cache()
            rows[method] = row
    finally:
        dist.destroy_process_group()
    base = rows.get("fsdp2", {}).get("step_ms")
    for row in rows.values():
        if base and "step_ms" in row:
            row["vs_fsdp2"] = row["step_ms"] / base
    failed = [m for m, r in rows.items() if "error" in r]
    return {
        "status": "failed" if failed else "ok",
        "rows": rows,
        **({"error": f"{failed[0]}: {rows[failed[0]]['error']}"} if failed else {}),
    }


def section_codegen(smoke: bool, budget_s: float) -> dict:
    out = Path(tempfile.mkdtemp()) / "gpu_codegen.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_codegen.py"), "--out", str(out), "--budget-s", str(budget_s)]
    if smoke:
        cmd += ["--cpu-smoke", "--skip-inductor"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=budget_s + 120)
    if run.returncode != 0 or not out.exists():
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"status": "failed", "error": f"gpu_codegen.py exit {run.returncode}: {tail[0]}"}
    return {"status": "ok", "results": json.loads(out.read_text())}


def run_child(name: str, smoke: bool, budget_s: float) -> dict:
    if name == "parity_w1":
        return section_parity(1, "gloo", smoke)
    if name == "parity_w2_gloo":
        return section_parity(2, "gloo", smoke)
    if name == "parity_w2_nccl":
        return section_parity(2, "nccl", smoke)
    if name == "peers_w1":
        return section_peers(smoke)
    if name == "codegen":
        return section_codegen(smoke, budget_s)
    raise ValueError(name)


# -- driver -------------------------------------------------------------------------------------------


def _environment(smoke: bool) -> dict:
    import torch

    env = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "cpu_smoke": smoke}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        env["cuda"] = torch.version.cuda
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def _run_section(name: str, smoke: bool, budget_s: float) -> dict:
    """``name`` in a child process bounded by ``budget_s`` (plus start-up): its result line, or a
    failure saying why (exit status, timeout) with the last line it printed."""
    cmd = [sys.executable, __file__, "--child", name, "--budget-s", str(budget_s)] + (["--cpu-smoke"] if smoke else [])
    started = time.perf_counter()
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=budget_s + 60)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"timed out after {budget_s + 60:.0f} s", "seconds": budget_s + 60}
    seconds = time.perf_counter() - started
    for line in reversed(run.stdout.splitlines()):
        if line.startswith(RESULT):
            return {**json.loads(line[len(RESULT) :]), "seconds": seconds}
    lines = [ln for ln in (run.stderr + run.stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return {"status": "failed", "error": (errors or lines or ["no output"])[-1][:300], "seconds": seconds}


def _summary(name: str, r: dict) -> str:
    if r.get("status") != "ok":
        return r.get("error", r.get("status", ""))
    if name.startswith("parity"):
        return f"bit-identical to the unsharded replica over 5 steps ({r['world']} rank(s), {r['backend']})"
    if name == "peers_w1":
        parts = []
        for method, row in r["rows"].items():
            cell = f"{method} {row['step_ms']:.1f} ms" if "step_ms" in row else f"{method} error"
            if "vs_fsdp2" in row:
                cell += f" ({row['vs_fsdp2']:.2f}x)"
            if "peak_mib" in row:
                cell += f", {row['peak_mib']:.0f} MiB"
            parts.append(cell)
        return "; ".join(parts)
    if name == "codegen":
        gpt = r["results"].get("gpt", [])
        return "; ".join(f"{g['executor']} {g['step_ms']:.1f} ms" for g in gpt if "step_ms" in g) or "see JSON"
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU: check the script without a GPU")
    parser.add_argument("--budget-s", type=float, default=420.0, help="time for all sections (default 420)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [n for n in args.sections.split(",") if n and n not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown section(s) {', '.join(unknown)}: choose from {', '.join(SECTIONS)}")
    if args.cpu_smoke:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.child:
        try:
            result = run_child(args.child, args.cpu_smoke, args.budget_s)
        except Exception as e:
            traceback.print_exc()
            result = {"status": "failed", "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        print(RESULT + json.dumps(result, default=str), flush=True)
        return 0
    env = _environment(args.cpu_smoke)
    if not args.cpu_smoke and not env["cuda_available"]:
        print("gpu_check: no CUDA device here (run it on a GPU machine, or --cpu-smoke to check the script)")
        return 2
    print(json.dumps(env))
    started = time.perf_counter()
    names = [n for n in args.sections.split(",") if n]
    results: dict[str, Any] = {}
    for i, name in enumerate(names):
        if name == "parity_w2_nccl" and args.cpu_smoke:
            results[name] = {"status": "skipped", "error": "NCCL needs a GPU"}
            continue
        left = args.budget_s - (time.perf_counter() - started)
        later = sum(args.budget_s * SHARE[n] for n in names[i + 1 :])
        budget = max(args.budget_s * SHARE[name], left - later)  # its share, plus what earlier ones left
        if left < 30:
            results[name] = {"status": "skipped", "error": f"time budget ({left:.0f} s left)"}
            continue
        results[name] = _run_section(name, args.cpu_smoke, min(budget, left))
        print(f"{name}: {results[name]['status']} ({results[name].get('seconds', 0):.0f} s)", flush=True)
    lines = [
        f"GPU check on {env.get('device', 'CPU (smoke)')} (torch {env['torch']}, triton {env['triton']}"
        + (f", CUDA {env['cuda']}, NCCL {env['nccl']}" if env.get("cuda") else "")
        + f"), {time.perf_counter() - started:.0f} s",
        "",
        "| section | status | result |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {r['status']} | {_summary(n, r)} |" for n, r in results.items()]
    table = "\n".join(lines)
    print("\n" + table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": env, "sections": results}, indent=2, default=str))
    return 0 if all(r["status"] != "failed" or n == "parity_w2_nccl" for n, r in results.items()) else 1


if __name__ == "__main__":
    sys.exit(main())
