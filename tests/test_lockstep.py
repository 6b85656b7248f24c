"""The lockstep check's protocol (zerofx/runtime/lockstep.py) over simulated ranks: one thread per
rank, and a stand-in for ``torch.distributed`` whose collectives meet the members of a group in
call order (as gloo pairs them), so orders that would deadlock or ranks that would go on alone
show up here in a second, without launching 8 processes. Every wait is bounded."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from zerofx.errors import ZeroFXError
from zerofx.runtime import lockstep

WAIT_S = 10


class FakeGroup:
    def __init__(self, ranks: tuple[int, ...], name: str):
        self.ranks, self.group_name = ranks, name


class FakeDist:
    """all_reduce (MAX) and all_gather_object over FakeGroups: the n-th call of each member of a
    group meets the n-th call of the others; a member that never comes is a TimeoutError."""

    ReduceOp = SimpleNamespace(MAX="max")

    def __init__(self):
        self.cond = threading.Condition()
        self.calls: dict[tuple[int, int], int] = {}  # (id(group), rank) -> calls made
        self.meetings: dict[tuple[int, int], dict[int, object]] = {}
        self.local = threading.local()

    def get_process_group_ranks(self, group):
        return list(group.ranks)

    def get_world_size(self, group):
        return len(group.ranks)

    def _meet(self, group, value):
        rank = self.local.rank
        assert rank in group.ranks, (rank, group.ranks)
        with self.cond:
            n = self.calls.get((id(group), rank), 0)
            self.calls[(id(group), rank)] = n + 1
            got = self.meetings.setdefault((id(group), n), {})
            got[rank] = value
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: len(got) == len(group.ranks), timeout=WAIT_S):
                raise TimeoutError(f"rank {rank} waited alone in group {group.ranks}")
            return [got[r] for r in group.ranks]

    def all_reduce(self, tensor, op=None, group=None):
        values = self._meet(group, tensor.clone())
        tensor.copy_(torch.stack(values).amax(0))

    def all_gather_object(self, out, obj, group=None):
        out[:] = self._meet(group, obj)


def _grid_2x2x2():
    """Groups of a 2x2x2 grid of 8 ranks: dimension d pairs r with r ^ (4, 2, 1)[d]."""
    dims = []
    for d, bit in enumerate((4, 2, 1)):
        pairs = {tuple(sorted((r, r ^ bit))) for r in range(8)}
        dims.append({p: FakeGroup(p, f"d{d}{p}") for p in pairs})
    return [lambda r, dim=dim, bit=bit: dim[tuple(sorted((r, r ^ bit)))] for dim, bit in zip(dims, (4, 2, 1))]


def _run(fake, monkeypatch, locks_of, digest_of, world=8):
    """Each rank's ``merge(locks_of(rank)).check(digest_of(rank))`` on its own thread: what each raised."""
    monkeypatch.setattr(lockstep, "dist", fake)
    results: dict[int, str] = {}

    def rank_main(rank):
        fake.local.rank = rank
        try:
            merged = lockstep.merge(locks_of(rank))
            merged.check(digest_of(rank), lambda: f"digest {digest_of(rank)}")
            results[rank] = "passed"
        except ZeroFXError:
            results[rank] = "raised"
        except TimeoutError as e:
            results[rank] = f"timeout: {e}"

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=3 * WAIT_S)
    return [results.get(r, "hung") for r in range(world)]


@pytest.mark.parametrize("differing", [0, 6, 7])
def test_a_frame_reading_models_over_crossing_dimensions_stops_every_rank(monkeypatch, differing):
    """Model A over two dimensions of a 2x2x2 grid, model B over the third, read by one frame:
    when one rank's digest differs, every rank raises, none goes on alone. In merge's single
    order over all groups the dimensions interleave, and one pass of the flag left rank 0 (or
    1) passing while the others raised."""
    fake = FakeDist()
    dim = _grid_2x2x2()
    device = torch.device("cpu")

    def locks_of(rank):
        a = lockstep.Lockstep([], device, [dim[0](rank), dim[1](rank)])
        b = lockstep.Lockstep([], device, [dim[2](rank)])
        return [b, a] if rank % 2 else [a, b]  # inputs in another order on odd ranks

    results = _run(fake, monkeypatch, locks_of, lambda r: 5 if r == differing else 3)
    assert results == ["raised"] * 8, results


def test_ranks_that_agree_pass_through_the_merged_groups(monkeypatch):
    fake = FakeDist()
    dim = _grid_2x2x2()
    device = torch.device("cpu")

    def locks_of(rank):
        return [
            lockstep.Lockstep([], device, [dim[0](rank), dim[1](rank)]),
            lockstep.Lockstep([], device, [dim[2](rank)]),
        ]

    assert _run(fake, monkeypatch, locks_of, lambda r: 3) == ["passed"] * 8


@pytest.mark.parametrize("digests", [(3, 3, 3, 3), (3, 3, 5, 5)])
def test_two_ranks_listing_two_models_in_other_orders_meet_in_the_same_groups(monkeypatch, digests):
    """Model A over pairs of 4 ranks, model B over all four, and each pair's odd rank lists B
    first. In input order rank 0 waited in its pair's group while rank 1 waited in the
    four's; in merge's order both meet in the pair's first."""
    fake = FakeDist()
    pairs = {0: FakeGroup((0, 1), "p01"), 1: FakeGroup((2, 3), "p23")}
    four = FakeGroup((0, 1, 2, 3), "all")
    device = torch.device("cpu")

    def locks_of(rank):
        a, b = lockstep.Lockstep([], device, [pairs[rank // 2]]), lockstep.Lockstep([], device, [four])
        return [b, a] if rank % 2 else [a, b]

    want = "passed" if len(set(digests)) == 1 else "raised"
    assert _run(fake, monkeypatch, locks_of, lambda r: digests[r], world=4) == [want] * 4
