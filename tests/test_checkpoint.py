"""Crash safety of zerofx.checkpoint, in one process (DCP saves without a process group).

Resume, resharding and export on real gloo ranks are in tests/test_zero_stages.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import zerofx.checkpoint
from zerofx import ZeroFXError


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_save_load_round_trip_with_optimizer_and_extra(tmp_path):
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    zerofx.checkpoint.save(tmp_path / "ck", model, opt, extra={"step": 7, "note": "x"})
    assert (tmp_path / "ck" / zerofx.checkpoint.COMPLETE_MARKER).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary folder left behind

    other = _model(1)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    assert not _equal(model, other)
    assert zerofx.checkpoint.load(tmp_path / "ck", other, other_opt) == {"step": 7, "note": "x"}
    assert _equal(model, other)
    state, other_state = opt.state_dict()["state"], other_opt.state_dict()["state"]
    for k in state:
        torch.testing.assert_close(state[k]["exp_avg_sq"], other_state[k]["exp_avg_sq"], rtol=0, atol=0)


def test_load_model_false_reads_the_optimizer_state_and_leaves_the_model(tmp_path):
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    zerofx.checkpoint.save(tmp_path / "ck", model, opt, extra={"step": 1})
    zerofx.checkpoint.save(tmp_path / "model_only", model)

    other = _model(1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    assert zerofx.checkpoint.load(tmp_path / "ck", other, other_opt, load_model=False) == {"step": 1}
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())  # parameters not read
    state, other_state = opt.state_dict()["state"], other_opt.state_dict()["state"]
    assert state.keys() == other_state.keys()
    for k in state:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(other_state[k][name], state[k][name], rtol=0, atol=0)

    with pytest.raises(ZeroFXError, match="reads only an optimizer's state: pass the optimizer"):
        zerofx.checkpoint.load(tmp_path / "ck", other, load_model=False)
    with pytest.raises(ZeroFXError, match="holds no optimizer state"):
        zerofx.checkpoint.load(tmp_path / "model_only", other, other_opt, load_model=False)


def test_a_crash_mid_write_leaves_no_checkpoint_and_the_partial_folder_is_refused(tmp_path, monkeypatch):
    model = _model(0)

    def crash(state_dict, checkpoint_id, **kwargs):  # write part of the data, then die
        (torch.save(state_dict["model"]["0.weight"], f"{checkpoint_id}/__0_0.distcp"))
        raise KeyboardInterrupt("killed during save")

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        zerofx.checkpoint.save(tmp_path / "ck", model)
    assert not (tmp_path / "ck").exists()  # the target name never held a partial checkpoint
    (partial,) = tmp_path.iterdir()
    assert partial.name.startswith(".ck.tmp-")
    with pytest.raises(ZeroFXError, match=r"is incomplete: it has no ZEROFX_COMPLETE marker.*refusing to load"):
        zerofx.checkpoint.load(partial, _model(1))
    with pytest.raises(ZeroFXError, match="is incomplete"):
        zerofx.checkpoint.export_full_state_dict(partial)


def test_a_folder_without_the_completion_marker_is_refused(tmp_path):
    model = _model(0)
    zerofx.checkpoint.save(tmp_path / "ck", model)
    (tmp_path / "ck" / zerofx.checkpoint.COMPLETE_MARKER).unlink()
    other = _model(1)
    with pytest.raises(ZeroFXError, match="incomplete"):
        zerofx.checkpoint.load(tmp_path / "ck", other)
    assert not _equal(model, other)  # nothing was loaded
    with pytest.raises(ZeroFXError, match="does not exist"):
        zerofx.checkpoint.load(tmp_path / "missing", other)


def test_overwriting_replaces_the_old_checkpoint_only_when_the_new_one_is_complete(tmp_path, monkeypatch):
    first, second = _model(0), _model(1)
    zerofx.checkpoint.save(tmp_path / "ck", first)
    real_save = dcp.save

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        zerofx.checkpoint.save(tmp_path / "ck", second)
    loaded = _model(2)
    zerofx.checkpoint.load(tmp_path / "ck", loaded)
    assert _equal(loaded, first)  # the old checkpoint is intact

    monkeypatch.setattr(dcp, "save", real_save)
    zerofx.checkpoint.save(tmp_path / "ck", second)
    zerofx.checkpoint.load(tmp_path / "ck", loaded)
    assert _equal(loaded, second)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".ck.tmp-")) == ["ck"]


def test_extra_must_be_json(tmp_path):
    with pytest.raises(ZeroFXError, match=r"extra\['t'\] is a Tensor; extra is saved as JSON"):
        zerofx.checkpoint.save(tmp_path / "ck", _model(0), extra={"t": torch.ones(1)})


def test_extra_comes_back_as_it_went_in_or_is_refused(tmp_path):
    """``extra`` goes through JSON, which has no tuples and only string keys: ``{"shape": (2,
    3)}`` loaded as ``[2, 3]`` and ``{"seen": {3: 10}}`` as ``{"3": 10}``, silently. Those are
    refused at the save, naming where; what JSON keeps comes back equal."""
    model = _model(0)
    for extra, where in [
        ({"shape": (2, 3)}, r"extra\['shape'\] is a tuple"),
        ({"seen": {3: 10}}, r"extra\['seen'\] has the key 3 \(int\)"),
        ({"runs": [{"ids": {1, 2}}]}, r"extra\['runs'\]\[0\]\['ids'\] is a set"),
    ]:
        with pytest.raises(ZeroFXError, match=where):
            zerofx.checkpoint.save(tmp_path / "ck", model, extra=extra)
        assert not (tmp_path / "ck").exists()
    extra = {"step": 7, "lr": 1e-3, "best": float("inf"), "done": False, "tag": None, "hist": [[1, 2.5], {"a": "b"}]}
    zerofx.checkpoint.save(tmp_path / "ck", model, extra=extra)
    assert zerofx.checkpoint.load(tmp_path / "ck", _model(1)) == extra


def test_export_gives_a_plain_state_dict(tmp_path):
    model = _model(0)
    zerofx.checkpoint.save(tmp_path / "ck", model, torch.optim.SGD(model.parameters(), lr=0.1))
    sd = zerofx.checkpoint.export_full_state_dict(tmp_path / "ck", tmp_path / "m.pt")
    assert set(sd) == set(model.state_dict())  # model keys only, no optimizer state
    plain = _model(1)
    plain.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    assert _equal(plain, model)


def test_loading_another_models_checkpoint_is_one_clear_error_with_the_model_untouched(tmp_path):
    zerofx.checkpoint.save(tmp_path / "ck", _model(0))
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2), nn.Linear(2, 2))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(
        ZeroFXError, match=r"does not fit this Sequential: 0\.weight has shape \(8, 4\) there, \(16, 4\)"
    ):
        zerofx.checkpoint.load(tmp_path / "ck", other)
    with pytest.raises(ZeroFXError, match=r"3\.weight is missing"):
        zerofx.checkpoint.load(tmp_path / "ck", other)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_save_replaces_only_a_checkpoint_or_an_empty_folder(tmp_path):
    """A folder of the user's is never deleted by a save into it; an empty one is used."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train_log.txt").write_text("step 100: loss 2.1")
    with pytest.raises(ZeroFXError, match=r"is not a zerofx checkpoint \(no ZEROFX_COMPLETE marker\).*nothing"):
        zerofx.checkpoint.save(tmp_path / "run", _model(0))
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["train_log.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no temporary folder either
    (tmp_path / "file").write_text("x")
    with pytest.raises(ZeroFXError, match="exists and is not a folder"):
        zerofx.checkpoint.save(tmp_path / "file", _model(0))
    (tmp_path / "empty").mkdir()
    zerofx.checkpoint.save(tmp_path / "empty", _model(0))
    loaded = _model(1)
    zerofx.checkpoint.load(tmp_path / "empty", loaded)
    assert _equal(loaded, _model(0))


def test_a_crash_between_the_renames_is_named_by_load(tmp_path, monkeypatch):
    zerofx.checkpoint.save(tmp_path / "ck", _model(0))
    real_replace, calls = zerofx.checkpoint.os.replace, []

    def die_on_the_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        real_replace(src, dst)

    monkeypatch.setattr(zerofx.checkpoint.os, "replace", die_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        zerofx.checkpoint.save(tmp_path / "ck", _model(1))
    monkeypatch.undo()
    with pytest.raises(ZeroFXError, match=r"stopped between its two renames: .*\.ck\.tmp-\w+ is complete") as info:
        zerofx.checkpoint.load(tmp_path / "ck", _model(2))
    left = str(info.value).split(": ")[1].split(" is complete")[0]
    real_replace(left, tmp_path / "ck")  # as the error says
    loaded = _model(2)
    zerofx.checkpoint.load(tmp_path / "ck", loaded)
    assert _equal(loaded, _model(1))


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(3, 4, generator=gen)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def test_saving_before_the_first_step_leaves_the_optimizer_as_it_was(tmp_path):
    """torch's helpers would run a step at lr 0 on an optimizer that never stepped (Adam's step
    count 1 from then on): the saved run and the resumed one both train like a run never saved."""
    plain, saved = _model(0), _model(0)
    plain_opt, saved_opt = torch.optim.AdamW(plain.parameters(), lr=0.1), torch.optim.AdamW(saved.parameters(), lr=0.1)
    zerofx.checkpoint.save(tmp_path / "ck", saved, saved_opt)
    assert not saved_opt.state and all(p.grad is None for p in saved.parameters())
    resumed = _model(1)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=0.1)
    zerofx.checkpoint.load(tmp_path / "ck", resumed, resumed_opt)
    assert not resumed_opt.state
    for model, opt in ((plain, plain_opt), (saved, saved_opt), (resumed, resumed_opt)):
        _train(model, opt, 3, seed=5)
    assert _equal(saved, plain) and _equal(resumed, plain)


def test_load_reads_the_optimizer_state_when_gradients_are_present(tmp_path):
    """A warm-up backward before resuming: torch's helpers would request no optimizer state at
    all; the state is read, and the gradients are left as they were."""
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, opt, 2, seed=3)
    zerofx.checkpoint.save(tmp_path / "ck", model, opt)
    other = _model(1)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    other(torch.randn(3, 4)).sum().backward()
    grads = [p.grad.clone() for p in other.parameters()]
    zerofx.checkpoint.load(tmp_path / "ck", other, other_opt)
    assert all(torch.equal(p.grad, g) for p, g in zip(other.parameters(), grads))
    state, other_state = opt.state_dict()["state"], other_opt.state_dict()["state"]
    assert state.keys() == other_state.keys() and len(state) == 4
    for k in state:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(other_state[k][name], state[k][name])


