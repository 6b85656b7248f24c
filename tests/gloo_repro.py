"""Issue 13's heap corruption, with torch alone: two out-of-place all-gathers in flight on gloo.

    python -m tests.gloo_repro --form functional   # aborts in seconds (torch 2.13.0, 2 CPU cores)
    python -m tests.gloo_repro --form out          # the form zerofx issues: runs clean

Two gloo ranks (fresh processes, ``tests.multirank.run_ranks``) issue ``--in-flight``
all-gathers of small tensors back to back, then wait for all of them, for ``--seconds``.
``functional`` issues ``_c10d_functional.all_gather_into_tensor`` (ProcessGroupGloo's coalesced
all-gather work), ``out`` issues ``all_gather_into_tensor_out`` through
``zerofx.ir.collectives.all_gather`` (its plain all-gather work). See zerofx/ir/collectives.py,
NOTE: gloo all-gathers in flight. The exit status is 0 when every rank finished its loop.
"""

from __future__ import annotations

import argparse
import sys
import time

from tests.multirank import run_ranks


def gather_loop(rank: int, world: int, form: str, in_flight: int, seconds: float) -> dict:
    """Rank side: back-to-back all-gathers, ``in_flight`` at a time, until every rank's clock
    says ``seconds`` have passed (agreed by an all-reduce, so the ranks stop together)."""
    import faulthandler

    import torch
    import torch.distributed as dist

    from zerofx.ir.collectives import all_gather

    faulthandler.enable()
    group = dist.group.WORLD.group_name
    wait = torch.ops._c10d_functional.wait_tensor
    issue = {
        "functional": lambda x: torch.ops._c10d_functional.all_gather_into_tensor(x, world, group),
        "out": lambda x: all_gather(x, world, group),
    }[form]
    shards = [torch.full((64,), float(rank * 100 + i)) for i in range(in_flight)]
    end = time.monotonic() + seconds
    rounds = 0
    while True:
        go = torch.tensor([int(time.monotonic() < end)])
        dist.all_reduce(go, op=dist.ReduceOp.MIN)
        if not go.item():
            break
        for _ in range(20):
            outs = [issue(x) for x in shards]
            for i, out in enumerate(outs):
                got = wait(out)
                want = torch.cat([torch.full((64,), float(r * 100 + i)) for r in range(world)])
                if not torch.equal(got, want):
                    raise AssertionError(f"all-gather {i} of round {rounds} returned wrong values")
            rounds += 1
    return {"rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.gloo_repro", description=__doc__.split("\n\n")[0])
    p.add_argument("--form", choices=["functional", "out"], required=True)
    p.add_argument("--in-flight", type=int, default=8, help="all-gathers issued before the first wait (default 8)")
    p.add_argument("--seconds", type=float, default=30.0, help="how long each rank loops (default 30)")
    args = p.parse_args(argv)
    start = time.monotonic()
    try:
        results = run_ranks(gather_loop, 2, args.form, args.in_flight, args.seconds, timeout=args.seconds + 120)
    except AssertionError as e:
        print(f"{args.form}: FAILED after {time.monotonic() - start:.0f} s\n{str(e)[-2000:]}")
        return 1
    rounds = results[0]["rounds"]
    print(
        f"{args.form}: {rounds} rounds of {args.in_flight} all-gathers in flight, no error ({time.monotonic() - start:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
