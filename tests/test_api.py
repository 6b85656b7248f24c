"""Single-process behaviour: options, errors for bad input, world size 1, the backend entry point."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import zerofx
from tests.models import MLP, GraphBreakNet
from tests.multirank import one_rank_mesh
from zerofx import ZeroFXError


@pytest.fixture
def one_rank(tmp_path):
    """Per test, unlike conftest's per-module one: other tests here need no process group."""
    with one_rank_mesh(str(tmp_path)) as mesh:
        yield mesh


def test_no_mesh_and_no_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(ZeroFXError, match="needs a DeviceMesh.*no process group is initialized"):
        zerofx.compile(nn.Linear(2, 2))


def test_model_on_a_device_the_mesh_does_not_cover(one_rank):
    cuda_mesh = DeviceMesh("cuda", [0], _init_backend=False)  # a mesh over devices the model is not on
    with pytest.raises(ZeroFXError, match=r"weight is on device cpu, which the mesh \(device_type='cuda'\)"):
        zerofx.compile(nn.Linear(2, 2), cuda_mesh)


def test_a_model_built_on_meta_runs_only_once_loaded(one_rank):
    model = zerofx.compile(nn.Linear(2, 2, device="meta"), one_rank)  # allocated, uninitialized
    assert model.weight.device.type == "cpu"
    with pytest.raises(
        ZeroFXError, match=r"built on the meta device and 2 of its tensors were never loaded \(bias, weight\)"
    ):
        model(torch.ones(1, 2))
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.zero_()
    zerofx.sharding.mark_loaded(model, ["weight"])
    with pytest.raises(ZeroFXError, match=r"1 of its tensors were never loaded \(bias\)"):
        model(torch.ones(1, 2))
    zerofx.sharding.mark_loaded(model, ["bias"])
    assert torch.equal(model(torch.ones(1, 2)), torch.full((1, 2), 2.0))


def test_bad_mesh_and_params_are_clear_errors(one_rank):
    with pytest.raises(ZeroFXError, match="must be a torch.distributed.device_mesh.DeviceMesh"):
        zerofx.compile(nn.Linear(2, 2), "cpu")
    model = nn.Linear(2, 2)
    zerofx.shard(model, one_rank)
    with pytest.raises(ZeroFXError, match="already sharded"):
        zerofx.shard(model, one_rank)


def test_unknown_options_name_the_option_and_the_closest_valid_one(one_rank):
    with pytest.raises(ZeroFXError, match=r"unknown zerofx option 'stage3' \(did you mean 'stage'\?\)"):
        zerofx.Options.from_kwargs(stage3=True)
    model = nn.Linear(2, 2)
    # torch.compile's keywords are named as such, with the two-step spelling that takes them
    with pytest.raises(
        ZeroFXError,
        match=r"fullgraph=True: a torch.compile keyword, not a zerofx option; .*"
        r"torch.compile\(model, backend='zerofx', fullgraph=True\)",
    ):
        zerofx.compile(model, one_rank, fullgraph=True)
    # ... except mode= and backend=, which the two-step spelling does not take either
    with pytest.raises(ZeroFXError, match=r"mode='max-autotune': torch.compile's mode picks one of Inductor's presets"):
        zerofx.compile(model, one_rank, mode="max-autotune")
    with pytest.raises(ZeroFXError, match=r"backend='inductor': zerofx.compile compiles with the zerofx backend"):
        zerofx.compile(model, one_rank, backend="inductor")
    with pytest.raises(ZeroFXError, match=r"unknown zerofx option 'bucket_byte' \(did you mean 'bucket_bytes'\?\)"):
        zerofx.compile(model, one_rank, bucket_byte=1024)
    assert not zerofx.sharding.is_sharded(model)  # nothing happened to the model
    # dynamo wraps what a backend raises; the message is the same
    with pytest.raises(
        torch._dynamo.exc.BackendCompilerFailed,
        match=r"unknown zerofx option 'prefetch' \(did you mean 'prefetch_bytes'\?\)",
    ):
        torch.compile(model, backend="zerofx", options={"prefetch": 0})(torch.randn(1, 2))
    with pytest.raises(ZeroFXError, match=r"unknown pass 'gathr' \(did you mean 'gather'\?\).*'regather'"):
        zerofx.compile(nn.Linear(2, 2), one_rank, disable_passes=("gathr",))
    with pytest.raises(ZeroFXError, match=r"executor='atne': .*\(did you mean 'aten'\?\)"):
        zerofx.Options(executor="atne")
    with pytest.raises(ZeroFXError, match="executor='cuda-graphs'"):
        zerofx.Options(executor="cuda-graphs")


def test_the_old_name_of_the_regather_pass_is_accepted_with_a_deprecation_warning(one_rank):
    from zerofx.passes.pipeline import resolve_disabled

    with pytest.warns(DeprecationWarning, match="'free' is now called 'regather'"):
        assert resolve_disabled(("free", "bucket")) == ("regather", "bucket")


def test_option_validation_is_pure_and_the_offload_folder_is_checked_at_compile(tmp_path, one_rank):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    bad = str(blocker / "sub")
    opts = zerofx.Options(offload_activations="disk", offload_dir=bad)  # no I/O here: builds fine
    assert opts.memory.offload_dir == bad and opts.memory.uses_disk
    assert not (blocker / "sub").exists()
    model = nn.Linear(2, 2)
    with pytest.raises(ZeroFXError, match="offload_dir=.*is not a writable folder"):
        zerofx.compile(model, one_rank, offload_activations="disk", offload_dir=bad)
    assert not zerofx.sharding.is_sharded(model)  # raised before anything was done to the model