class _WithUnused(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.used, self.unused = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def test_a_parameter_with_no_optimizer_state_resumes_with_none(tmp_path):
    """An unused parameter (an expert no token reached) has no Adam state at the save: it gets
    none at the load, and the resumed run trains like the uninterrupted one."""
    model = _WithUnused(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, opt, 2, seed=3)
    assert len(opt.state) == 2
    zerofx.checkpoint.save(tmp_path / "ck", model, opt)
    other = _WithUnused(1)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    zerofx.checkpoint.load(tmp_path / "ck", other, other_opt)
    assert set(other_opt.state) == {other.used.weight, other.used.bias}
    _train(model, opt, 2, seed=4)
    _train(other, other_opt, 2, seed=4)
    assert _equal(model, other)


def test_another_optimizer_or_other_groups_or_no_optimizer_state_is_one_clear_error(tmp_path):
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, opt, 1, seed=3)
    zerofx.checkpoint.save(tmp_path / "adamw", model, opt)
    zerofx.checkpoint.save(tmp_path / "model_only", model)
    other = _model(1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    sgd = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(
        ZeroFXError,
        match=r"does not fit this optimizer.*0\.weight has \['exp_avg', 'exp_avg_sq', 'step'\] there, \['momentum_buffer'\] here",
    ):
        zerofx.checkpoint.load(tmp_path / "adamw", other, sgd)
    weights, biases = (
        [p for n, p in other.named_parameters() if "weight" in n],
        [p for n, p in other.named_parameters() if "bias" in n],
    )
    grouped = torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=0.1)
    with pytest.raises(ZeroFXError, match=r"has 1 optimizer parameter group\(s\), this optimizer 2"):
        zerofx.checkpoint.load(tmp_path / "adamw", other, grouped)
    with pytest.raises(ZeroFXError, match="holds no optimizer state"):
        zerofx.checkpoint.load(tmp_path / "model_only", other, torch.optim.AdamW(other.parameters()))
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_a_checkpoint_with_tensors_the_model_lacks_is_refused(tmp_path):
    """A resume with the wrong depth: the checkpoint's extra layer is named, nothing is loaded."""
    torch.manual_seed(0)
    deeper = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 2))
    zerofx.checkpoint.save(tmp_path / "ck", deeper)
    other = _model(1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ZeroFXError, match=r"does not fit this Sequential: 3\.weight is not in the model; 3\.bias"):
        zerofx.checkpoint.load(tmp_path / "ck", other)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


