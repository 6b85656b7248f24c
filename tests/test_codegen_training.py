"""End to end: the GPT trained through zerofx with executor="triton" against "aten" (1 and 2
gloo ranks, Triton interpreter), the debug dump of the generated code, and "inductor".

One spawn per world size runs everything (tests/codegen_ranks.py); each test asserts one thing.
Tolerances: losses rel 1e-5 per step, parameters rtol 1e-4 / atol 1e-5 after the last step.
Fused kernels change rounding (decomposed norms, another summation order) by ~1e-7 per op;
four AdamW steps at lr 3e-3 do not amplify that past these bounds, while any wrong kernel
moves the loss in the third digit.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.codegen_ranks import STEPS

pytestmark = pytest.mark.usefixtures("triton_interpreter")
WORLD_SIZES = (1, 2)


def _part(codegen_runs, world_size: int, name: str) -> list[dict]:
    per_rank = [r[name] for r in codegen_runs(world_size)[0]]
    for rank, r in enumerate(per_rank):
        assert "error" not in r, f"rank {rank} {name} failed:\n{r['error']}"
    return per_rank


def _assert_same_training(ours: list[dict], ref: list[dict]) -> None:
    for rank, (o, r) in enumerate(zip(ours, ref)):
        assert len(o["losses"]) == STEPS
        assert o["losses"] == pytest.approx(r["losses"], rel=1e-5), f"rank {rank}"
        assert o["params"].keys() == r["params"].keys()
        for name in o["params"]:
            torch.testing.assert_close(
                o["params"][name], r["params"][name], rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank} {name}: {m}"
            )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gpt_trains_with_triton_kernels_like_aten(codegen_runs, world_size):
    triton, aten = _part(codegen_runs, world_size, "gpt_triton"), _part(codegen_runs, world_size, "gpt_aten")
    _assert_same_training(triton, aten)
    for r in triton:
        assert r["launches"] >= STEPS * 10, "the fused kernels did not run"  # ~16 kernels per step
        assert r["fallbacks"] == 0


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dump_shows_every_generated_kernel(codegen_runs, world_size):
    _part(codegen_runs, world_size, "gpt_triton")
    dump = codegen_runs(world_size)[1]
    for rank in range(world_size):
        root = dump / f"rank{rank}"
        summary = (root / "summary.txt").read_text()
        for stage in ("forward", "backward"):
            (folder,) = root.glob(f"frame*_{stage}")
            sources = sorted((folder / "kernels").glob("*.py"))
            assert sources, f"no kernels dumped for {folder.name}"
            for path in sources:
                text = path.read_text()
                assert "@triton.jit" in text and "def launch(" in text and "tl.store(" in text
            (graph,) = folder.glob("*_codegen.py")
            calls = re.findall(r"= zerofx_kernels_(zfx_(?:pointwise|row)_[0-9a-f]{12})\w*\(", graph.read_text())
            assert calls
            assert {f"{c}.py" for c in calls} == {p.name[3:] for p in sources}  # each call's source is there
            assert not list((folder / "kernels").glob("*.FAILED.txt"))
        assert summary.count("Triton kernels covering") == 2


def test_triton_codegen_keeps_collectives_in_place(codegen_runs):
    _part(codegen_runs, 2, "gpt_triton")
    dump = codegen_runs(2)[1]
    # collectives and matmuls (never fused) in graph order: codegen must not move one across the other
    pattern = re.compile(r"torch\.ops\.(_c10d_functional\.\w+|aten\.mm|aten\.addmm|aten\.bmm)\.default\(")
    for rank in range(2):
        for stage in ("forward", "backward"):
            (folder,) = (dump / f"rank{rank}").glob(f"frame*_{stage}")
            files = sorted(folder.glob("*.py"))
            before, after = files[-2].read_text(), files[-1].read_text()
            assert files[-1].name.endswith("_codegen.py")
            ops_before, ops_after = pattern.findall(before), pattern.findall(after)
            assert any(op.startswith("_c10d") for op in ops_before)
            assert ops_after == ops_before


def test_inductor_executor_matches_aten(codegen_runs):
    _assert_same_training(_part(codegen_runs, 2, "mlp_inductor"), _part(codegen_runs, 2, "mlp_aten"))


def test_every_executor_is_an_option():
    from zerofx import Options, ZeroFXError
    from zerofx.codegen import EXECUTOR_NAMES
    from zerofx.options import EXECUTORS

    assert EXECUTORS == EXECUTOR_NAMES == ("aten", "triton", "inductor")
    assert Options(executor="triton").executor == "triton"
    with pytest.raises(ZeroFXError, match="choose one of"):
        Options(executor="cuda")
