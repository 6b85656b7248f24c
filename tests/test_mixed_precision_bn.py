"""Mixed precision on a BatchNorm CNN (zerofx.models.ResNet) at stages 1-3, on 2 gloo ranks.

Under ``param_dtype`` the norm layers' weights and running statistics stay fp32 and their
input is bf16 (zerofx/sharding.py, NOTE: norm layers under param_dtype). The rank side
(tests/bn_scenarios.py) trains zerofx and three unsharded references 5 steps on the same data:
``fp32``, ``bf16`` (the documented mixed-precision arithmetic, unsharded) and ``autocast``
(torch's own). What is asserted, and why that tolerance:

* zerofx in bf16 is *bitwise* the unsharded bf16 model: loss, every gradient, every parameter
  and each rank's running statistics, at every step. Sharding casts each parameter before the
  gather and averages fp32 gradients of bf16 arithmetic, which is what the unsharded model does
  with the same kernels on the same shapes, so there is no rounding of zerofx's own to allow for
  (measured: equal). fp32 runs keep the fp32 tolerance of tests/zero_scenarios.py (measured:
  bitwise too).
* against fp32, the loss is within 2^-7 relative, the bf16 loss bound of tests/test_zero_stages.py:
  bf16's unit roundoff is u = 2^-8, the loss is returned in bf16 (one rounding, <= u) from bf16
  logits of size O(1) here (about one more); measured at most 2.3e-3 (torch.autocast, whose
  loss is fp32: 8.1e-4).
* parameters against fp32: AdamW's step is lr·m̂/(sqrt(v̂)+eps), and by Cauchy-Schwarz
  |m̂_t|/sqrt(v̂_t) <= B_t = sqrt(sum_s a_s²/b_s) (a_s, b_s: the bias-corrected EMA weights of
  beta1, beta2) for *any* gradients. Whatever bf16 does to the gradients, a parameter can end at
  most 2·lr·sum B_t (+ the fp32 roundings of the updates) from fp32's: the bound below, rigorous
  and model-independent, and reached (a bf16 gradient entry of the other sign at step 1 moves
  the parameter by -lr instead of +lr). BatchNorm makes bf16 gradients noisy here (measured
  worst-tensor error at step 0: 0.21 of the tensor's largest entry, torch.autocast 0.20), so
  nothing tighter holds against fp32; the bitwise check above is the tight one.
* running statistics against fp32: at step 0 (same weights) they are bitwise torch.autocast's,
  whose forward is the same bf16 convolutions and mixed batch_norm; after that the two runs'
  weights move apart by their gradients' different roundings (the loss in bf16 against fp32), so
  per step zerofx's worst layer is within autocast's worst layer plus one bf16 rounding of the
  statistic's scale (u, relative to max |stat|); measured: zerofx 0.020, autocast 0.022, the two
  runs at most 0.0054 apart. They stay fp32.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import zerofx
from tests.bn_scenarios import LR, scenarios
from tests.multirank import one_rank_mesh, run_ranks, scenario_results
from zerofx import ZeroFXError
from zerofx.models import ResNet, ResNetConfig

U = 2.0**-8  # bf16 unit roundoff (8-bit significand)
LOSS_REL = 2 * U
KINDS = ("grad", "param", "buffer")


def adam_step_bound(t: int, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """max |m̂_t| / sqrt(v̂_t) over every gradient sequence (torch AdamW's defaults)."""
    a = [(1 - beta1) * beta1 ** (t - s) / (1 - beta1**t) for s in range(1, t + 1)]
    b = [(1 - beta2) * beta2 ** (t - s) / (1 - beta2**t) for s in range(1, t + 1)]
    return math.sqrt(sum(x * x / y for x, y in zip(a, b)))


@pytest.fixture(scope="module")
def runs():
    return run_ranks(scenarios, 2, timeout=600)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_is_bitwise_the_unsharded_bf16_model(runs, stage):
    for rank, r in enumerate(scenario_results(runs, f"bf16_stage{stage}")):
        for step, rec in enumerate(r["steps"]):
            assert rec["loss_dtype"] == "torch.bfloat16"
            assert rec["loss"] == rec["loss_bf16"], f"rank {rank} step {step}"
            for kind in KINDS:
                worst = max(rec[f"{kind}_bf16"].items(), key=lambda kv: kv[1])
                assert rec[f"{kind}_exact_bf16"], f"rank {rank} step {step} {kind}: worst {worst}"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_trains_within_bf16_rounding_of_fp32(runs, stage):
    for rank, r in enumerate(scenario_results(runs, f"bf16_stage{stage}")):
        drift = 0.0
        for step, rec in enumerate(r["steps"]):
            where = f"rank {rank} step {step}"
            assert rec["loss_mean"] == pytest.approx(rec["loss_mean_fp32"], rel=LOSS_REL), where
            # fp32 rounds each of the two runs' parameters once per step (2^-24 of their scale) and
            # each update's handful of operations (2^-24 each; 2^-20 covers 16)
            drift += 2 * LR * adam_step_bound(step + 1) * (1 + 2.0**-20) + 2 * 2.0**-24 * rec["param_scale"]
            assert rec["param_abs_fp32"] <= drift, where


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_running_stats_stay_fp32_and_track_the_fp32_reference(runs, stage):
    for rank, r in enumerate(scenario_results(runs, f"bf16_stage{stage}")):
        assert r["buffer_dtypes"] == ["torch.float32"]
        assert r["steps"][0]["buffer_exact_autocast"], f"rank {rank}: step 0 statistics differ from autocast's"
        for step, rec in enumerate(r["steps"]):
            mine, autocast = max(rec["buffer_fp32"].values()), max(rec["buffer_autocast_vs_fp32"].values())
            assert mine <= autocast + U, f"rank {rank} step {step}: {mine} vs autocast's {autocast}"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_keeps_parity(runs, stage):
    for rank, r in enumerate(scenario_results(runs, f"fp32_stage{stage}")):
        assert r["buffer_dtypes"] == ["torch.float32"]
        for step, rec in enumerate(r["steps"]):
            # bit for bit: the reference runs each rank's slice with the same shapes, and two
            # ranks' halves sum exactly in either order (see docs/parity.md)
            assert rec["loss"] == rec["loss_fp32"], f"rank {rank} step {step}"
            for kind in ("grad", "param", "buffer"):
                assert rec[f"{kind}_exact_fp32"], f"rank {rank} step {step} {kind}: " + "\n".join(
                    rec["fp32_failures"][:5]
                )


# --- what cannot run: an error naming the option, before anything is sharded -----------------


@pytest.fixture
def one_rank(tmp_path):
    with one_rank_mesh(str(tmp_path)) as mesh:
        yield mesh


def _resnet() -> ResNet:
    torch.manual_seed(0)
    return ResNet(ResNetConfig(widths=(4,), blocks=(1,)))


@pytest.mark.parametrize("breaks", ["double", "bf16_stats"])
def test_norm_layers_that_cannot_mix_with_param_dtype_are_an_error(one_rank, breaks):
    model = _resnet()
    if breaks == "double":  # batch_norm mixes a bf16 input with fp32 only, never fp64
        model.double()
        match = r"option param_dtype=torch.bfloat16: BatchNorm2d 'stem.1' cannot run .*stem.1.weight is torch.float64"
    else:  # fp32 weights next to bf16 running stats: neither all fp32 nor all bf16
        model.stem[1].running_mean = model.stem[1].running_mean.bfloat16()
        match = r"option param_dtype=torch.bfloat16: .*stem.1.running_mean is torch.bfloat16"
    with pytest.raises(ZeroFXError, match=match):
        zerofx.compile(model, one_rank, param_dtype=torch.bfloat16)
    assert not zerofx.sharding.is_sharded(model)


def test_a_bf16_model_with_bf16_param_dtype_is_accepted(one_rank):
    """All of a norm layer in param_dtype is a same-dtype batch_norm: nothing to keep apart."""
    model = _resnet().bfloat16()
    ref = copy.deepcopy(model)
    zerofx.compile(model, one_rank, param_dtype=torch.bfloat16)
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([1, 2])
    assert torch.equal(model(x, y), ref(x.bfloat16(), y))