@pytest.mark.parametrize("lr", [0.1, "tensor"])
def test_a_scheduler_built_after_load_finds_the_saved_param_group_keys(tmp_path, lr):
    """Every saved parameter-group key is restored, also those a fresh optimizer lacks (an LR
    scheduler's ``initial_lr``), as torch's ``optimizer.load_state_dict`` does: a scheduler
    built after the load with ``last_epoch`` (else KeyError: param 'initial_lr' is not specified)
    gives the learning rates it gives after torch's own load. A tensor lr's ``initial_lr`` is a
    tensor in the checkpoint, read as one."""

    def new_lr():
        return torch.tensor(0.1) if lr == "tensor" else lr

    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=new_lr())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        _train(model, opt, 1, seed=3)
        sched.step()
    zerofx.checkpoint.save(tmp_path / "ck", model, opt, extra={"epoch": sched.last_epoch})
    saved_groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    assert "initial_lr" in saved_groups[0]

    def lrs(optimizer, epoch):
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5, last_epoch=epoch)
        out = []
        for _ in range(3):
            optimizer.step()
            scheduler.step()
            out.append(optimizer.param_groups[0]["lr"])
        return out

    plain = torch.optim.AdamW(_model(1).parameters(), lr=new_lr())
    plain.load_state_dict(opt.state_dict())
    expected = lrs(plain, sched.last_epoch)
    for load_model in (True, False):
        other = _model(1)
        other_opt = torch.optim.AdamW(other.parameters(), lr=new_lr())
        extra = zerofx.checkpoint.load(tmp_path / "ck", other, other_opt, load_model=load_model)
        assert [{k: v for k, v in g.items() if k != "params"} for g in other_opt.param_groups] == saved_groups
        assert lrs(other_opt, extra["epoch"]) == expected


