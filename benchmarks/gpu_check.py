"""The one-call GPU check: what works on a CUDA GPU, and how fast, in under 8 minutes.

    python benchmarks/gpu_check.py --json gpu_check.json --markdown gpu_check.md
    python benchmarks/gpu_check.py --cpu-smoke      # the same sections on CPU, tiny: checks the script

On a machine with one NVIDIA GPU. Each section runs in its own process group (a CUDA error or a
hang in one cannot take the others down, and a killed section leaves no rank behind on the GPU)
and reports ``ok``, ``degraded`` (it ran, but not as it claims: a Triton kernel fell back to
ATen, a result out of tolerance), ``failed`` (with the cause: the first line of the error, a
rank's own exception, or the timeout and what had been printed by then) or ``skipped`` (budget):

* ``imports``       first: Python, torch, Triton, CUDA and NCCL versions, zerofx and the torch
                    APIs this script calls imported, one matrix product on the GPU, whether
                    Triton can launch there. A version incompatibility shows here, as one failed
                    section, not as a crash of the driver (which never imports zerofx itself);
* ``parity_w1``     ``zerofx.testing.verify`` (the exact-parity oracle) of the GPT on the GPU,
                    1 rank, 5 AdamW steps: losses, gradients and parameters against the
                    unsharded replica, bit for bit, under deterministic algorithms, a fixed
                    cuBLAS workspace and SDPA's math backend (recorded per rank);
* ``parity_w2_gloo`` the same on 2 processes sharing the GPU, gloo moving CUDA tensors
                    (ZeRO-3: real all-gathers and reduce-scatters of device memory);
* ``parity_w2_nccl`` first a bare probe (2 ranks on the one GPU, ``init_process_group("nccl")``
                    with ``device_id``, one all-reduce of a CUDA tensor), its exact result or
                    error recorded: NCCL is expected to refuse two ranks on one device. Only if
                    the probe works does the parity run follow. On CPU the probe's plumbing
                    runs over gloo and the section is skipped;
* ``peers_w1``      one training step of the medium GPT at 1 rank, step time (median,
                    CUDA-synchronized) and peak device memory (``torch.cuda.max_memory_allocated``
                    above what was allocated before the model was built, after a warm-up matrix
                    product has allocated cuBLAS's workspaces): the plain model; zerofx in fp32,
                    which at one rank shards nothing (labelled so) against FSDP2 eager, which
                    still makes its copies; zerofx with ``param_dtype=bf16``, which does shard
                    and cast at one rank, against FSDP2 with the same mixed precision; FSDP2 +
                    torch.compile. A result line follows each row, so a timeout keeps the rows done;
* ``codegen``       benchmarks/gpu_codegen.py (Triton kernels vs ATen vs Inductor, FusedAdamW vs
                    torch's fused AdamW, the GPT step per executor), its JSON folded in, partial
                    if it ran out of time; ``degraded`` where a Triton kernel fell back to ATen
                    or a result was out of tolerance.

Time, by construction. ``--budget-s`` B (default 420) bounds all sections together, grace
included. Section i, with share s_i of B (``SHARE``, summing to 1), gets a hard limit

    L_i = min(left, max(s_i * B, left - sum_{j > i} s_j * B))

its share plus whatever earlier sections left unused, never what later ones are owed; at L_i
its whole process group is killed. It is told a soft budget L_i - g_i, g_i = min(60 s, L_i / 4),
after which it starts nothing new: the grace for work in flight is inside L_i, not added to it.
``left`` is read off the clock, so a kill that takes a second longer shortens the next limit:
the sections end within B plus the last kill's few seconds. With the driver's own start, its
environment line and the table (about 20 s), the default run takes at most 420 + 20 + a few
seconds, under 480 s = 8 minutes, and under one 10-minute call of a lent device.

The markdown table is what goes in the README, with the command; the JSON has every number and
is rewritten after every section.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULT = "GPU_CHECK_RESULT "
RANK = "GPU_CHECK_RANK "
SECTIONS = ("imports", "parity_w1", "parity_w2_gloo", "parity_w2_nccl", "peers_w1", "codegen")
SHARE = {
    # a lent machine starts cold: importing torch and Triton, CUDA's and cuBLAS's start-up and a
    # first Triton compile (FusedAdamW's kernel) fit in 63 s of the default 420 with room to spare
    "imports": 0.15,
    "parity_w1": 0.10,
    "parity_w2_gloo": 0.14,
    "parity_w2_nccl": 0.12,
    "peers_w1": 0.22,
    "codegen": 0.27,
}
GRACE_S = 60.0
MIN_SECTION_S = 15.0  # a section with less than this left is skipped, not started to be killed
KILL_WAIT_S = 3.0  # after a group kill, how long to wait for the pipes to close
CUBLAS_WORKSPACE = ":4096:8"
CODEGEN = ROOT / "benchmarks" / "gpu_codegen.py"


def _checkout() -> None:
    """Import this checkout's zerofx (installed or not). Called by the sections and ranks, never
    at import of this module: the driver must survive a zerofx that does not import (the
    ``imports`` section then says why)."""
    from benchmarks._checkout import import_checkout

    import_checkout()


def _why(e: BaseException) -> str:
    """``Type: first line`` of an exception, plus NCCL's ``Last error:`` line when it has one
    (its first line names only the call; the cause comes after)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    for i, line in enumerate(lines[:-1]):
        if line.startswith("Last error"):
            first += f" (last error: {lines[i + 1]})"
            break
    return f"{type(e).__name__}: {first}"[:500]