def test_options_are_read_by_concern_through_frozen_policies():
    opts = zerofx.Options(
        stage=2, param_dtype="bf16", bucket_bytes=4096, activation_budget=0.5, disable_passes="bucket", executor="aten"
    )
    assert opts.layout.stage == 2 and opts.layout.param_dtype is torch.bfloat16 is opts.param_dtype
    assert opts.comm.bucket_bytes == 4096 and opts.memory.activation_budget == 0.5
    assert opts.debug.disable_passes == ("bucket",) and opts.codegen.executor == "aten"
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.comm.bucket_bytes = 1  # type: ignore[misc]
    assert "cost_model" not in zerofx.Options.keywords()  # internal state is not an option


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
    for mode in ("max-autotune", "reduce-overhead"):  # inductor's presets: named, not an unknown option
        with pytest.raises(Exception, match=rf"torch.compile\(mode='{mode}'\) picks one of inductor's presets"):
            torch.compile(nn.Linear(2, 2), backend="zerofx", mode=mode)(torch.randn(1, 2))
        torch._dynamo.reset()


def test_dump_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ZEROFX_DUMP", str(tmp_path))
    assert zerofx.Options().dump_dir == str(tmp_path)
    monkeypatch.delenv("ZEROFX_DUMP")
    assert zerofx.Options().dump_dir is None


def test_incompatible_or_bad_zero_options_name_the_option():
    with pytest.raises(ZeroFXError, match=r"option stage=4: choose 1, 2 or 3"):
        zerofx.Options(stage=4)
    for stage in (1, 2):
        with pytest.raises(
            ZeroFXError, match=rf"option persistence_threshold=100 only applies to stage 3.*stage {stage}"
        ):
            zerofx.Options(stage=stage, persistence_threshold=100)
        with pytest.raises(
            ZeroFXError, match=rf"option keep_gathered_bytes=1000 keeps stage 3's.*stage {stage} gathers"
        ):
            zerofx.Options(stage=stage, keep_gathered_bytes=1000)  # accepted, and did nothing
    with pytest.raises(ZeroFXError, match=r"option persistence_threshold=-1"):
        zerofx.Options(persistence_threshold=-1)
    with pytest.raises(ZeroFXError, match=r"option loss_scale is required with param_dtype=torch.float16"):
        zerofx.Options(param_dtype=torch.float16)
    with pytest.raises(ZeroFXError, match=r"option loss_scale is required with reduce_dtype=torch.float16"):
        zerofx.Options(param_dtype="bf16", reduce_dtype="fp16")
    with pytest.raises(ZeroFXError, match=r"option param_dtype='int8'"):
        zerofx.Options(param_dtype="int8")
    with pytest.raises(ZeroFXError, match=r"option loss_scale='static'"):
        zerofx.Options(loss_scale="static")
    with pytest.raises(ZeroFXError, match=r"option loss_scale_window=0"):
        zerofx.Options(loss_scale_window=0)
    with pytest.raises(ZeroFXError, match=r"option local_optimizer_step='yes': give True or False"):
        zerofx.Options(local_optimizer_step="yes")
    with pytest.raises(ZeroFXError, match=r"option check_lockstep=1: give True or False"):
        zerofx.Options(check_lockstep=1)
    ok = zerofx.Options(param_dtype="fp16", loss_scale="dynamic", reduce_dtype="float32")
    assert ok.param_dtype is torch.float16 and ok.reduce_dtype is torch.float32
    assert zerofx.Options(param_dtype=torch.float32).param_dtype is None  # fp32 compute is no mixed precision


def test_a_3d_mesh_is_a_clear_error_naming_the_mesh(one_rank):
    mesh3 = DeviceMesh("cpu", torch.arange(1).view(1, 1, 1), _init_backend=False)
    with pytest.raises(
        ZeroFXError, match=r"mesh: zerofx shards over a 1-D mesh .* or a 2-D mesh .*got a 3-D mesh \(1, 1, 1\)"
    ):
        zerofx.compile(nn.Linear(2, 2), mesh3)


def test_layout_options_are_decided_where_the_model_is_sharded(one_rank):
    with pytest.raises(Exception, match=r"option stage is decided when parameters are sharded.*zerofx.shard"):
        torch.compile(nn.Linear(2, 2), backend="zerofx", options={"stage": 2})(torch.randn(1, 2))
    torch._dynamo.reset()
    model = nn.Linear(2, 2)
    zerofx.shard(model, one_rank, stage=2)
    with pytest.raises(ZeroFXError, match=r"option stage=3 differs from the one the model was sharded with \(2\)"):
        zerofx.compile(model, stage=3)
    with pytest.raises(ZeroFXError, match="option loss_scale: this model has no loss scaler"):
        zerofx.loss_scaler(model)
    with pytest.raises(ZeroFXError, match="no_sync needs a model sharded by zerofx"):
        with zerofx.no_sync(nn.Linear(2, 2)):
            pass


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_world_size_one_with_bf16_goes_through_the_markers(one_rank, stage):
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    zerofx.compile(model, one_rank, stage=stage, param_dtype=torch.bfloat16)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    for _ in range(2):
        x, y = torch.randn(4, 16), torch.randn(4, 8)
        loss, ref_loss = model(x, y), ref(x, y)
        assert loss.dtype is torch.bfloat16
        assert loss.item() == pytest.approx(ref_loss.item(), rel=2.0**-7)  # see tests/test_zero_stages.py
        for m, o, l in ((model, opt, loss), (ref, ref_opt, ref_loss)):
            l.backward()
            o.step()
            o.zero_grad()
    assert {p.to_local().dtype for p in model.parameters()} == {torch.float32}