class _WithIntegerBuffers(nn.Module):
    """Integer and bool tensors among the floating-point ones; the first tensor an integer one."""

    def __init__(self):
        super().__init__()
        self.register_buffer("position_ids", torch.arange(4) + 2**40)  # not exact in bf16 or fp32
        self.lin = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.register_buffer("mask", torch.tensor([True, False, True]))


def test_export_with_a_dtype_casts_only_the_floating_point_tensors(tmp_path):
    """``export(..., dtype=bf16)`` (``zerofx convert --dtype bf16``) casts floating-point tensors,
    as HF's save_pretrained does: BatchNorm's ``num_batches_tracked`` 1001 stays int64 1001 (not
    bf16 1000.0), an int64 buffer and a bool one keep their values; the safetensors headers and
    the index's total_size match the bytes written; config.json names the floating-point dtype."""
    load_file = pytest.importorskip("safetensors.torch").load_file
    model = _WithIntegerBuffers()
    model.bn.num_batches_tracked.fill_(1001)
    zerofx.checkpoint.save(tmp_path / "ck", model)
    expected = model.state_dict()
    assert next(iter(expected)) == "position_ids"
    config = {"model_type": "test"}
    for to, dtype in (("hf", torch.bfloat16), ("torch", torch.bfloat16), ("hf", None)):
        out = tmp_path / f"{to}-{dtype}"
        zerofx.checkpoint.export(tmp_path / "ck", out, to=to, dtype=dtype, max_shard_bytes=64, config=config)
        index_name = "model.safetensors.index.json" if to == "hf" else "pytorch_model.bin.index.json"
        index = json.loads((out / index_name).read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1
        sd = {}
        for name in files:
            sd.update(load_file(out / name) if to == "hf" else torch.load(out / name, weights_only=True))
        assert sd.keys() == expected.keys()
        for k, v in expected.items():
            want = v.to(dtype) if dtype is not None and v.is_floating_point() else v
            assert sd[k].dtype == want.dtype and torch.equal(sd[k], want), k
        assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in sd.values())
        for name in files:  # files sized by the bytes written: at most 64, or one larger tensor
            keys = [k for k, f in index["weight_map"].items() if f == name]
            assert len(keys) == 1 or sum(sd[k].numel() * sd[k].element_size() for k in keys) <= 64, keys
        assert json.loads((out / "config.json").read_text())["dtype"] == ("bfloat16" if dtype else "float32")