def _say(prefix: str, payload: dict) -> None:
    """One machine-readable line on stdout, flushed: what the parent reads even if this process
    is killed later."""
    print(prefix + json.dumps(payload, default=str), flush=True)


def _fsdp2():
    """``fully_shard`` and ``MixedPrecisionPolicy`` where this torch keeps them (public since 2.6)."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def _init_group(backend: str, timeout_s: float, device: str) -> None:
    """``init_process_group`` from the launcher's environment, bound to cuda:0 up front
    (``device_id``: NCCL then connects at init, so a refusal is raised here) where this torch
    takes ``device_id``."""
    import torch
    import torch.distributed as dist

    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if device == "cuda" and backend == "nccl" and "device_id" in inspect.signature(dist.init_process_group).parameters:
        kwargs["device_id"] = torch.device("cuda", 0)
    dist.init_process_group(backend, **kwargs)


def _end_group() -> None:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # a group that already failed: nothing left to report
        pass


def _launch(fn, world: int, *args: Any, name: str) -> list[dict]:
    """``fn`` on ``world`` local ranks (zerofx.launch). The rank functions catch their own
    exceptions; a rank that dies without one (a signal, a crash in C++) makes the launcher raise
    ChildFailedError, whose message is empty: its per-rank failures say what happened."""
    from zerofx.launch import local_ranks

    try:
        return local_ranks(fn, world, *args, name=name)
    except Exception as e:
        failures = getattr(e, "failures", None)
        if not failures:
            raise
        out = []
        for rank, f in sorted(failures.items()):
            message = f.message.get("message", "") if isinstance(f.message, dict) else str(f.message or "")
            if message.startswith("To enable traceback"):  # the launcher's stand-in for "no message"
                message = ""
            signame = f.signal_name() if f.exitcode is not None and f.exitcode < 0 else ""
            how = f"killed by {signame}" if signame and signame != "<N/A>" else f"exit code {f.exitcode}"
            first = next((ln.strip() for ln in message.splitlines() if ln.strip()), "")
            out.append({"ok": False, "rank": rank, "problem": f"rank {rank} {how}" + (f": {first}" if first else "")})
        return out


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


def section_imports(smoke: bool) -> dict:
    """Versions, the imports every other section needs, one product on the device, Triton's
    launch check: a version incompatibility fails here, first, with its own message."""
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported, as gpu_codegen does
    out: dict[str, Any] = {"python": sys.version.split()[0]}
    import torch

    out["torch"] = torch.__version__
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError as e:
        out["triton"] = None
        out["triton_error"] = _why(e)
    _checkout()
    from torch.distributed.device_mesh import init_device_mesh  # noqa: F401

    import zerofx  # noqa: F401
    from zerofx.codegen.triton_runtime import launch_problem
    from zerofx.launch import local_ranks  # noqa: F401
    from zerofx.testing import verify  # noqa: F401

    _fsdp2()
    device = _device(smoke)
    if device == "cuda":
        out["device"] = torch.cuda.get_device_name(0)
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        out["cuda"] = torch.version.cuda
        out["nccl"] = _nccl_version()
    x = torch.randn(256, 256, device=device)
    out["matmul"] = float((x @ x).sum())  # CUDA initialized and cuBLAS loaded, or the error here
    out["triton_launch"] = launch_problem(torch.device(device)) or "ok"
    if out["triton_launch"] != "ok":
        return {"status": "degraded", "error": f"Triton cannot launch kernels here: {out['triton_launch']}", **out}
    out["triton_kernel"] = _one_kernel(device)
    if out["triton_kernel"] != "ok":
        return {"status": "degraded", "error": f"zerofx's FusedAdamW kernel: {out['triton_kernel']}", **out}
    return {"status": "ok", **out}


def _one_kernel(device: str) -> str:
    """One of zerofx's Triton kernels (FusedAdamW's) compiled by this Triton and run, against
    torch's AdamW: "ok", or what went wrong. Seconds here, before any section depends on it."""
    import torch

    from zerofx.codegen.fused_adamw import FusedAdamW

    try:
        ours, theirs = (torch.nn.Parameter(torch.linspace(-1, 1, 96, device=device)) for _ in range(2))
        for p in (ours, theirs):
            p.grad = torch.linspace(1, -1, 96, device=device)
        FusedAdamW([ours], lr=0.1, weight_decay=0.01).step()
        torch.optim.AdamW([theirs], lr=0.1, weight_decay=0.01).step()
        diff = float((ours - theirs).abs().max())
    except Exception as e:
        return _why(e)
    return "ok" if diff <= 1e-6 else f"differs from torch's AdamW by {diff:.3g} after one step"