def test_torch_compile_backend_on_an_unsharded_model_in_a_multi_rank_job_warns():
    """Without zerofx.shard, a zerofx-compiled model has no collectives: on N > 1 ranks every rank
    would train alone. torch's fake process group stands in for a 2-rank job."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zerofx.backend

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        zerofx.backend._WARNED.discard("unsharded")
        torch._dynamo.reset()
        model = nn.Linear(3, 2)
        with pytest.warns(UserWarning, match=r"has not sharded, in a job of 2 ranks.*zerofx\.shard\(model, mesh\)"):
            torch.compile(model, backend="zerofx")(torch.randn(4, 3)).sum().backward()
        zerofx.backend._WARNED.discard("unsharded")
        torch._dynamo.reset()
        sharded = zerofx.shard(nn.Linear(3, 2), init_device_mesh("cpu", (2,)))
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*has not sharded.*")
            torch.compile(sharded, backend="zerofx")(torch.randn(4, 3)).sum().backward()
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_sharding_a_model_whose_parts_are_sharded_already_is_an_error_naming_the_part():
    """FSDP2's idiom (shard each block, then the root) and compiling a block of a sharded model
    both meet parameters zerofx has laid out already; either is refused before anything changes,
    naming the part. So is a model FSDP2 sharded (it said the parameters were tensor-parallel). torch's fake process group stands in for a 2-rank job (no collective runs)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = MLP()
        zerofx.shard(model.layers[0], mesh)
        with pytest.raises(ZeroFXError, match=r"layers\.0 is already sharded by zerofx.*root only"):
            zerofx.compile(model, mesh)
        assert not zerofx.sharding.is_sharded(model)
        whole = zerofx.shard(MLP(), mesh)
        with pytest.raises(ZeroFXError, match=r"^weight belongs to a model zerofx has sharded already \(as its "):
            zerofx.shard(whole.layers[2], mesh)
        from torch.distributed.fsdp import fully_shard

        for per_block in (True, False):  # FSDP2's layout, of a block or of the root only
            fsdp = MLP()
            fully_shard(fsdp.layers[0] if per_block else fsdp, mesh=mesh)
            part = "layers.0" if per_block else "the model"
            with pytest.raises(ZeroFXError, match=rf"^{part} is sharded by FSDP already \(fully_shard"):
                zerofx.compile(fsdp, mesh)
    finally:
        dist.destroy_process_group()


def test_a_deepcopy_reaching_the_parameters_before_the_model_is_an_error_saying_so():
    """torch's deepcopy of a parameter copies its attributes before recording the copy, and
    zerofx's state leads back to the parameter: copied ahead of its module, the first one is
    copied twice and the copy's module holds the other one. Its first forward says so; the
    model deep-copied on its own trains."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = zerofx.shard(MLP(), init_device_mesh("cpu", (2,)))
        x, y = torch.randn(4, 16, requires_grad=True), torch.randn(4, 8)
        box = copy.deepcopy({"params": list(model.parameters()), "model": model})
        with pytest.raises(ZeroFXError, match=r"another tensor .* deep-copy the model on its own"):
            box["model"](x, y)
        twin = copy.deepcopy(model)
        twin(x, y).backward()
        assert all(p.grad is not None for p in twin.parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("replacement", ["parameter", "shard_tensor"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_a_parameter_replaced_after_sharding_is_an_error_naming_it(compiled, replacement):
    """The graphs read a parameter through zerofx's own handle on its shard (NOTE: plain graph
    inputs), so a parameter the module holds instead, set after sharding, would otherwise be
    ignored without a word: the next forward raises, naming it, for a replacement DTensor with
    the same layout too (dynamo's guards pass on that one but for its identity)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = zerofx.compile(MLP(), mesh) if compiled else zerofx.shard(MLP(), mesh)
        x, y = torch.randn(4, 16, requires_grad=True), torch.randn(4, 8)
        model(x, y).backward()
        old = model.layers[0]._parameters["weight"]
        if replacement == "parameter":
            model.layers[0].weight = nn.Parameter(old.detach().clone())
        else:  # a plain tensor of the shard's shape written into _parameters (not a functional_call)
            model.layers[0]._parameters["weight"] = old.to_local().detach().clone()
        with pytest.raises(
            ZeroFXError, match=r"^layers\.0\.weight: the module holds another tensor than the parameter"
        ):
            model(x, y)
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


class _FunctionalCall(nn.Module):
    """A forward that calls a submodule with an overriding weight (torch.func.functional_call)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.func.functional_call(self.a, {"weight": self.a.weight * 0.5}, (x,))
        return self.b(torch.tanh(h)).pow(2).mean()


def _functional_call_grads(rank: int, world: int) -> dict[str, list]:
    torch.manual_seed(0)
    ref = _FunctionalCall()
    x = torch.randn(4, 8)  # the same batch on every rank: the averaged gradient is each rank's, exactly
    ref(x).backward()
    out = {"reference": [p.grad.tolist() for p in ref.parameters()]}
    mesh = init_device_mesh("cpu", (world,))
    for how in ("eager", "compiled"):
        torch.manual_seed(0)
        model = zerofx.shard(_FunctionalCall(), mesh) if how == "eager" else zerofx.compile(_FunctionalCall(), mesh)
        model(x).backward()
        out[how] = [p.grad.full_tensor().tolist() for p in model.parameters()]
        torch._dynamo.reset()
    return out


def test_functional_call_with_a_tensor_for_a_sharded_parameter_computes_with_it():
    """torch.func.functional_call puts its tensors in the module's ``_parameters`` for the call:
    a plain tensor there is the call's to compute with, not a parameter replaced after sharding
    (which nn.Module only allows as an nn.Parameter, and stays refused above). It was refused as
    one; eager and compiled, the gradients are now the unsharded model's, bit for bit."""
    from tests.multirank import run_ranks

    for got in run_ranks(_functional_call_grads, 2):
        assert got["eager"] == got["reference"] and got["compiled"] == got["reference"]


def test_backward_with_create_graph_keeps_the_gradients_differentiable():
    """A gradient penalty's ``backward(create_graph=True)`` (uncompiled: AOTAutograd has no
    double backward): the gradient moved from the plain leaf into the DTensor parameter keeps its
    graph, as autograd's own accumulation into the parameter did, and a second backward adds to
    it out of place."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = zerofx.shard(MLP(), init_device_mesh("cpu", (2,)))
        x, y = torch.randn(4, 16, requires_grad=True), torch.randn(4, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on the parameter/gradient reference cycle
            model(x, y).backward(create_graph=True)
            first = [p.grad for p in model.parameters()]
            model(x, y).backward(create_graph=True)
        assert all(p.grad.requires_grad and p.grad.grad_fn is not None for p in model.parameters())
        assert all(p.grad is not g for p, g in zip(model.parameters(), first))
    finally:
        dist.destroy_process_group()


def test_an_optimizer_stepping_in_backward_is_refused_by_name():
    """torch's ``_apply_optimizer_in_backward`` hooks the parameter's own AccumulateGrad node,
    which the graphs never reach (they read the shard as a plain tensor): without the refusal
    the optimizer would never step, silently."""
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = zerofx.shard(MLP(), init_device_mesh("cpu", (2,)))
        _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
        x, y = torch.randn(4, 16, requires_grad=True), torch.randn(4, 8)
        with pytest.raises(ZeroFXError, match=r"an optimizer stepping in backward .*plain_graph_inputs=False"):
            model(x, y).backward()
    finally:
        dist.destroy_process_group()


def test_the_guard_filter_drops_what_sharding_fixed_and_keeps_what_can_change(monkeypatch):
    """zerofx.compile's guard_filter_fn (zerofx/api.py): dynamo's per-parameter guards on the
    groups every parameter shares and, in the model's own frame, on a plain-input parameter's
    DTensor internals go; the mode flags, requires_grad, the leaf, the whole copy, what differs
    between parameters (rows, whole, dtypes), a module frame's guards and every guard on a
    parameter zerofx does not read through a leaf (one added after sharding, here) stay."""
    from types import SimpleNamespace

    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zerofx.api import _guard_filter

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = zerofx.shard(MLP(), init_device_mesh("cpu", (2,)))
        model.extra = nn.Linear(2, 2)
        state = "fn.__self__._modules['layers']._modules['1']._zerofx_params['weight']"
        param = "fn.__self__._modules['layers']._modules['1']._parameters['weight']"
        other = "L['fn'].__self__._modules['extra']._parameters['weight']"
        nested = "L['self']._parameters['weight']"  # a module's own frame, which may run for another
        names = {
            f"{state}.shard_group.size": False,
            f"{state}.shard_group.name": False,
            f"{state}.replicate_group": False,
            f"{state}.__dict__": False,
            f"{state}.full_rows": True,
            f"{state}.whole": True,
            f"{state}.compute_dtype": True,
            f"{param}._local_tensor": False,
            f"{param}._spec": False,
            f"{state}.leaf": True,
            f"{state}.full": True,
            f"{state}.runtime.stage": True,
            f"{state}.runtime.pending": True,
            f"{param}.requires_grad": True,
            f"{state}.param": True,
            f"{other}._local_tensor": True,
            f"{nested}._local_tensor": True,
        }
        keep = _guard_filter(model)([SimpleNamespace(name=n) for n in names])
        assert dict(zip(names, keep)) == names
        # it comes with plain graph inputs: plain_graph_inputs=False keeps every guard
        built = []
        monkeypatch.setattr(zerofx.api, "_guard_filter", lambda m: built.append(m) or _guard_filter(m))
        mesh = init_device_mesh("cpu", (2,))
        for plain in (False, True):
            zerofx.compile(MLP(), mesh, plain_graph_inputs=plain)
        assert len(built) == 1
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("make", "local", "grad", "match"),
    [
        (
            lambda ps: torch.optim.Rprop(ps, lr=1e-2),
            False,
            "dtensor",
            r"^torch\.optim\.Rprop steps zerofx's sharded parameters on their local shards only .*local_optimizer_step=True",
        ),
        (
            lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
            True,
            "plain",
            r"^layers\.0\.weight: its gradient is not a DTensor laid out like the parameter \(Tensor\), so Adafactor's "
            r"whole-tensor step cannot gather it",
        ),
    ],
    ids=["rprop_without_local_steps", "adafactor_with_a_plain_gradient"],
)
def test_optimizers_zerofx_cannot_step_so_are_refused_at_their_first_step_saying_why(make, local, grad, match):
    """Rprop's step fails inside DTensor, so zerofx runs it on the local shards from its first
    step: with local steps turned off it is an error. A whole-tensor step (Adafactor) gathers
    each gradient as laid out like its parameter: a plain tensor set as a gradient is an error.
    Both before any parameter changes. torch's fake process group stands in for a 2-rank job
    (the checks are local: no collective runs)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = zerofx.shard(MLP(), init_device_mesh("cpu", (2,)), local_optimizer_step=local)
        opt = make(model.parameters())
        before = [p.to_local().clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = torch.ones_like(p) if grad == "dtensor" else torch.ones(p.shape)
        with pytest.raises(ZeroFXError, match=match):
            opt.step()
        assert all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before))
    finally:
        dist.destroy_process_group()


