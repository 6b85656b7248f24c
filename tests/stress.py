"""The stress regime: multi-rank scenarios, repeated, under delays, CPU contention and a poisoned heap.

    python -m tests.stress --repeat 20                       # memory + parity + stages
    python -m tests.stress --repeat 5 --scenarios memory --malloc-debug

Each repetition runs every chosen scenario once, as the test suite does (tests/multirank.py's
``run_ranks``: gloo ranks in fresh processes, every wait bounded by ``--timeout``), with

* delay injection: ``ZEROFX_STRESS_DELAY=SEED:MAX_MS`` for the ranks (zerofx/stress.py), a new
  seed per repetition: seeded sleeps before every collective is issued and waited, inside the
  graphs and in the eager flat buckets, around offload copies and in the optimizer hooks;
* CPU contention: ``--busy`` spinning processes, started first and always killed at the end;
* allocator poisoning: ``MALLOC_PERTURB_`` for the ranks (glibc fills freed memory with it, so a
  use after free reads garbage instead of the old value), and with ``--malloc-debug`` glibc's
  checking allocator (``libc_malloc_debug.so.0``, ``MALLOC_CHECK_=3``: abort on corruption).

Scenarios (rank-side entry points of the test suite, called unchanged):
``memory`` tests/memory_scenarios.py ``train_policies``; ``parity`` tests/parity.py
``train_all`` over every model of tests/models.py; ``stages`` tests/zero_scenarios.py
``scenarios_w4`` at 4 ranks, then ``scenarios_w2`` (which reshards the 4-rank checkpoint), as
tests/test_zero_stages.py runs them. ``--memory-policies`` / ``--parity-cases`` / ``--models``
narrow them; ``--world`` sets memory's and parity's world size.

A repetition's outcome per scenario: ``crash`` (a rank died or raised outside its scenarios),
``timeout`` (no result within ``--timeout``), ``mismatch`` (a rank's scenario returned an
``error`` or a non-empty ``failures`` list, or its losses / parameter errors differ bitwise from
the first repetition's: the sleeps move only host code against gloo's threads, never the
arithmetic), else ``ok``. The stages' results are also judged by tests/test_zero_stages.py's own
assertions (``stages_checks``: the file run by pytest on the repetition's recorded results, its
checkpoint folder included: resumed and resharded trajectories, loss scaling, pickled state
dicts, memory per stage), which needs ``--stage-steps`` at the file's ``STEPS``. The memory and
parity scenarios are judged by their ranks' ``failures`` and by drift only: tests/test_memory.py's
bounds run at world sizes a stress run does not. The summary counts each; the exit status is 1
unless all are ok.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tests.multirank import REPLAY, run_ranks

MALLOC_DEBUG_LIB = "/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGE_STEPS = 3  # tests/test_zero_stages.py's STEPS: its assertions judge the stages at that length
FINGERPRINT_KEYS = ("losses", "ref_losses", "param_error", "grad_rel_err", "norms")


# -- rank side -------------------------------------------------------------------------------------


def memory_ranks(rank: int, world: int, folder: str, models: list[str] | None, policies: list[str] | None) -> dict:
    """tests/memory_scenarios.py's ``train_policies``, narrowed to ``models`` / ``policies``."""
    from tests import memory_scenarios as ms

    if models:
        ms.MODELS = tuple(models)
    if policies:
        ms.POLICIES = {k: ms.POLICIES[k] for k in policies}
    return ms.train_policies(rank, world, folder)


def parity_ranks(rank: int, world: int, cases: list[str] | None, steps: int) -> dict:
    from tests.models import CASES
    from tests.parity import train_all

    return train_all(rank, world, list(cases or CASES), steps, None)


def stage_ranks(rank: int, world: int, steps: int, folder: str) -> dict:
    """tests/zero_scenarios.py at 4 ranks, then at 2 (which reshards the 4-rank checkpoint)."""
    from tests.zero_scenarios import scenarios_w2, scenarios_w4

    return (scenarios_w4 if world == 4 else scenarios_w2)(rank, world, steps, folder)


def overlap_ranks(rank: int, world: int, folder: str) -> dict:
    """tests/overlap_scenarios.py (calibration, bucketed/scheduled parity, selective unsharding,
    prefetch order, the allocator-checked memory prediction): where the heap corruption of issue 13
    was reproduced under load (about one run in eight with one busy process beside it)."""
    from tests.overlap_scenarios import scenarios

    os.makedirs(folder, exist_ok=True)
    return scenarios(rank, world, folder)


# -- driver side -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    scenario: str
    repetition: int
    status: str  # ok, crash, timeout, mismatch
    seconds: float
    details: list[str] = field(default_factory=list)