def _nccl_version() -> str:
    import torch

    try:
        v = torch.cuda.nccl.version()
    except Exception as e:
        return _why(e)
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _deterministic(device: str) -> dict:
    """Make this process's kernels add in a fixed order; returns what was set (recorded per rank).

    Bit-for-bit parity compares two runs of the same model in one process: any kernel that adds
    with atomics (SDPA's memory-efficient and flash backwards, cuBLAS split-K reductions with a
    per-stream workspace) can make them differ by an ulp with no bug in zerofx. cuBLAS reads
    ``CUBLAS_WORKSPACE_CONFIG`` when its first handle is made, so this runs before any CUDA work.
    Deterministic algorithms warn rather than raise on an op without a deterministic kernel
    (the warnings are recorded), so a missing one shows up as a named op, not a lost verdict."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    choice = {"CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"], "deterministic_algorithms": "warn_only"}
    if device == "cuda":
        backends = torch.backends.cuda
        for name in ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp"):
            if hasattr(backends, name):  # cudnn's switch is newer than the others
                getattr(backends, name)(False)
        backends.enable_math_sdp(True)
        choice["sdpa"] = "math"
    return choice


def _verify_rank(device: str, smoke: bool, backend: str, timeout_s: float = 120.0) -> dict:
    """One rank of a parity section: the oracle's report, summarized. Every exception is caught
    and returned as ``problem`` (the launcher would report it as a bare ChildFailedError), and the
    result is also printed as a rank line, which the driver reads if the section is killed."""
    out: dict[str, Any] = {"ok": False, "problem": "", "losses": [], "first_divergence": None}
    try:
        out["determinism"] = _deterministic(device)
        _checkout()
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from zerofx.testing import verify

        if device == "cuda":
            torch.cuda.set_device(0)
        _init_group(backend, timeout_s, device)
        mesh = init_device_mesh(device, (dist.get_world_size(),))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = verify(gpt_factory, mesh, steps=5, factory_kwargs={"device": device, "smoke": smoke}).to_json()
        nondeterministic = sorted({str(w.message).splitlines()[0] for w in caught if "determinis" in str(w.message)})
        out.update(
            ok=report["ok"],
            problem=report["problem"],
            losses=[s["loss"] for s in report["steps"]],
            first_divergence=report["first_divergence"],
        )
        if nondeterministic:
            out["nondeterministic_ops"] = nondeterministic[:5]
    except Exception as e:
        out["ok"], out["problem"] = False, _why(e)
        traceback.print_exc()
    _say(RANK, {"rank": os.environ.get("RANK"), **out})
    _end_group()
    return out


def section_parity(world: int, backend: str, smoke: bool, timeout_s: float = 120.0) -> dict:
    from benchmarks import gpu_check  # the ranks import the function from the package, not __main__

    _checkout()
    device = _device(smoke)
    per_rank = _launch(gpu_check._verify_rank, world, device, smoke, backend, timeout_s, name=f"gpu-check-{backend}")
    ok = len(per_rank) == world and all(r["ok"] for r in per_rank)
    out = {"status": "ok" if ok else "failed", "world": world, "backend": backend, "ranks": per_rank}
    if per_rank and "determinism" in per_rank[0]:
        out["determinism"] = per_rank[0]["determinism"]
    if not ok:
        bad = next((r for r in per_rank if not r["ok"]), {"problem": f"{len(per_rank)} of {world} ranks reported"})
        out["error"] = bad["problem"] or f"divergence: {bad.get('first_divergence')}"
    return out


def _probe_rank(backend: str, device: str, timeout_s: float) -> dict:
    """One rank of the bare NCCL probe: init (bound to cuda:0) and one all-reduce of a CUDA
    tensor, nothing of zerofx. Returns what happened, the full error message included."""
    out: dict[str, Any] = {"ok": False, "backend": backend}
    try:
        import torch
        import torch.distributed as dist

        if device == "cuda":
            torch.cuda.set_device(0)
        _init_group(backend, timeout_s, device)
        t = torch.full((4,), float(dist.get_rank() + 1), device=device)
        dist.all_reduce(t)
        if device == "cuda":
            torch.cuda.synchronize()
        want = dist.get_world_size() * (dist.get_world_size() + 1) / 2
        out.update(ok=bool((t == want).all()), value=t.tolist(), expected=want)
        if not out["ok"]:
            out["problem"] = f"all_reduce gave {t.tolist()}, expected {want}"
    except Exception as e:
        out["problem"], out["message"] = _why(e), str(e)[:2000]
    _say(RANK, {"rank": os.environ.get("RANK"), **out})
    _end_group()
    return out


def section_nccl_probe(smoke: bool, timeout_s: float) -> dict:
    from benchmarks import gpu_check

    _checkout()
    backend, device = ("gloo", "cpu") if smoke else ("nccl", "cuda")
    per_rank = _launch(gpu_check._probe_rank, 2, backend, device, timeout_s, name="gpu-check-probe")
    ok = len(per_rank) == 2 and all(r["ok"] for r in per_rank)
    out = {"status": "ok" if ok else "failed", "backend": backend, "device": device, "ranks": per_rank}
    if not ok:
        out["error"] = next((r.get("problem") for r in per_rank if not r["ok"]), "") or "a rank did not report"
    return out


def section_nccl(smoke: bool, soft_s: float) -> dict:
    """The bare probe first, in its own process group with a limit well inside this section's,
    reported at once; the parity run over NCCL only if the probe worked."""
    started = time.perf_counter()
    limit = min(soft_s, 90.0, max(30.0, 0.5 * soft_s))  # inside this section's own limit
    cmd = [sys.executable, __file__, "--child", "nccl_probe", "--budget-s", f"{limit - 5:.0f}"]
    probe = _collect(cmd + (["--cpu-smoke"] if smoke else []), limit, own_group=False)
    _say(RESULT, {"status": "partial", "probe": probe, "error": "the probe ran; the parity run did not end"})
    said = probe.get("error") or "one all_reduce worked on 2 ranks"
    if smoke:
        return {"status": "skipped", "error": "NCCL needs a GPU (the probe's plumbing ran over gloo)", "probe": probe}
    if probe.get("status") != "ok":
        return {"status": "failed", "expected": True, "error": f"NCCL, 2 ranks on one GPU: {said}", "probe": probe}
    left = soft_s - (time.perf_counter() - started)
    out = section_parity(2, "nccl", smoke, timeout_s=max(20.0, min(120.0, left / 2)))
    return {**out, "probe": probe}


def _step_fn(model, opt, x, y):
    def step():
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


# peers_w1's rows in the order they run, with the label the table gives them, and the row each
# is timed against: zerofx at one rank shards nothing in fp32 (FSDP2 still makes its copies), so
# its fp32 row says so; with bf16 parameters it shards and casts, like FSDP2's mixed precision
PEERS = {
    "plain": ("plain model", "fsdp2"),
    "zerofx": ("zerofx (1 rank: unsharded)", "fsdp2"),
    "fsdp2": ("FSDP2", "fsdp2"),
    "zerofx_bf16": ("zerofx bf16 params (1 rank: sharded)", "fsdp2_bf16"),
    "fsdp2_bf16": ("FSDP2 bf16 params", "fsdp2_bf16"),
    "fsdp2_compile": ("FSDP2 + compile", "fsdp2"),
}


def _peer_ratios(rows: dict) -> None:
    for method, row in rows.items():
        base = rows.get(PEERS[method][1], {}).get("step_ms")
        if base and "step_ms" in row:
            row["vs"] = PEERS[method][1]
            row["vs_ratio"] = row["step_ms"] / base


def section_peers(smoke: bool, soft_s: float = 1e9, methods: tuple[str, ...] = tuple(PEERS)) -> dict:
    import torch
    import torch.distributed as dist

    _checkout()
    from torch.distributed.device_mesh import init_device_mesh

    import zerofx
    from zerofx.models import GPT, random_batch

    deadline = time.perf_counter() + soft_s
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
        if method == "zerofx_bf16":
            return zerofx.compile(model, mesh, param_dtype=torch.bfloat16)
        if method.startswith("fsdp2"):
            fully_shard, MixedPrecisionPolicy = _fsdp2()
            kwargs = {}
            if method == "fsdp2_bf16":  # zerofx's default reduce_dtype is the fp32 master's
                kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.blocks:
                fully_shard(block, mesh=mesh, **kwargs)
            fully_shard(model, mesh=mesh, **kwargs)
            return torch.compile(model) if method == "fsdp2_compile" else model
        return model

    out: dict[str, Any] = {"rows": {}, "labels": {m: PEERS[m][0] for m in methods}}
    if cuda:  # cuBLAS and cuBLASLt allocate their workspaces at their first products: not the first row's peak
        a = torch.randn(1024, 1024, device=device, requires_grad=True)
        for dtype in (torch.float32, torch.bfloat16):
            (a.to(dtype) @ a.to(dtype)).float().sum().backward()
        sync()
        del a
        out["warmup"] = "fp32 and bf16 matmul forward and backward before the rows"
    rows = out["rows"]
    try:
        for method in methods:
            row: dict[str, Any] = {"label": PEERS[method][0]}
            rows[method] = row
            reserve = 0.0 if smoke else (45.0 if method == "fsdp2_compile" else 10.0)
            if time.perf_counter() + reserve > deadline:
                row["skipped"] = "time budget"
                continue
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
                row["error"] = _why(e)
            torch._dynamo.reset()
            if cuda:
                torch.cuda.empty_cache()
            _peer_ratios(rows)
            _say(RESULT, {**out, "status": "partial", "error": f"ended after row {method}"})
    finally:
        _end_group()
    failed = [m for m, r in rows.items() if "error" in r]
    out["status"] = "failed" if failed else "ok"
    if failed:
        out["error"] = f"{PEERS[failed[0]][0]}: {rows[failed[0]]['error']}"
    return out


def _codegen_status(results: dict | None) -> tuple[str, str]:
    """gpu_codegen's verdict on its own results: degraded where it listed problems (a kernel
    that fell back to ATen, a result out of tolerance, a row that raised)."""
    problems = (results or {}).get("problems") or []
    if problems:
        return "degraded", "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
    return "ok", ""


def section_codegen(smoke: bool, limit_s: float, soft_s: float, script: Path = CODEGEN) -> dict:
    """benchmarks/gpu_codegen.py (``script``) in a process group of its own, told the soft budget
    and killed at the limit. It rewrites its JSON after every row, so what it finished is kept
    whether it ends, fails or is killed."""
    out = Path(tempfile.mkdtemp()) / "gpu_codegen.json"
    cmd = [sys.executable, str(script), "--out", str(out), "--budget-s", f"{soft_s:.0f}"]
    if smoke:
        cmd += ["--cpu-smoke", "--skip-inductor"]
    started = time.perf_counter()
    code, stdout, stderr = _run_group(cmd, limit_s)
    seconds = time.perf_counter() - started
    results = None
    if out.exists():
        try:
            results = json.loads(out.read_text())
        except ValueError as e:
            results = {"unreadable": _why(e)}
    kept = {"results": results, "seconds": seconds} if results else {"seconds": seconds}
    status, problems = _codegen_status(results)
    if code is None:
        error = f"timed out after {limit_s:.0f} s" + ("; partial results kept" if results else "")
        return {"status": "failed", "error": error + (f"; {problems}" if problems else ""), "timed_out": True, **kept}
    if code != 0 or results is None:
        return {"status": "failed", "error": f"gpu_codegen.py exit {code}: {_last_error(stdout, stderr)}", **kept}
    return {"status": status, **({"error": problems} if problems else {}), "results": results, "seconds": seconds}


def run_child(name: str, smoke: bool, soft_s: float) -> dict:
    """A section, in this (child) process; ``soft_s`` is its soft budget."""
    if name == "imports":
        return section_imports(smoke)
    pg_timeout = max(30.0, min(120.0, soft_s / 2))  # how long a rank waits for a peer that is gone
    if name == "parity_w1":
        return section_parity(1, "gloo", smoke, pg_timeout)
    if name == "parity_w2_gloo":
        return section_parity(2, "gloo", smoke, pg_timeout)
    if name == "parity_w2_nccl":
        return section_nccl(smoke, soft_s)
    if name == "nccl_probe":
        return section_nccl_probe(smoke, timeout_s=max(15.0, soft_s / 2))
    if name == "peers_w1":
        return section_peers(smoke, soft_s)
    raise ValueError(name)


# -- process groups, limits, results ------------------------------------------------------------------


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _text(b: Any) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _run_group(cmd: list[str], limit_s: float, own_group: bool = True) -> tuple[int | None, str, str]:
    """Run ``cmd`` as the leader of a new process group (session), bounded by ``limit_s``.

    On timeout the whole group is killed: the child and what it started (rank processes,
    compile workers), which would otherwise go on using the GPU after this script has moved on.
    After a normal end the group is killed too, for strays the child left. Returns (exit status,
    or None on timeout; stdout; stderr), with whatever was printed before a kill.

    A section's own sub-process (``own_group=False``) stays in the section's group instead: if
    the section is killed first, it goes too (a group of its own would outlive the section with
    nobody left to enforce its limit); on its own timeout only it is killed, and what it started
    goes when the driver kills the section's group."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=own_group)
    code: int | None = None
    try:
        out, err = proc.communicate(timeout=limit_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        if own_group:
            _kill_group(proc.pid)
        else:
            proc.kill()
        try:
            out, err = proc.communicate(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired as e:  # something outside the group holds the pipes
            out, err = _text(e.stdout), _text(e.stderr)
            proc.kill()
    finally:
        if own_group:
            _kill_group(proc.pid)
    return code, out or "", err or ""


def _last_error(stdout: str, stderr: str) -> str:
    lines = [ln for ln in (stderr + "\n" + stdout).splitlines() if ln.strip() and not ln.startswith((RESULT, RANK))]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["no output"])[-1].strip()[:300]


def _lines(stdout: str, prefix: str) -> list[dict]:
    found = []
    for line in stdout.splitlines():
        if line.startswith(prefix):
            try:
                found.append(json.loads(line[len(prefix) :]))
            except ValueError:
                pass  # cut short by the kill
    return found


def _collect(cmd: list[str], limit_s: float, own_group: bool = True) -> dict:
    """Run a section's command under ``limit_s`` and read its result: the last result line it
    printed; after a timeout, that line (sections print partial ones as they go) marked failed,
    with the ranks' own problems when no result line came."""
    started = time.perf_counter()
    code, stdout, stderr = _run_group(cmd, limit_s, own_group)
    seconds = time.perf_counter() - started
    results, ranks = _lines(stdout, RESULT), _lines(stdout, RANK)
    last = results[-1] if results else {}
    if last and last.get("status") != "partial":  # its final result, even if it then hung on its way out
        return {
            **last,
            "seconds": seconds,
            **({"note": f"did not exit; killed at {limit_s:.0f} s"} if code is None else {}),
        }
    if code is None:
        cause = f"timed out after {limit_s:.0f} s"
    else:
        cause = f"exit {code}" + ("" if last else f": {_last_error(stdout, stderr)}")
    problems = [f"rank {r.get('rank')}: {r['problem']}" for r in ranks if r.get("problem")]
    if ranks and not problems:
        problems = [f"{len(ranks)} rank(s) had reported ok"]
    detail = (last.get("error") if last else "") or "; ".join(problems)
    out = {**last, "status": "failed", "error": cause + (f" ({detail})" if detail else ""), "seconds": seconds}
    if last:
        out["partial"] = True
    if code is None:
        out["timed_out"] = True
    if ranks and "ranks" not in out:
        out["ranks"] = ranks
    return out


def allot(name: str, later: list[str], left: float, budget_s: float) -> tuple[float, float]:
    """(hard limit, soft budget) of section ``name`` with ``left`` seconds of the budget left and
    ``later`` sections still to run: the arithmetic of the module docstring."""
    owed = sum(SHARE[n] * budget_s for n in later)
    limit = min(left, max(SHARE[name] * budget_s, left - owed))
    return limit, limit - min(GRACE_S, limit / 4)


def _run_section(name: str, smoke: bool, limit_s: float, soft_s: float) -> dict:
    if name == "codegen":
        return section_codegen(smoke, limit_s, soft_s)
    cmd = [sys.executable, __file__, "--child", name, "--budget-s", f"{soft_s:.0f}"] + (
        ["--cpu-smoke"] if smoke else []
    )
    return _collect(cmd, limit_s)


# -- the table ------------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")[:700]


def _details(name: str, r: dict) -> str:
    if name == "imports":
        if "torch" not in r:
            return ""
        parts = [f"Python {r.get('python')}, torch {r['torch']}, triton {r.get('triton')}"]
        if r.get("device"):
            parts.append(f"{r['device']} (sm {r.get('capability')}), CUDA {r.get('cuda')}, NCCL {r.get('nccl')}")
        parts.append(f"zerofx imported; Triton launch: {r.get('triton_launch')}, kernel: {r.get('triton_kernel')}")
        return "; ".join(parts)
    if name.startswith("parity"):
        parts = []
        probe = r.get("probe")
        if probe:
            said = probe.get("error") or f"one all_reduce of a {probe.get('device', 'cuda')} tensor ok on 2 ranks"
            said = "" if said in (r.get("error") or "") else f", {said}"  # (a refusal is the section's error too)
            parts.append(f"probe ({probe.get('backend', 'nccl')}): {probe.get('status')}{said}")
        if r.get("status") == "ok":
            det = r.get("determinism") or {}
            how = "deterministic algorithms" + (f", SDPA {det['sdpa']}" if det.get("sdpa") else "") if det else ""
            parts.append(
                f"bit-identical to the unsharded replica over 5 steps ({r['world']} rank(s), {r['backend']}"
                + (f"; {how}" if how else "")
                + ")"
            )
        nondet = sorted({op for rank in r.get("ranks", []) for op in rank.get("nondeterministic_ops", [])})
        if nondet:
            parts.append(f"nondeterministic ops warned: {nondet[0]}")
        return "; ".join(parts)
    if name == "peers_w1":
        cells = []
        for method, row in (r.get("rows") or {}).items():
            label = row.get("label", method)
            if "step_ms" in row:
                cell = f"{label} {row['step_ms']:.1f} ms"
                if "vs_ratio" in row and row.get("vs") != method:
                    cell += f" ({row['vs_ratio']:.2f}x {PEERS[row['vs']][0]})"
                if "peak_mib" in row:
                    cell += f", {row['peak_mib']:.0f} MiB"
            elif "skipped" in row:
                cell = f"{label} skipped ({row['skipped']})"
            else:
                cell = f"{label} error ({row.get('error', '')})"
            cells.append(cell)
        return "; ".join(cells)
    if name == "codegen":
        res = r.get("results") or {}
        cells = []
        for g in res.get("gpt", []):
            if "step_ms" in g:
                cell = f"{g['executor']} {g['step_ms']:.1f} ms"
                if g["executor"] == "triton":
                    cell += f" ({g.get('triton_launches', '?')} kernel launches, {g.get('triton_fallbacks', '?')} ATen fallbacks)"
                cells.append(cell)
            elif "note" in g:
                cells.append(f"{g['executor']}: {g['note']}")
        if res and not res.get("complete"):
            cells.append("incomplete: " + ", ".join(k for k in ("regions", "adamw", "gpt") if k in res))
        return "; ".join(cells) or ("see JSON" if res else "")
    return ""


def _summary(name: str, r: dict) -> str:
    """The table's result cell: the cause first for anything not ok, then what the section measured."""
    parts = []
    if r.get("status") != "ok":
        parts.append(r.get("error") or r.get("status", ""))
    detail = _details(name, r)
    if detail:
        parts.append(detail)
    return _cell(" — ".join(parts))


def _environment(smoke: bool) -> dict:
    """The driver's own look at the machine; torch only (never zerofx), and a failure recorded
    rather than raised: the ``imports`` section then says more."""
    env: dict[str, Any] = {"cpu_smoke": smoke, "python": sys.version.split()[0]}
    try:
        import torch

        env.update(torch=torch.__version__, cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            env["device"] = torch.cuda.get_device_name(0)
            env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
            env["cuda"] = torch.version.cuda
            env["nccl"] = _nccl_version()
    except Exception as e:
        env["error"] = _why(e)
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:
        env["triton"] = None
        env["triton_error"] = _why(e)
    return env


def _write(args: argparse.Namespace, env: dict, results: dict, started: float) -> str:
    lines = [
        f"GPU check on {env.get('device', 'CPU (smoke)')} (torch {env.get('torch')}, triton {env.get('triton')}"
        + (f", CUDA {env['cuda']}, NCCL {env['nccl']}" if env.get("cuda") else "")
        + f"), {time.perf_counter() - started:.0f} s",
        "",
        "| section | status | result |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {r['status']} | {_summary(n, r)} |" for n, r in results.items()]
    table = "\n".join(lines)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": env, "sections": results}, indent=2, default=str))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU: check the script without a GPU")
    parser.add_argument("--budget-s", type=float, default=420.0, help="time for all sections, grace included (420)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [n for n in args.sections.split(",") if n and n not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown section(s) {', '.join(unknown)}: choose from {', '.join(SECTIONS)}")
    if args.budget_s < MIN_SECTION_S:  # every section would be skipped: a run that checked nothing
        parser.error(f"--budget-s: at least {MIN_SECTION_S:.0f} s (a section with less left is skipped)")
    if args.cpu_smoke:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.child:
        try:
            result = run_child(args.child, args.cpu_smoke, args.budget_s)
        except Exception as e:
            traceback.print_exc()
            result = {"status": "failed", "error": _why(e)}
        _say(RESULT, result)
        return 0
    started = time.perf_counter()
    env = _environment(args.cpu_smoke)
    if not args.cpu_smoke:
        # an inherited TRITON_INTERPRET=1 would run every kernel in the CPU interpreter, which
        # refuses CUDA tensors: every Triton kernel would fall back to ATen, silently
        removed = os.environ.pop("TRITON_INTERPRET", None)
        if removed is not None:
            env["removed_TRITON_INTERPRET"] = removed
        if env.get("cuda_available") is False:
            print("gpu_check: no CUDA device here (run it on a GPU machine, or --cpu-smoke to check the script)")
            return 2
    print(json.dumps(env), flush=True)
    names = [n for n in args.sections.split(",") if n]
    results: dict[str, Any] = {}
    budget_started = time.perf_counter()
    for i, name in enumerate(names):
        left = args.budget_s - (time.perf_counter() - budget_started)
        limit, soft = allot(name, names[i + 1 :], left, args.budget_s)
        if limit < MIN_SECTION_S:
            results[name] = {"status": "skipped", "error": f"time budget ({left:.0f} s left)"}
        else:
            results[name] = {**_run_section(name, args.cpu_smoke, limit, soft), "limit_s": round(limit, 1)}
        print(f"{name}: {results[name]['status']} ({results[name].get('seconds', 0):.0f} s)", flush=True)
        _write(args, env, results, started)  # a run cut short still leaves every section done so far
    print("\n" + _write(args, env, results, started))
    bad = [n for n, r in results.items() if r["status"] in ("failed", "degraded") and not r.get("expected")]
    ran = [n for n, r in results.items() if r["status"] != "skipped"]
    return 1 if bad or not ran else 0  # nothing ran (the budget): not a pass


if __name__ == "__main__":
    sys.exit(main())