def test_a_whole_tensor_step_refused_at_its_first_step_is_decided_again_at_the_next():
    """A whole-tensor step refused at its first step (a plain gradient) leaves nothing decided:
    once the gradients are DTensors again, the next step takes the whole-tensor path, not
    DTensor's (where Adafactor fails). torch's fake process group stands in for 2 ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zerofx.runtime.params import optimizer_state

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = zerofx.shard(MLP(), init_device_mesh("cpu", (2,)))
        opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
        for p in model.parameters():
            p.grad = torch.ones(p.shape)
        with pytest.raises(ZeroFXError, match="whole-tensor step cannot gather it"):
            opt.step()
        assert optimizer_state(opt) is None
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        assert optimizer_state(opt).whole
    finally:
        dist.destroy_process_group()


def test_an_optimizer_built_before_shard_is_refused_at_its_first_step():
    """shard puts new parameter objects into the model; an optimizer over the old ones would step
    parameters that never get a gradient (the model would not train, silently). Its first step,
    or its first after add_param_group, is an error naming the parameter. torch's fake process
    group stands in for a 2-rank job (the check is local: no collective runs)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = MLP()
        old = {n: p for n, p in model.named_parameters()}
        early = torch.optim.AdamW(model.parameters(), lr=1e-3)
        zerofx.shard(model, init_device_mesh("cpu", (2,)))
        first = next(iter(old))
        with pytest.raises(ZeroFXError, match=rf"AdamW holds the parameter '{first}' as it was before zerofx sharded"):
            early.step()
        later = torch.optim.SGD(model.parameters(), lr=1e-3)
        later.step()  # over the sharded parameters: fine (no gradients yet, so nothing moves)
        later.add_param_group({"params": [old[n] for n in list(old)[-1:]]})
        with pytest.raises(ZeroFXError, match=rf"SGD holds the parameter '{list(old)[-1]}'"):
            later.step()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_pickling_a_sharded_model_says_what_to_save_and_deepcopy_works_on_rank_one(param_dtype):
    """torch.save(model) of a sharded model is an error saying to save its state (it failed with
    a PicklingError on the run-time class, or on the bf16 input-cast hook). copy.deepcopy works
    on rank 1 at stage 1, where the shard is a view past the start of the whole copy and
    torch's deepcopy of such a DTensor fails: the copy's shard is again a view of the copy's
    whole copy, with the same values, and zerofx.compile compiles the copy (torch drops the
    compiled call). torch's fake process group stands in for rank 1 of 2."""
    import io

    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zerofx.runtime.params import runtime_of
    from zerofx.sharding import mesh_of

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        model = zerofx.compile(MLP(), init_device_mesh("cpu", (2,)), stage=1, param_dtype=param_dtype)
        with pytest.raises(ZeroFXError, match=r"cannot be pickled .* zerofx\.checkpoint\.save"):
            torch.save(model, io.BytesIO())
        with torch.no_grad():  # the fake group's all-gathers leave the whole copies unset: give the shards values
            for p in model.parameters():
                p.to_local().copy_(torch.randn(p.to_local().shape))
        twin = copy.deepcopy(model)
        for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
            assert q is not p and torch.equal(q.to_local(), p.to_local()), name
        for s, t in zip(runtime_of(model).states, runtime_of(twin).states):
            assert t.param is dict(twin.named_parameters())[s.qualname], s.qualname
            if param_dtype is None and s.param.to_local().storage_offset():
                assert t.param.to_local().untyped_storage().data_ptr() == t.full.untyped_storage().data_ptr()
        # torch copies a module without its compiled call: compiling the copy compiles it (its
        # copied compile state made that a no-op)
        assert twin.__dict__.get("_compiled_call_impl") is None
        zerofx.compile(twin, mesh_of(twin), stage=1, param_dtype=param_dtype)
        assert twin.__dict__.get("_compiled_call_impl") is not None
    finally:
        dist.destroy_process_group()