def _fingerprint(result: Any) -> dict:
    if not isinstance(result, dict):
        return {}
    return {k: result[k] for k in FINGERPRINT_KEYS if k in result}


def judge(per_rank: list[dict], baseline: dict | None) -> tuple[list[str], dict]:
    """Mismatches of one run (errors, failures, drift from ``baseline``) and its fingerprint."""
    problems, prints = [], {}
    for rank, results in enumerate(per_rank):
        for name, r in sorted(results.items()):
            if not isinstance(r, dict):
                continue
            if "error" in r:
                problems.append(f"rank {rank} {name}: error: {r['error'].strip().splitlines()[-1]}")
            elif r.get("failures"):
                problems.append(f"rank {rank} {name}: {len(r['failures'])} failures, first: {r['failures'][0]}")
            prints[f"{rank}/{name}"] = _fingerprint(r)
    if baseline is not None:
        for key, value in prints.items():
            if key in baseline and baseline[key] != value:
                problems.append(f"rank/scenario {key}: differs from repetition 0: {value} != {baseline[key]}")
    return problems, prints


class RankEnv:
    """Environment variables set for the ranks this process spawns, restored afterwards."""

    def __init__(self, values: dict[str, str]):
        self.values = values
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc: Any) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# a spinner stops when the driver is gone, however it went (killed with SIGKILL, too)
# (the driver's pid is passed: a spinner reading its parent at start-up could find the driver gone already)
SPIN = "import os, sys\nparent = int(sys.argv[1])\nwhile os.getppid() == parent: pass"


class Contention:
    """``n`` busy-looping processes for the duration of the block, killed (by pid) at its end;
    each also stops by itself when its parent (this driver) is gone."""

    def __init__(self, n: int):
        self.n = n
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Contention:
        for _ in range(self.n):
            # no pipe of the driver's held open: whoever reads its output sees it end with the driver
            quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
            self.procs.append(subprocess.Popen([sys.executable, "-c", SPIN, str(os.getpid())], **quiet))
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait(timeout=30)


def rank_env(seed: int, max_ms: float, perturb: int | None, malloc_debug: bool) -> dict[str, str]:
    # faulthandler: a rank that aborts (glibc's heap checks, std::terminate) prints every thread's Python stack
    env = {"ZEROFX_STRESS_DELAY": f"{seed}:{max_ms:g}", "PYTHONFAULTHANDLER": "1"}
    if perturb:
        env["MALLOC_PERTURB_"] = str(perturb)
    if malloc_debug:
        env["LD_PRELOAD"] = MALLOC_DEBUG_LIB
        env["MALLOC_CHECK_"] = "3"
    return env


def run_one(
    name: str,
    fn: Callable,
    args: tuple,
    world: int,
    timeout: float,
    env: dict[str, str],
    repetition: int,
    baseline: dict | None,
) -> tuple[Outcome, dict | None]:
    start = time.monotonic()
    with RankEnv(env):
        try:
            per_rank = run_ranks(fn, world, *args, timeout=timeout)
        except AssertionError as e:
            seconds = time.monotonic() - start
            text = str(e)
            status = "timeout" if "sent no result" in text and seconds >= timeout else "crash"
            return Outcome(name, repetition, status, seconds, [text[-4000:]]), None, None
    problems, prints = judge(per_rank, baseline)
    outcome = Outcome(name, repetition, "mismatch" if problems else "ok", time.monotonic() - start, problems)
    return outcome, prints, per_rank


def check_with_tests(
    test_file: str, name: str, recorded: Any, repetition: int, timeout: float, pytest_args: tuple = ()
) -> Outcome:
    """``test_file``'s tests on ``recorded`` (what its fixture hands them in place of running the
    ranks: tests/multirank.py ``replayed``), in a pytest process of their own, bounded by
    ``timeout``: ``ok``, or ``mismatch`` naming the failed tests."""
    start = time.monotonic()
    with tempfile.NamedTemporaryFile("wb", suffix=".pkl", delete=False) as f:
        pickle.dump({name: recorded}, f)
    try:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args, test_file]
        run = subprocess.run(
            cmd, cwd=ROOT, env={**os.environ, REPLAY: f.name}, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return Outcome(f"{name}_checks", repetition, "timeout", time.monotonic() - start)
    finally:
        os.unlink(f.name)
    seconds = time.monotonic() - start
    if run.returncode == 0:
        return Outcome(f"{name}_checks", repetition, "ok", seconds)
    lines = run.stdout.splitlines()
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))] or lines[-5:] + run.stderr.splitlines()[
        -5:
    ]
    return Outcome(f"{name}_checks", repetition, "mismatch", seconds, failed)


