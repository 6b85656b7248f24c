"""Single-process behaviour: options, errors for bad input, world size 1, the backend entry point."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import zerofx
from tests.models import MLP, GraphBreakNet
from zerofx import ZeroFXError


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_no_mesh_and_no_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(ZeroFXError, match="needs a DeviceMesh.*no process group is initialized"):
        zerofx.compile(nn.Linear(2, 2))


def test_model_on_a_device_the_mesh_does_not_cover(one_rank):
    cuda_mesh = DeviceMesh("cuda", [0], _init_backend=False)  # a mesh over devices the model is not on
    with pytest.raises(ZeroFXError, match=r"weight is on device cpu, which the mesh \(device_type='cuda'\)"):
        zerofx.compile(nn.Linear(2, 2), cuda_mesh)
    with pytest.raises(ZeroFXError, match="meta device"):
        zerofx.compile(nn.Linear(2, 2, device="meta"), one_rank)


def test_bad_mesh_and_params_are_clear_errors(one_rank):
    with pytest.raises(ZeroFXError, match="must be a torch.distributed.device_mesh.DeviceMesh"):
        zerofx.compile(nn.Linear(2, 2), "cpu")
    model = nn.Linear(2, 2)
    zerofx.shard(model, one_rank)
    with pytest.raises(ZeroFXError, match="already sharded"):
        zerofx.shard(model, one_rank)


def test_unknown_options_name_the_option():
    with pytest.raises(ZeroFXError, match=r"unknown zerofx option\(s\) \['stage3'\]"):
        zerofx.Options.from_kwargs(stage3=True)
    with pytest.raises(ZeroFXError, match="disable_passes.*'gathr'.*free"):
        zerofx.Options(disable_passes=("gathr",))
    with pytest.raises(ZeroFXError, match="executor"):
        zerofx.Options(executor="cuda-graphs")


@pytest.mark.parametrize("build", [MLP, GraphBreakNet], ids=["mlp", "graph_break"])
def test_world_size_one_trains_unsharded_with_exact_parity(one_rank, build):
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    zerofx.compile(model, one_rank)
    assert all(not isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    in_dim = model.layers[0].in_features if build is MLP else 12
    out_dim = 8 if build is MLP else 4
    for _ in range(5):
        x, y = torch.randn(4, in_dim), torch.randn(4, out_dim)
        losses = []
        for m, o in ((model, opt), (ref, ref_opt)):
            loss = m(x, y)
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_backend_is_registered_by_entry_point_and_takes_options():
    assert "zerofx" in torch._dynamo.list_backends()
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    compiled = torch.compile(model, backend="zerofx", options={"verify": True})
    x = torch.randn(2, 3)
    torch.testing.assert_close(compiled(x), model(x))
    with pytest.raises(Exception, match="unknown zerofx option"):
        torch.compile(nn.Linear(2, 2), backend="zerofx", options={"bogus": 1})(torch.randn(1, 2))
    torch._dynamo.reset()


def test_dump_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ZEROFX_DUMP", str(tmp_path))
    assert zerofx.Options().dump_dir == str(tmp_path)
    monkeypatch.delenv("ZEROFX_DUMP")
    assert zerofx.Options().dump_dir is None