def test_a_sharded_model_moves_to_its_own_device_and_compiles_again_as_a_no_op():
    """After a compiled step (dynamo's guards now hold weak references to the parameters),
    model.to(its device) / .cpu() / .float() keep every shard, where torch would try to swap
    each DTensor parameter and fail; a cast that would change the shards is an error naming
    one, before anything is converted. zerofx.compile again on a new mesh over the same ranks
    (what Lightning's configure_model does for every stage) with the same options keeps the
    compiled model; other options recompile it; a mesh over other ranks is an error. torch's
    fake process group stands in for a 2-rank job."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zerofx.runtime.params import runtime_of

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch._dynamo.reset()
        model = zerofx.compile(MLP(), init_device_mesh("cpu", (2,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(4, 16), torch.randn(4, 8)).backward()
        opt.step()
        params = [(n, id(p)) for n, p in model.named_parameters()]
        assert model.to("cpu").cpu().float() is model
        assert model.to("cpu:0") is model  # torch copies a CPU tensor for "cpu:0": still no change
        for convert in (lambda t: t * 2, torch.zeros_like, lambda t: t[:1]):  # copies that change the shard
            with pytest.raises(ZeroFXError, match=r"converting a zerofx-sharded parameter"):
                model._apply(convert)
        with pytest.raises(ZeroFXError, match=r"converting a zerofx-sharded parameter"):
            model.to_empty(device="cpu")
        assert [(n, id(p)) for n, p in model.named_parameters()] == params
        with pytest.raises(
            ZeroFXError, match=r"converting a zerofx-sharded parameter \(torch.float32 on cpu -> torch.float64"
        ):
            model.double()
        assert {p.dtype for p in model.parameters()} == {torch.float32}

        compiled = runtime_of(model).compiled
        assert zerofx.compile(model, init_device_mesh("cpu", (2,))) is model
        assert runtime_of(model).compiled is compiled  # same options: nothing recompiled
        zerofx.compile(model, init_device_mesh("cpu", (2,)), executor="inductor")
        assert runtime_of(model).compiled is not compiled
        with pytest.raises(
            ZeroFXError, match=r"sharded on a mesh of ranks \[0, 1\].*this mesh has ranks \[\[0\], \[1\]\]"
        ):
            zerofx.compile(model, init_device_mesh("cpu", (2, 1)))
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_a_symbolic_recompile_under_an_agreed_plan_warns_once_per_process(monkeypatch):
    """dynamic="auto" with a checkpoint plan agreed across ranks: a recompile with dynamic sizes
    agrees at compile time, so every rank must recompile at the same step; say so, once."""
    import types

    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zerofx.backend

    def frame(**options):
        return types.SimpleNamespace(recorder=None, options=zerofx.Options(**options), graph_id="frame0")

    monkeypatch.setattr(zerofx.backend, "_WARNED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zerofx.backend._note_symbolic_frame(frame(activation_budget=0.5), ("s0",))  # one rank: nothing to agree
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            zerofx.backend._note_symbolic_frame(frame(), ("s0",))  # no plan to agree
            zerofx.backend._note_symbolic_frame(frame(activation_budget=0.5, dynamic=True), ("s0",))
        with pytest.warns(UserWarning, match=r"dynamic sizes \(s0, s1\).*pass dynamic=True to zerofx\.compile"):
            zerofx.backend._note_symbolic_frame(frame(activation_budget=0.5), ("s0", "s1"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            zerofx.backend._note_symbolic_frame(frame(activation_budget=0.5), ("s0",))  # once per process
    finally:
        dist.destroy_process_group()


def test_gloo_twins_are_made_once_per_group_and_forgotten_with_their_process_groups(tmp_path):
    """The lockstep checks' gloo twin of an NCCL group (zerofx/runtime/lockstep.py) is made once
    and shared by every model on that group; after destroy_process_group a new group gets a new
    twin instead of a destroyed one."""
    from zerofx.runtime import lockstep

    with one_rank_mesh(str(tmp_path / "a")) as mesh:
        group = mesh.get_group(0)
        twin = lockstep._gloo_twin(group)
        assert lockstep._gloo_twin(group) is twin and dist.get_backend(twin) == "gloo"
    with one_rank_mesh(str(tmp_path / "b")) as mesh:
        fresh = lockstep._gloo_twin(mesh.get_group(0))
        assert fresh is not twin and dist.get_process_group_ranks(fresh) == [0]
        assert [t for _, t in lockstep._TWINS.values()] == [fresh]  # the destroyed one forgotten
        # a subgroup destroyed on its own takes its twin with it
        sub = dist.new_group([0], backend="gloo")
        sub_twin = lockstep._gloo_twin(sub)
        dist.destroy_process_group(sub)
        assert lockstep._gloo_twin(mesh.get_group(0)) is fresh
        assert [t for _, t in lockstep._TWINS.values()] == [fresh]
        with pytest.raises(KeyError):
            dist.get_process_group_ranks(sub_twin)


class _Experts(nn.Module):
    """A mixture of experts' weights stacked as [experts, ffn, d], and a small 2-output head."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(experts, 1024, 256))  # 1 MiB per expert
        self.head = nn.Linear(16, 2)