def _hf_folder(folder, model: nn.Module, max_shard_bytes: int) -> dict[str, str]:
    """``model`` as an HF folder (through a checkpoint and ``export``); its index's weight_map
    ({} for one file)."""
    zerofx.checkpoint.save(folder.parent / f"{folder.name}-ck", model)
    zerofx.checkpoint.export(folder.parent / f"{folder.name}-ck", folder, max_shard_bytes=max_shard_bytes)
    index = folder / "model.safetensors.index.json"
    return json.loads(index.read_text())["weight_map"] if index.exists() else {}


def test_load_hf_reads_the_files_from_pretrained_reads_and_no_other(tmp_path):
    """DCP's HuggingFaceStorageReader indexes every *.safetensors file of the folder: a stale one
    beside a sharded save (an older single-file save, adapters, a consolidated copy, a shard the
    index no longer names) supplied some of the tensors. load_hf reads what transformers'
    from_pretrained reads: model.safetensors when there is one, else the index's files."""
    save_file = pytest.importorskip("safetensors.torch").save_file
    saved, stale = _model(0), _model(1)
    stale_sd = {k: v.contiguous() for k, v in stale.state_dict().items()}
    weight_map = _hf_folder(tmp_path / "sharded", saved, max_shard_bytes=64)
    assert len(set(weight_map.values())) == 4
    for name in ("adapter_model.safetensors", "consolidated.safetensors", "model-00005-of-00005.safetensors"):
        save_file(stale_sd, tmp_path / "sharded" / name)
    model = _model(2)
    zerofx.checkpoint.load_hf(tmp_path / "sharded", model)
    assert _equal(model, saved)

    _hf_folder(tmp_path / "single", saved, max_shard_bytes=1 << 20)
    save_file(stale_sd, tmp_path / "single" / "consolidated.safetensors")
    zerofx.checkpoint.load_hf(tmp_path / "single", model := _model(2))
    assert _equal(model, saved)

    # a model.safetensors beside the index: from_pretrained reads it (transformers looks for it first)
    save_file(stale_sd, tmp_path / "sharded" / "model.safetensors")
    zerofx.checkpoint.load_hf(tmp_path / "sharded", model := _model(2))
    assert _equal(model, stale)


def test_load_hf_refuses_an_index_that_does_not_say_where_each_tensor_is(tmp_path):
    save_file = pytest.importorskip("safetensors.torch").save_file
    weight_map = _hf_folder(tmp_path / "hf", _model(0), max_shard_bytes=64)
    first, second = sorted(set(weight_map.values()))[:2]
    save_file({"0.weight": torch.zeros(8, 4), "0.bias": torch.zeros(8)}, tmp_path / "hf" / second)  # also in first
    untouched = _model(2)
    with pytest.raises(ZeroFXError, match=rf"0\.weight is in {first} and in {second}.*nothing was loaded"):
        zerofx.checkpoint.load_hf(tmp_path / "hf", untouched)
    assert _equal(untouched, _model(2))
    (tmp_path / "hf" / second).unlink()
    with pytest.raises(ZeroFXError, match=rf"index\.json names {second} \(missing\)"):
        zerofx.checkpoint.load_hf(tmp_path / "hf", untouched)
    (tmp_path / "hf" / "model.safetensors.index.json").unlink()
    with pytest.raises(ZeroFXError, match=r"has neither model\.safetensors nor model\.safetensors\.index\.json"):
        zerofx.checkpoint.load_hf(tmp_path / "hf", untouched)