def scenarios(args: argparse.Namespace, folder: str) -> dict[str, tuple[Callable, int, tuple]]:
    """name -> (rank function, world size, its arguments), in the order they run."""
    stages = (args.stage_steps, os.path.join(folder, "stages"))
    table = {
        "memory": {
            "memory": (memory_ranks, args.world, (os.path.join(folder, "memory"), args.models, args.memory_policies))
        },
        "parity": {"parity": (parity_ranks, args.world, (args.parity_cases, args.parity_steps))},
        "stages": {"stages_w4": (stage_ranks, 4, stages), "stages_w2": (stage_ranks, 2, stages)},
        "overlap": {"overlap": (overlap_ranks, args.world, (os.path.join(folder, "overlap"),))},
    }
    return {name: entry for k in args.scenarios for name, entry in table[k].items()}


def stress(args: argparse.Namespace, log: Callable[[str], None] = print) -> list[Outcome]:
    outcomes: list[Outcome] = []
    baselines: dict[str, dict] = {}

    def logged(outcome: Outcome, rep: int) -> None:
        outcomes.append(outcome)
        log(
            f"[{rep + 1}/{args.repeat}] {outcome.scenario}: {outcome.status} ({outcome.seconds:.0f} s)"
            + "".join(f"\n    {d}" for d in outcome.details[:10])
        )

    with Contention(args.busy), tempfile.TemporaryDirectory(prefix="zerofx-stress-") as tmp:
        for rep in range(args.repeat):
            env = rank_env(args.seed + rep, args.delay_ms, args.perturb, args.malloc_debug)
            folder = os.path.join(tmp, f"rep{rep}")
            stages = {"folder": os.path.join(folder, "stages")}
            for name, (fn, world, fargs) in scenarios(args, folder).items():
                outcome, prints, per_rank = run_one(name, fn, fargs, world, args.timeout, env, rep, baselines.get(name))
                if prints is not None and name not in baselines:
                    baselines[name] = prints
                if name.startswith("stages_") and per_rank is not None:
                    stages[world] = per_rank
                logged(outcome, rep)
            if 2 in stages and 4 in stages and args.stage_steps == STAGE_STEPS:
                logged(check_with_tests("tests/test_zero_stages.py", "stages", stages, rep, args.timeout), rep)
    return outcomes


def summary(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for o in outcomes:
        counts = out.setdefault(o.scenario, {"runs": 0, "ok": 0, "crash": 0, "timeout": 0, "mismatch": 0})
        counts["runs"] += 1
        counts[o.status] += 1
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.stress", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=20, help="repetitions of every scenario (default 20)")
    p.add_argument(
        "--scenarios",
        nargs="+",
        default=["memory", "parity", "stages"],
        choices=["memory", "parity", "stages", "overlap"],
    )
    p.add_argument("--world", type=int, default=2, help="ranks per run (default 2)")
    p.add_argument("--seed", type=int, default=0, help="delay seed of repetition 0 (then +1 per repetition)")
    p.add_argument("--delay-ms", type=float, default=5.0, help="longest injected sleep (default 5 ms)")
    p.add_argument("--busy", type=int, default=2, help="busy-looping processes for contention (default 2)")
    p.add_argument("--perturb", type=int, default=165, help="MALLOC_PERTURB_ for the ranks (0: off)")
    p.add_argument("--malloc-debug", action="store_true", help="glibc's checking allocator for the ranks")
    p.add_argument("--timeout", type=float, default=900, help="seconds per multi-rank run (default 900)")
    p.add_argument("--models", nargs="+", help="memory: only these models")
    p.add_argument("--memory-policies", nargs="+", help="memory: only these policies")
    p.add_argument("--parity-cases", nargs="+", help="parity: only these models")
    p.add_argument("--parity-steps", type=int, default=10)
    p.add_argument(
        "--stage-steps",
        type=int,
        default=STAGE_STEPS,
        help=f"stages: steps per scenario (default {STAGE_STEPS}, the test file's: other lengths skip stages_checks)",
    )
    p.add_argument("--json", help="write every outcome to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # a plain kill (a CI cancel, a parent's terminate()) unwinds like Ctrl-C: the spinners and the
    # temporary folders go with the driver
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    outcomes = stress(args, log=lambda line: print(line, flush=True))
    counts = summary(outcomes)
    for name, c in counts.items():
        print(
            f"{name}: {c['runs']} runs, {c['ok']} ok, {c['crash']} crashes, {c['timeout']} timeouts, "
            f"{c['mismatch']} mismatches"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": counts, "outcomes": [o.__dict__ for o in outcomes]}, f, indent=1)
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