def test_explain_names_the_parameters_split_along_another_dim():
    """zerofx.explain's report says which parameters zerofx split along another dim than 0 and
    along which (torch's fake process group stands in for 4 ranks)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.models import ExpertsNet

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        model = zerofx.compile(ExpertsNet(), init_device_mesh("cpu", (4,)))
        report = zerofx.explain(model, torch.randn(2, 8), torch.randn(2, 4))
    finally:
        dist.destroy_process_group()
    (line,) = [line for line in report.splitlines() if "split along another dim" in line]
    for part in ("w_in [2, 12, 8]: Shard(1)", "w_out [2, 8, 12]: Shard(1)", "router_bias [1, 2]: Shard(1)"):
        assert part in line
    assert "head" not in line  # [4, 8] over 4 ranks: rows


def test_weights_with_fewer_rows_than_ranks_split_along_another_dim_or_warn():
    """zerofx/ir/layout.py, NOTE: the sharded dim. Over 4 ranks a [2, 1024, 256] weight split by
    rows would put a whole expert on ranks 0 and 1 and nothing on 2 and 3: zerofx splits it
    along dim 1 (256 rows each, quietly) and the 2-output head along dim 1 too. Forced onto dim 0
    (``shard_placement_fn``), a warning names it; the head's padding is under
    FEW_ROWS_WASTE_BYTES. A bad ``shard_placement_fn`` is an error naming the parameter. torch's
    fake process group stands in for the 4 ranks."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*fewer slices.*")
            ps = dict(zerofx.shard(_Experts(2), mesh, persistence_threshold=0).named_parameters())
            assert ps["w"].placements == (Shard(1),) and ps["w"].to_local().shape == (2, 256, 256)
            assert ps["head.weight"].placements == (Shard(1),) and ps["head.weight"].to_local().shape == (2, 4)
            ps = dict(zerofx.shard(_Experts(4), mesh, persistence_threshold=0).named_parameters())
            assert ps["w"].placements == (Shard(0),)
        match = r"w \[2, 1024, 256\] \(split along dim 0\): fewer slices along the sharded dim than the 4 ranks"
        with pytest.warns(UserWarning, match=match) as seen:
            zerofx.shard(_Experts(2), mesh, persistence_threshold=0, shard_placement_fn=lambda p: Shard(0))
        assert not any("head" in str(w.message) for w in seen)
        for bad in (lambda p: Shard(3), lambda p: Replicate()):
            with pytest.raises(ZeroFXError, match=r"shard_placement_fn returned .* for w \[2, 1024, 256\]"):
                zerofx.shard(_Experts(2), mesh, shard_placement_fn=bad)
        with pytest.raises(ZeroFXError, match="option shard_placement_fn=1: give a function"):
            zerofx.shard(_Experts(2), mesh, shard_placement_fn=1)
    finally:
        dist.destroy_process_group()


def test_a_retained_graph_backpropagates_twice_after_the_first_step(one_rank):
    """AOT autograd compiles a backward with "donated buffers" by default and then refuses
    ``retain_graph=True``; zerofx's backward reuses no saved tensor in place and says so
    (zerofx/backend.py, ``_no_donated_buffers``): two backward passes through one retained
    graph, after a normal step, give twice eager's gradients."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    eager = copy.deepcopy(base)
    model = zerofx.compile(base, one_rank, param_dtype=torch.float32)
    x = torch.randn(4, 8)
    for m in (model, eager):
        m(x).pow(2).mean().backward()  # a normal step first: the backward is compiled
        m.zero_grad()
        loss = m(x).pow(2).mean()
        loss.backward(retain_graph=True)
        loss.backward()
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    torch._dynamo.reset()


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_a_deleted_model_takes_its_compiled_graphs_with_it(one_rank, param_dtype):
    """dynamo keeps a frame's compiled graphs in the frame's globals and drops them only when the
    code they were compiled to dies, which a cycle through C fields never lets happen: every
    model's graphs (and what they hold) stayed alive for the life of the process, and a job
    building models in a loop (a sweep, a notebook) grew by every model (NOTE: compiled graphs
    die with the model, zerofx/api.py)."""
    import gc
    import weakref

    from torch import fx

    def graph_modules() -> list:  # (a dead weakref.proxy raises on isinstance)
        return [o for o in gc.get_objects() if type(o) not in weakref.ProxyTypes and isinstance(o, fx.GraphModule)]

    gc.collect()
    before = {id(g) for g in graph_modules()}
    base = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 4))
    model = zerofx.compile(base, one_rank, param_dtype=param_dtype)
    x, y = torch.randn(3, 12), torch.randn(3, 4)
    nn.functional.mse_loss(model(x), y).backward()
    made = [g for g in graph_modules() if id(g) not in before]
    assert len(made) >= 2  # the compile made graphs: the check below can fail
    alive = [weakref.ref(g) for g in made]
    del made, model, base  # (compile returns the model it was given)
    gc.collect()  # the model, whose entry's end drops dynamo's caches of it
    gc.collect()  # and then the graphs they held
    assert [r for r in alive if r() is not None] == []
    torch._dynamo.reset()


class _Outputs(nn.Module):
    """A model whose output is a dict with a loss, or a tuple starting with None, taking keywords."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 3)

    def forward(self, x, *, target=None):
        logits = self.lin(x)
        loss = (logits - target).pow(2).mean()
        return {"logits": logits, "loss": loss} if self.kind == "dict" else (None, loss)


@pytest.mark.parametrize("kind", ["dict", "tuple"])
def test_explain_backpropagates_the_loss_of_dict_and_tuple_outputs_with_keyword_inputs(kind):
    """explain(model, x, example_kwargs={...}): an output's loss (a key, or the first tensor that
    requires grad) is backpropagated, so the report has the backward graph; gradients are left
    as they were."""
    model = _Outputs(kind)
    report = zerofx.explain(model, torch.randn(2, 4), example_kwargs={"target": torch.randn(2, 3)})
    assert "_forward:" in report and "_backward:" in report, report
    assert all(p.grad is None for p in model.parameters())
    quiet = zerofx.explain(model, torch.randn(2, 4), example_kwargs={"target": torch.randn(2, 3)}, backward=False)
    assert "_forward:" in quiet and "_backward:" not in quiet
    torch._dynamo.reset()


def test_explain_reports_every_frame_of_a_compiled_model_with_a_graph_break(one_rank):
    """A model compiled by zerofx.compile runs each frame through its own backend, which has no
    recorder: explain runs the model's plain call under its own, so the report has both frames
    of a graph break, and the model keeps its compiled call. A model dynamo runs wholly eagerly
    compiles no graph: an error saying so, not an empty report."""
    torch.manual_seed(0)
    model = zerofx.compile(GraphBreakNet(), one_rank)
    own_call = model._compiled_call_impl
    x, y = torch.randn(3, 12), torch.randn(3, 4)
    report = zerofx.explain(model, x, y)
    frames = {line.split("_")[0] for line in report.splitlines() if line.startswith("frame")}
    assert len(frames) == 2, report
    for frame in frames:
        assert f"{frame}_forward:" in report and f"{frame}_backward:" in report, report
    assert model._compiled_call_impl is own_call
    assert all(p.grad is None for p in model.parameters())
    model(x, y).backward()  # still trains through its own compiled call

    class Eager(nn.Module):
        @torch._dynamo.disable
        def forward(self, x):
            return x * 2

    with pytest.raises(ZeroFXError, match="zerofx.explain: no graph of Eager was compiled.*TORCH_LOGS"):
        zerofx.explain(Eager(), torch.randn(2))
    torch._dynamo.reset()


def test_explain_leaves_gradients_already_there_as_they_were(one_rank):
    """explain between a backward and the step: its own backward must not add into the
    gradients the model has (it doubled them in place), and the same tensors are put back.
    Inside a no_sync window its backward would join the window's reduction: an error."""
    torch.manual_seed(0)
    for stage in (1, 3):
        model = zerofx.compile(
            nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)),
            one_rank,
            stage=stage,
            param_dtype=torch.bfloat16,
        )  # sharded at world 1
        x = torch.randn(3, 4)
        model(x).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        before = {n: g.clone() for n, g in grads.items()}
        with contextlib.redirect_stdout(io.StringIO()):
            zerofx.explain(model, x)
        for n, p in model.named_parameters():
            assert p.grad is grads[n], n
            torch.testing.assert_close(p.grad, before[n], rtol=0, atol=0)
        model.zero_grad()
        with zerofx.no_sync(model):
            with pytest.raises(ZeroFXError, match="explain.*inside an accumulation window"):
                zerofx.explain(model, x)
            model(x).sum().backward()
        with pytest.raises(ZeroFXError, match="explain.*inside an accumulation window"):
            zerofx.explain(model, x)  # the window's gradients still wait for their reduction
        with contextlib.redirect_stdout(io.StringIO()):
            zerofx.explain(model, x, backward=False)
        model.zero_grad()
    torch._dynamo.reset()


def test_explain_refuses_layout_options_that_differ_from_the_sharding(one_rank):
    """explain compiles the model as it is sharded: a layout option it would ignore is an error
    naming it; the sharding's own value passes."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    zerofx.shard(model, one_rank, stage=3)
    x = torch.randn(2, 4)
    with pytest.raises(ZeroFXError, match=r"option stage=1 differs from the one the model was sharded with \(3\)"):
        zerofx.explain(model, x, stage=1, param_dtype=torch.bfloat16)
    with pytest.raises(ZeroFXError, match=r"option param_dtype=torch.bfloat16 differs .* \(None\)"):
        zerofx.explain(model, x, param_dtype=torch.bfloat16)
    assert "_forward:" in zerofx.explain(model, x, stage=3)
    with pytest.raises(
        ZeroFXError, match=r"option stage=2 is decided when parameters are sharded and this model is not"
    ):
        zerofx.explain(nn.Linear(4, 1), x, stage=2)
    torch._dynamo.reset()


class _ChangesItsWeight(nn.Module):
    """A forward that changes a parameter in place, as WGAN's weight clipping does (``how``), or
    (``"clone"``) changes only its own copy of it, which is fine."""

    def __init__(self, how: str):
        super().__init__()
        self.a, self.b, self.how = nn.Linear(8, 16), nn.Linear(16, 4), how

    def forward(self, x):
        with torch.no_grad():
            if self.how == "clamp_":
                self.b.weight.clamp_(-0.1, 0.1)
            elif self.how == "row":
                self.b.weight[0].mul_(0.5)  # through a view
            elif self.how == "setitem":
                self.b.weight[:, 0] = 0.0
            elif self.how == "clone":
                w = self.b.weight.clone()
                w.clamp_(-0.1, 0.1)
        h = torch.relu_(self.a(x))  # an in-place op on an activation is fine
        if self.how == "checkpointed":  # inside a region dynamo captures as a subgraph
            return torch.utils.checkpoint.checkpoint(self._clipped, h, use_reentrant=False).sum()
        return self.b(h.to(next(self.parameters())).to(h.dtype)).sum()  # a shard as to()'s template is fine

    def _clipped(self, h):
        with torch.no_grad():
            self.b.weight.clamp_(-0.1, 0.1)
        return self.b(h)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("how", ["clamp_", "row", "setitem", "checkpointed"])
def test_a_compiled_forward_changing_a_parameter_in_place_is_refused_by_name(one_rank, stage, how):
    """Inside a compiled forward ``self.b.weight`` is a whole copy gathered for that read: an
    in-place change to it reached neither the parameter nor its next read, and training went
    on without it (loss 1.02 where eager gives 1.11; b.weight kept values past the clamp).
    It is refused when the frame compiles, naming the parameter, at every stage."""
    model = zerofx.compile(_ChangesItsWeight(how), one_rank, stage=stage, param_dtype=torch.bfloat16)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=r"b\.weight: the compiled forward changes"):
        model(torch.randn(2, 8))
    torch._dynamo.reset()
    model = zerofx.compile(_ChangesItsWeight("clone"), one_rank, stage=stage, param_dtype=torch.bfloat16)
    model(torch.randn(2, 8)).backward()  # a copy of its own is the user's to change


def test_a_compiled_embedding_with_max_norm_is_refused_saying_why(one_rank):
    """``nn.Embedding(max_norm=...)`` renormalizes looked-up rows in the weight, in place: inside
    a compiled forward that reached only the gathered copy. Refused, naming max_norm."""
    model = zerofx.compile(nn.Sequential(nn.Embedding(10, 4, max_norm=1.0)), one_rank, param_dtype=torch.bfloat16)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=r"0\.weight: an embedding with max_norm"):
        model(torch.tensor([1, 2]))


class _Penalized(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)

    def forward(self, x, through_modules: bool):
        if through_modules:
            weights = [getattr(m, n) for m in self.modules() for n, _ in m.named_parameters(recurse=False)]
        else:
            weights = list(self.parameters())
        return self.a(x).sum() + 1e-2 * sum(w.pow(2).sum() for w in weights)


def test_a_compiled_forward_computing_with_the_shards_is_refused_and_module_reads_work(one_rank):
    """``self.parameters()`` inside forward gives the shards (DTensors): a weight penalty over
    them failed in AOT autograd with torch's "got mixed torch.Tensor and DTensor". It is
    refused naming the parameters and the way that works, which trains as eager does."""
    torch.manual_seed(0)
    model = _Penalized()
    ref = copy.deepcopy(model)
    zerofx.compile(model, one_rank, param_dtype=torch.bfloat16)
    x = torch.randn(2, 8)
    with pytest.raises(
        torch._dynamo.exc.BackendCompilerFailed, match=r"a\.weight, a\.bias: the compiled code computes with"
    ):
        model(x, False)
    loss, ref_loss = model(x, True), ref.to(torch.bfloat16)(x.to(torch.bfloat16), True)  # the same arithmetic
    assert loss.item() == pytest.approx(ref_loss.item(), rel=2.0**-7)


def test_a_sparse_embedding_is_refused_where_parameters_are_sharded(one_rank):
    """A sparse gradient has no rows to reduce-scatter: sharding an ``Embedding(sparse=True)``
    failed inside the first backward ("memory format option is only supported by strided
    tensors"); it is refused by name. Unsharded (one rank, no param_dtype) it trains as is."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleDict({"emb": nn.Embedding(10, 4, sparse=True)}))
    with pytest.raises(ZeroFXError, match=r"1\.emb: an embedding with sparse=True"):
        zerofx.shard(model, one_rank, param_dtype=torch.bfloat16)
    assert not zerofx.sharding.is_sharded(model)
    zerofx.shard(model, one_rank)
    model[1]["emb"](torch.tensor([1, 2])).sum().backward()
    assert model[1]["emb"].weight.grad.is_sparse


def test_a_complex_parameter_is_refused_where_parameters_are_sharded(one_rank):
    """gloo's collectives have no complex type: sharding a complex parameter failed with
    "Invalid scalar type" at stages 1-2, and stage 3 refused it for the wrong reason."""
    model = nn.Linear(3, 4)
    model.register_parameter("rot", nn.Parameter(torch.randn(4, dtype=torch.complex64)))
    with pytest.raises(ZeroFXError, match="rot: complex parameters are not supported"):
        zerofx.shard(model, one_rank, param_dtype=torch.bfloat16)
    assert not zerofx.sharding.is_sharded(model)


def test_explain_reports_the_program_compiled_with_the_models_options(one_rank):
    """explain on a model ``zerofx.compile`` compiled used to start from default options: the
    report of a model compiled with qwZ said "quantize: (no change)", another program than the
    one that runs. It explains with the compile's options, which its own override."""
    torch.manual_seed(0)
    model = zerofx.compile(MLP(), one_rank, param_dtype=torch.bfloat16, quantize_weights="int8")
    x, y = torch.randn(4, 16), torch.randn(4, 8)
    with contextlib.redirect_stdout(io.StringIO()):
        compiled_with = zerofx.explain(model, x, y)
        overridden = zerofx.explain(model, x, y, quantize_weights=None)
    assert "quantized 1 all-gathers" in compiled_with, compiled_with
    assert "quantized" not in overridden and "quantize: " in overridden, overridden


def test_explain_reports_the_checkpointing_that_runs(one_rank):
    """explain compiled a function calling the model, whose module paths dynamo spells through
    the closure (``__closure__[0].cell_contents.blocks.0``): no checkpointed module matched, and
    with ``checkpoint="full"`` it reported the plan without checkpointing (1.4 MiB saved where
    0.22 MiB are). Its saved bytes are now what a compiled step saves."""
    from zerofx.models import GPT, GPTConfig, random_batch

    cfg = GPTConfig(vocab_size=96, seq_len=64, n_layer=2)
    x, y = random_batch(cfg, 4, torch.Generator().manual_seed(1))

    def saved(**options) -> str:
        torch.manual_seed(0)
        model = zerofx.compile(GPT(cfg), one_rank, **options)
        with contextlib.redirect_stdout(io.StringIO()):
            report = zerofx.explain(model, x, y)
        return report

    full, plain = saved(checkpoint="full"), saved()
    assert "boundary of checkpointed blocks.0" in full and "boundary of checkpointed" not in plain
    assert "inside checkpointed blocks.1" in full
    assert zerofx.passes.modules.module_path("L['fn'].__closure__[0].cell_contents.blocks.0.attn") == "blocks.0.attn"
