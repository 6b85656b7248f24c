"""Rank-side scenarios for tests/test_multirank_api.py (each returns plain data to assert on)."""

from __future__ import annotations

import contextlib
import copy
import io

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import zerofx
from tests.models import CASES, GPT_CFG
from tests.multirank import attempt as run_scenario
from tests.multirank import mean_over_ranks
from tests.parity import reference_shard
from zerofx.backend import make_backend
from zerofx.dump import Recorder
from zerofx.models import GPT, random_batch


def _train(model, ref, rank, world, steps, mesh_ready=True):
    """Train ``model`` (already sharded) and ``ref`` side by side.

    Returns the worst relative loss error over the steps and the worst absolute parameter error
    at the end (parameters are ~0.02 in size; lr 3e-3)."""
    gen = torch.Generator().manual_seed(7)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, ref))
    worst_loss = worst_param = 0.0
    for _ in range(steps):
        x, y = random_batch(GPT_CFG, 2 * world, gen)
        mine = slice(2 * rank, 2 * rank + 2)
        loss = model(x[mine], y[mine])
        loss.backward()
        ref_loss = ref(x, y)
        ref_loss.backward()
        worst_loss = max(worst_loss, abs(mean_over_ranks(loss) - ref_loss.item()) / abs(ref_loss.item()))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    for (_, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        local, expect = p.to_local(), reference_shard(q.detach(), rank, world)
        worst_param = max(worst_param, (local - expect).abs().max().item())
    return worst_loss, worst_param


def _fresh_gpt():
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    return model, copy.deepcopy(model)


class _ExtraOnSomeRanks(torch.nn.Module):
    """A layer, then a parameter only the ranks told to use it read (a data-dependent branch)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.extra = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x, use_extra: bool):
        h = self.lin(x)
        return (h @ self.extra if use_extra else h).pow(2).mean()


class _KeptReferences(torch.nn.Module):
    """An MLP whose forward reads its weights through a list made in ``__init__``."""

    def __init__(self):
        super().__init__()
        from tests.models import MLP

        self.mlp = MLP()
        self.ws = [layer.weight for layer in self.mlp.layers]

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(x @ self.ws[0].t() @ self.ws[1].t() @ self.ws[2].t(), y)


def scenarios(rank: int, world: int, folder: str) -> dict:
    """``folder``: shared by the ranks, for checkpoints."""
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}

    def attempt(name, fn):
        run_scenario(out, name, fn)

    def explain():
        model, _ = _fresh_gpt()
        zerofx.shard(model, mesh)
        x, y = random_batch(GPT_CFG, 2, torch.Generator().manual_seed(0))
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            report = zerofx.explain(model, x, y)
        grads_left = [n for n, p in model.named_parameters() if p.grad is not None]
        return {"report": report, "printed": buf.getvalue(), "grads_left": grads_left}

    def explain_whole_copies():  # stages 1-2: the collectives outside the graphs are named
        reports = {}
        for stage in (1, 2):
            torch._dynamo.reset()
            model, _ = _fresh_gpt()
            zerofx.shard(model, mesh, stage=stage)
            x, y = random_batch(GPT_CFG, 2, torch.Generator().manual_seed(0))
            with contextlib.redirect_stdout(io.StringIO()):
                reports[stage] = zerofx.explain(model, x, y)
        return reports

    def two_step_pairing():
        model, ref = _fresh_gpt()
        zerofx.shard(model, mesh)
        compiled = torch.compile(model, backend="zerofx")
        return _train(compiled, ref, rank, world, steps=4)

    def eager_sharded():  # no compile at all: the marker ops' eager implementations
        model, ref = _fresh_gpt()
        zerofx.shard(model, mesh)
        return _train(model, ref, rank, world, steps=4)

    def disabled(pass_name):
        def run():
            model, ref = _fresh_gpt()
            zerofx.shard(model, mesh)
            recorder = Recorder()
            options = zerofx.Options(disable_passes=(pass_name,))
            model.compile(backend=make_backend(options, recorder))
            errors = _train(model, ref, rank, world, steps=3)
            return {"errors": errors, "summary": recorder.summary()}

        return run

    def clip_and_state_dict():
        torch.manual_seed(0)
        model = CASES["uneven"].build()
        ref = copy.deepcopy(model)
        zerofx.compile(model, mesh)
        x, y = CASES["uneven"].batch(2 * world, torch.Generator().manual_seed(3))
        model(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]).backward()
        ref(x, y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.01)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.01)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        clipped = max(
            (p.grad.to_local() - reference_shard(q.grad, rank, world)).abs().max().item()
            for p, q in zip(model.parameters(), ref.parameters())
        )
        sd = model.state_dict()
        return {
            "norm": norm.item(),
            "ref_norm": ref_norm.item(),
            "clipped_grad_err": clipped,
            "state_dict": {k: (type(v).__name__, tuple(v.shape)) for k, v in sd.items()},
            "ref_state_dict": {k: tuple(v.shape) for k, v in ref.state_dict().items()},
        }

    def whole_state_dict():
        """model.load_state_dict of a plain, whole state dict (every rank loads the same) at each
        stage, bf16 compute, and into a model built on the meta device."""
        case = CASES["uneven"]  # rows not divisible by the ranks: uneven and padded shards
        torch.manual_seed(1)
        source = case.build()
        whole = source.state_dict()
        x, y = case.batch(4, torch.Generator().manual_seed(5))
        want = source(x, y).item()
        got = {}
        for label, options in (
            ("stage1", {"stage": 1}),
            ("stage2", {"stage": 2}),
            ("stage3", {}),
            ("bf16", {"param_dtype": torch.bfloat16}),
            ("stage1_assign", {"stage": 1}),  # assign=True: copied into the shards all the same
            ("stage3_assign", {}),
        ):
            torch.manual_seed(0)
            model = zerofx.compile(case.build(), mesh, **options)
            model.load_state_dict(whole, assign=label.endswith("assign"))
            params = {k: v.full_tensor() for k, v in model.state_dict().items() if isinstance(v, DTensor)}
            got[label] = {
                "param_err": max((params[k] - whole[k]).abs().max().item() for k in params),
                "loss": model(x, y).item(),
            }
        with torch.device("meta"):
            meta = case.build()
        zerofx.compile(meta, mesh)
        meta.load_state_dict(whole)
        got["meta"] = {"loss": meta(x, y).item()}
        with torch.device("meta"):
            meta = case.build()
        zerofx.compile(meta, mesh)
        meta.load_state_dict(whole, assign=True)  # what loading code for meta-built models passes
        got["meta_assign"] = {"loss": meta(x, y).item()}
        for label, options in (("meta_parts", {}), ("meta_parts_stage1", {"stage": 1})):
            with torch.device("meta"):
                meta = case.build()
            zerofx.compile(meta, mesh, **options)
            own = {k: v for k, v in whole.items() if "." not in k}  # the model's own parameters, first
            meta.load_state_dict(own, strict=False)
            children = list(meta.named_children())
            for i, (name, child) in enumerate(children):  # part by part, each from the child itself
                if i == len(children) - 1:  # before the last part: refused, naming what is missing
                    try:
                        meta(x, y)
                        got[f"{label}_early"] = "ran"
                    except zerofx.ZeroFXError as e:
                        got[f"{label}_early"] = str(e)
                child.load_state_dict({k[len(name) + 1 :]: v for k, v in whole.items() if k.startswith(name + ".")})
            got[label] = {"loss": meta(x, y).item(), "last": children[-1][0]}
        wrong = {k: (v[:-1] if v.ndim == 2 else v) for k, v in whole.items()}
        try:
            model.load_state_dict(wrong)
            got["mismatch"] = "loaded"
        except RuntimeError as e:
            got["mismatch"] = str(e)
        return {"want": want, "got": got}

    def gathered_copy_writes():
        """Outside a compiled graph module.weight is a gathered copy: reads work, in-place writes
        are refused naming the parameter, and the parameter itself takes them. Its ``.grad`` is
        None while the parameter has none, else refused (read or set), naming the parameter's."""
        model, _ = _fresh_gpt()
        zerofx.compile(model, mesh)
        block = model.blocks[0].fc
        whole = model.state_dict()["blocks.0.fc.weight"].full_tensor()
        read_err = (block.weight - whole).abs().max().item()
        refused = {}
        writes = {
            "mul_": lambda w: w.mul_(0.5),
            "data.clamp_": lambda w: w.data.clamp_(-0.01, 0.01),
            "init.normal_": lambda w: torch.nn.init.normal_(w),
            "setitem": lambda w: w.__setitem__(0, 1.0),
            "out=": lambda w: torch.add(w, 1.0, out=w),
            "data=": lambda w: setattr(w, "data", torch.zeros_like(w)),
        }
        unchanged = block.weight
        unchanged.data = unchanged.data.clone()  # changes nothing, so nothing is lost: allowed
        with torch.no_grad():
            for label, write in writes.items():
                try:
                    write(block.weight)
                    refused[label] = "allowed"
                except zerofx.ZeroFXError as e:
                    refused[label] = str(e)
            dict(model.named_parameters())["blocks.0.fc.weight"].mul_(0.5)
        after = model.state_dict()["blocks.0.fc.weight"].full_tensor()
        # torch's lookup by name gives the parameter itself, not a gathered copy
        itself = model.get_parameter("blocks.0.fc.weight") is dict(model.named_parameters())["blocks.0.fc.weight"]
        twin = copy.deepcopy(model)
        twin_itself = twin.blocks[0].get_parameter("fc.weight") is dict(twin.named_parameters())["blocks.0.fc.weight"]
        # module.weight.grad: the copy has none of its own (it read None after every backward):
        # reading or setting it is refused, naming the parameter's
        none_before = block.weight.grad is None  # the truth: the parameter has no gradient yet
        x, y = random_batch(GPT_CFG, 2, torch.Generator().manual_seed(rank))
        model(x, y).backward()
        grad_use = {}
        for label, use in (("read", lambda w: w.grad), ("set", lambda w: setattr(w, "grad", None))):
            try:
                use(block.weight)
                grad_use[label] = "allowed"
            except zerofx.ZeroFXError as e:
                grad_use[label] = str(e)
        kept = model.get_parameter("blocks.0.fc.weight").grad is not None
        return {
            "read_err": read_err,
            "refused": refused,
            "halved_err": (after - whole / 2).abs().max().item(),
            "get_parameter": itself and twin_itself,
            "grad": (grad_use, kept and none_before),
        }

    def stale_whole_copies():
        """Stages 1 and 2 read whole copies in forward: writes to the shards that no refresh
        followed (the parameter, through zerofx.compile or the two-step pairing;
        torch.distributed.checkpoint.load in place, an AveragedModel's updates) stop the next
        forward; after refresh() it matches the reference."""
        import tempfile

        import torch.distributed.checkpoint as dcp
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        x, y = random_batch(GPT_CFG, 2, torch.Generator().manual_seed(3))

        def forward(m):
            try:
                with torch.no_grad():
                    return m(x, y).item()
            except zerofx.ZeroFXError as e:
                return str(e)

        got = {}
        for stage, pairing in ((1, "compile"), (2, "compile"), (2, "two_step")):
            model, ref = _fresh_gpt()
            if pairing == "compile":
                compiled = zerofx.compile(model, mesh, stage=stage)
            else:  # zerofx.shard, then torch.compile(backend="zerofx"): the check is the backend's
                compiled = torch.compile(zerofx.shard(model, mesh, stage=stage), backend="zerofx")
                forward(compiled)  # compiled before the write, as in a training loop
            runtime = zerofx.sharding.runtime_of(model)
            with torch.no_grad():
                for (_, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                    p.mul_(0.5), q.mul_(0.5)
            stale = forward(compiled)
            runtime.refresh()
            got[f"stage{stage}_{pairing}"] = (stale, forward(compiled), forward(ref))
        # stage 1 (the shard a view of its rows of the whole copy): DCP in place, then an EMA copy
        model, ref = _fresh_gpt()
        zerofx.compile(model, mesh, stage=1)
        runtime = zerofx.sharding.runtime_of(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        saved = forward(model)
        folder = [tempfile.mkdtemp() if rank == 0 else None]
        dist.broadcast_object_list(folder, src=0)
        dcp.save(model.state_dict(), checkpoint_id=folder[0])
        model(x, y).backward(), opt.step(), opt.zero_grad()
        dcp.load(model.state_dict(), checkpoint_id=folder[0])
        stale = forward(model)
        runtime.refresh()
        got["dcp"] = (stale, forward(model), saved)
        # the model is the reference again (the step is undone): both train from here
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
        ema, ref_ema = (AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9)) for m in (model, ref))
        for update in ("copy", "foreach"):  # AveragedModel's first update copies, later ones _foreach_lerp_
            for m, o in ((model, opt), (ref, ref_opt)):
                m(x, y).backward(), o.step(), o.zero_grad()
            ema.update_parameters(model), ref_ema.update_parameters(ref)
            stale = forward(ema)
            zerofx.sharding.runtime_of(ema.module).refresh()
            got[f"ema_{update}"] = (stale, forward(ema), forward(ref_ema))
        # a deepcopy trains (uncompiled) as the reference's copy does: its gradient sinks reduce
        twin, ref_twin = copy.deepcopy(model), copy.deepcopy(ref)
        twin_opt, ref_twin_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (twin, ref_twin))
        for m, o in ((twin, twin_opt), (ref_twin, ref_twin_opt)):
            for _ in range(2):
                m(x, y).backward(), o.step(), o.zero_grad()
        untrained = forward(model)
        # a deepcopy while the gradients are views of the reduce-scatter's bucket (after a
        # backward: it raised "invalid python storage"): the copy holds the same gradients, apart
        model(x, y).backward()
        try:
            held = copy.deepcopy(model)
            pairs = list(zip(model.parameters(), held.parameters()))
            grads = all(torch.equal(p.grad.to_local(), q.grad.to_local()) for p, q in pairs)
            apart = all(p.grad.to_local().data_ptr() != q.grad.to_local().data_ptr() for p, q in pairs)
            held_grads = grads and apart
        except RuntimeError as e:
            held_grads = str(e)
        return {"stale": got, "twin": (forward(twin), forward(ref_twin), untrained), "held_grads": held_grads}

    def share_memory():
        """model.share_memory() on shards (torch 2.13 crashes on a DTensor's): the local shards
        move to shared memory, and the model still trains as the reference does."""
        model, ref = _fresh_gpt()
        zerofx.compile(model, mesh)
        x, y = random_batch(GPT_CFG, 2 * world, torch.Generator().manual_seed(5))
        mine = slice(2 * rank, 2 * rank + 2)
        model(x[mine], y[mine]).backward()  # after a compiled step, as a user would
        model.zero_grad()
        model.share_memory()
        shared = all(p.to_local().is_shared() for p in model.parameters())
        return {"shared": shared, "loss": mean_over_ranks(model(x[mine], y[mine])), "want": ref(x, y).item()}

    def submodule_load():
        """At stages 1 and 2, a new head loaded into a submodule mid-training
        (``model.layers[2].load_state_dict``): the loss after it, against the plain model's
        (the forward refused the whole copies as changed in place before); the all-gathers a
        load into ``model.layers`` (three Linears) refreshes with (one per Linear before); and
        the loss after a submodule load that raised part-way and then the model's own load."""
        from tests.models import MLP

        got = {}
        gen = torch.Generator().manual_seed(3)
        x, y = torch.randn(4 * world, 16, generator=gen), torch.randn(4 * world, 8, generator=gen)
        mine = slice(4 * rank, 4 * rank + 4)
        head = torch.nn.Linear(32, 8, bias=False)
        for stage in (1, 2):
            torch.manual_seed(0)
            ref = MLP()
            model = zerofx.compile(copy.deepcopy(ref), mesh, stage=stage)
            opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
            model(x[mine], y[mine]).backward()
            ref(x, y).backward()
            for opt in opts:
                opt.step(), opt.zero_grad()
            model.layers[2].load_state_dict(head.state_dict())
            ref.layers[2].load_state_dict(head.state_dict())
            try:
                got[f"stage{stage}"] = (mean_over_ranks(model(x[mine], y[mine])), ref(x, y).item())
            except Exception as e:  # dynamo wraps what a backend raises
                got[f"stage{stage}"] = str(e)
            with zerofx.CollectiveCounter() as comm:  # a load into a module over three Linears
                model.layers.load_state_dict(ref.layers.state_dict())
            got[f"gathers_stage{stage}"] = comm.calls["all_gather"]

            def refuse(*_):
                raise ValueError("a checkpoint of another version")

            hook = model.layers[1].register_load_state_dict_pre_hook(refuse)
            try:  # a load that raises part-way, then the model's own load of other weights
                model.layers[1].load_state_dict(ref.layers[1].state_dict())
            except ValueError:
                pass
            hook.remove()
            torch.manual_seed(7)
            other = MLP()
            model.load_state_dict(other.state_dict())
            try:
                got[f"after_raise_stage{stage}"] = (mean_over_ranks(model(x[mine], y[mine])), other(x, y).item())
            except Exception as e:
                got[f"after_raise_stage{stage}"] = str(e)
            torch._dynamo.reset()
        return got

    def penalty_outside_forward():
        """A loss that adds an L2 penalty over model.parameters() (the DTensor shards) outside
        forward, at stages 1 and 3: what backward raised (an AOTAutograd internal error before);
        the same penalty over full_tensor() trains as the plain model does."""
        from tests.models import MLP

        got = {}
        gen = torch.Generator().manual_seed(4)
        x, y = torch.randn(4 * world, 16, generator=gen), torch.randn(4 * world, 8, generator=gen)
        mine = slice(4 * rank, 4 * rank + 4)
        for stage in (1, 3):
            torch.manual_seed(0)
            ref = MLP()
            model = zerofx.compile(copy.deepcopy(ref), mesh, stage=stage)
            try:
                (model(x[mine], y[mine]) + 1e-2 * sum(p.pow(2).sum() for p in model.parameters())).backward()
                got[f"stage{stage}"] = "no error"
            except zerofx.ZeroFXError as e:
                got[f"stage{stage}"] = str(e)
            model.zero_grad()
            loss = model(x[mine], y[mine]) + 1e-2 * sum(p.full_tensor().pow(2).sum() for p in model.parameters())
            loss.backward()
            want = ref(x, y) + 1e-2 * sum(p.pow(2).sum() for p in ref.parameters())
            want.backward()
            worst = max(
                (p.grad.to_local() - reference_shard(q.grad, rank, world)).abs().max().item()
                for p, q in zip(model.parameters(), ref.parameters())
            )
            got[f"whole_stage{stage}"] = (mean_over_ranks(loss), want.item(), worst)
            torch._dynamo.reset()
        return got

    def unfrozen_later():
        """A parameter frozen when the model is sharded and unfrozen after a step (a fine-tuning
        schedule) through its module attribute, at stage 1 and inside a no_sync window at stage
        3: the worst difference from the plain model's parameters after three steps, and whether
        the unfrozen one moved. Then a module added after sharding: what the next step raised,
        compiled and uncompiled."""
        from tests.models import MLP

        got = {}
        for stage, accumulate in ((1, 1), (3, 2)):
            torch.manual_seed(0)
            ref = MLP()
            ref.layers[0].weight.requires_grad_(False)
            model = zerofx.compile(copy.deepcopy(ref), mesh, stage=stage)
            opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
            weight = dict(model.named_parameters())["layers.0.weight"]  # the DTensor of shards
            start = weight.to_local().clone()
            gen = torch.Generator().manual_seed(1)
            for step in range(3):
                if step == 1:  # through the module attribute, as users write it: a gathered copy's flag
                    if stage == 1:
                        model.layers[0].weight.requires_grad_(True)
                    else:
                        model.layers[0].weight.requires_grad = True
                    ref.layers[0].weight.requires_grad_(True)
                for k in range(accumulate):
                    x, y = torch.randn(4 * world, 16, generator=gen), torch.randn(4 * world, 8, generator=gen)
                    mine = slice(4 * rank, 4 * rank + 4)
                    with zerofx.no_sync(model) if k < accumulate - 1 else contextlib.nullcontext():
                        (model(x[mine], y[mine]) / accumulate).backward()
                    (ref(x, y) / accumulate).backward()
                for opt in opts:
                    opt.step(), opt.zero_grad()
            worst = max(
                (p.to_local() - reference_shard(q.detach(), rank, world)).abs().max().item()
                for (_, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())
            )
            got[f"stage{stage}"] = (worst, not torch.equal(weight.to_local(), start))
        # a module added after sharding (an adapter): its gradients would stay this rank's own
        model.layers.append(torch.nn.Linear(8, 8))
        try:
            model(x[mine], y[mine]).backward()
            got["added"] = None
        except Exception as e:  # dynamo wraps what a backend raises
            got["added"] = str(e)
        # the same without compiling (zerofx.shard alone): refused by a forward pre-hook
        torch.manual_seed(0)
        eager = zerofx.shard(MLP(), mesh)
        eager.layers.append(torch.nn.Linear(8, 8))
        try:
            eager(x[mine], y[mine]).backward()
            got["added_uncompiled"] = None
        except Exception as e:
            got["added_uncompiled"] = str(e)
        # a reference to a parameter kept outside its module, made before sharding: forward
        # trained the old tensor (no optimizer, no reduction) and the shard never moved
        for compiled in (True, False):
            torch.manual_seed(0)
            kept = _KeptReferences()
            kept = zerofx.compile(kept, mesh) if compiled else zerofx.shard(kept, mesh)
            try:
                kept(x[mine], y[mine]).backward()
                got[f"kept_{compiled}"] = None
            except Exception as e:
                got[f"kept_{compiled}"] = str(e)
        # an encoder and a decoder sharing an embedding, sharded one after the other: the second
        # holds the tensor the first replaced (the tie would break; the refusal blamed hooks)
        torch.manual_seed(0)
        encoder = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
        decoder = torch.nn.Sequential(torch.nn.Embedding(8, 4))
        decoder[0].weight = encoder[0].weight  # tied, as T5's encoder and decoder embeddings
        zerofx.shard(encoder, mesh)
        try:
            zerofx.shard(decoder, mesh)
            got["shared_later"] = None
        except Exception as e:
            got["shared_later"] = str(e)
        return got

    def routed_experts():
        """Ranks whose tokens go to other experts (an MoE that skips unused experts) run other
        graphs: what stage 3 raised on each rank (before this, gloo aborted the process), then
        ``zerofx.testing.verify`` of three stage-1 steps (the reference averages a rank's zero
        gradient for an expert it did not use, as zerofx now does)."""
        from tests.models import routed_experts
        from zerofx.testing import verify

        x, route, y = routed_experts()[1](2 * world, torch.Generator().manual_seed(1))
        mine = slice(2 * rank, 2 * rank + 2)
        raised = {}
        for stage in (3, 2):  # stage 2's forward reads whole copies; its backward reduce-scatters
            torch.manual_seed(0)
            model = zerofx.compile(routed_experts()[0], mesh, stage=stage)
            try:
                model(x[mine], route[mine], y[mine]).backward()
                raised[stage] = None
            except Exception as e:  # dynamo wraps what a graph raises
                raised[stage] = str(e)
            torch._dynamo.reset()
        report = verify(routed_experts, mesh, steps=3, stage=1)
        torch.manual_seed(0)
        uncompiled, _ = routed_experts()
        zerofx.shard(uncompiled, mesh)
        try:
            uncompiled(x[mine], route[mine], y[mine]).backward()
            eager = None
        except zerofx.ZeroFXError as e:
            eager = str(e)
        # a parameter read last in forward on rank 0 only: rank 1's backward went straight to its
        # reduce-scatters, which met rank 0's check of the read (gloo aborted)
        torch.manual_seed(0)
        branchy = zerofx.shard(_ExtraOnSomeRanks(), mesh)
        try:
            branchy(torch.randn(2, 4), rank == 0).backward()
            skipped = None
        except zerofx.ZeroFXError as e:
            skipped = str(e)
        # a read that communicates nothing (stage 2's whole copy, no gradient) on one rank only,
        # as logging does: it must not wait for the other ranks
        whole = zerofx.shard(routed_experts()[0], mesh, stage=2)
        evaluated = zerofx.compile(GPT(GPT_CFG), mesh, stage=2)
        eval_x, eval_y = random_batch(GPT_CFG, 2, torch.Generator().manual_seed(0))
        eager_norm = compiled_eval = None
        if rank == 0:  # and a compiled stage-2 evaluation on rank 0 alone (an inference graph)
            with torch.no_grad():
                eager_norm = float(whole.inp.weight.norm())
                compiled_eval = float(evaluated(eval_x, eval_y))
        dist.barrier()
        return {
            "stage3": raised[3],
            "stage2": raised[2],
            "stage1": report.to_json(),
            "uncompiled": eager,
            "uncompiled_skipped": skipped,
            "rank0_read": eager_norm,
            "rank0_eval": compiled_eval,
        }

    def eager_reads():
        """A loop dynamo runs eagerly inside the compiled call (a data-dependent index in it):
        each layer reads its parameters from eager code (NOTE: reads from eager code inside a
        compiled region, zerofx/sharding.py). Every rank raised torch's "Multiple dispatch
        failed" TypeError once the reads passed dynamo's recompile limit."""
        from tests.models import indexed_loop
        from zerofx.testing import verify

        return {stage: verify(indexed_loop, mesh, steps=2, stage=stage).to_json() for stage in (3, 1)}

    def lockstep_twin():
        """A mesh whose groups cannot take CPU tensors (NCCL's, played here by gloo's answering
        "nccl"): the checks get gloo groups of their own over the same ranks, which compare."""
        import zerofx.runtime.lockstep as lockstep

        real = dist.get_backend
        lockstep.dist.get_backend = lambda group=None: "nccl"
        try:
            lock = lockstep.make_lockstep([mesh])
            again = lockstep.make_lockstep([mesh])  # a second model on the mesh: the same twin
        finally:
            lockstep.dist.get_backend = real
        (twin,) = lock.groups
        lock.check(7, lambda: "the same digest")
        try:
            lock.check(rank, lambda: f"digest {rank}")
            raised = None
        except zerofx.ZeroFXError as e:
            raised = str(e)
        twin_of = twin is not mesh.get_group(0) and dist.get_process_group_ranks(twin) == list(range(world))
        return {
            "twin": twin_of,
            "backend": str(dist.get_backend(twin)),
            "raised": raised,
            "shared": again.groups == [twin],
        }

    def outside_mesh():
        """A mesh over rank 0 alone (torch lets a mesh leave ranks out): zerofx.compile on rank 1
        raised a bare IndexError from deep inside, and the ranks of the mesh went on alone."""
        from torch.distributed.device_mesh import DeviceMesh

        try:
            zerofx.compile(torch.nn.Linear(4, 4), DeviceMesh("cpu", [0]))
        except Exception as e:
            return {"raised": f"{type(e).__name__}: {e}"}
        return {"raised": None}

    def dcp_gathers():
        """torch's DCP state-dict helpers resolve each parameter's name by getattr on its module,
        which zerofx's module attribute answers with the whole parameter, gathered: at stage 3
        get_state_dict gathered the whole model twice, zerofx.checkpoint.save three times and
        load seven, for names alone. The all-gathers of each (one for a read, as the control)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from tests.models import MLP

        torch.manual_seed(0)
        model = zerofx.compile(MLP(), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(3)
        model(torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)).backward()
        opt.step()
        where = f"{folder}/dcp_gathers"
        calls = {}
        for name, fn in (
            ("read", lambda: model.layers[0].weight),
            ("get_state_dict", lambda: get_state_dict(model, opt)),
            ("save", lambda: zerofx.checkpoint.save(where, model, opt)),
            ("load", lambda: zerofx.checkpoint.load(where, model, opt)),
        ):
            with zerofx.CollectiveCounter() as comm:
                fn()
            calls[name] = comm.calls["all_gather"]
        return calls

    attempt("explain", explain)
    attempt("dcp_gathers", dcp_gathers)
    attempt("explain_whole_copies", explain_whole_copies)
    attempt("two_step_pairing", two_step_pairing)
    attempt("eager_sharded", eager_sharded)
    for name in ("regather", "gather", "reduce"):
        attempt(f"disabled_{name}", disabled(name))
    attempt("clip_and_state_dict", clip_and_state_dict)
    attempt("whole_state_dict", whole_state_dict)
    attempt("gathered_copy_writes", gathered_copy_writes)
    attempt("stale_whole_copies", stale_whole_copies)
    attempt("share_memory", share_memory)
    attempt("unfrozen_later", unfrozen_later)
    attempt("submodule_load", submodule_load)
    attempt("penalty_outside_forward", penalty_outside_forward)
    attempt("routed_experts", routed_experts)
    attempt("lockstep_twin", lockstep_twin)
    attempt("eager_reads", eager_reads)
    attempt("ranks_disagree", lambda: ranks_disagree(rank, world, mesh))
    attempt("accumulation_windows", lambda: accumulation_windows(rank, mesh))
    attempt("outside_mesh", outside_mesh)
    return out


def accumulation_windows(rank: int, mesh) -> dict:
    """Per stage, against DDP's arithmetic (the mean of the ranks' gradients): an accumulation
    window abandoned after one no_sync micro-batch and dropped by zero_grad (the model's, and an
    adopted optimizer's) leaves nothing in the next step; a step right after a no_sync backward
    is refused; gradient hooks registered after compile (on the parameter, or through its module
    attribute) run once per reduction, on the reduced gradient, with and without a no_sync window;
    hooks registered before compile are refused."""
    out = {}
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(3)]

    def reference(model: nn.Module, batches: list) -> dict:
        """Each rank's gradient of the model's current (whole) weights, averaged over ranks."""
        ref = nn.Linear(8, 4)
        with torch.no_grad():
            for n, p in model.named_parameters():
                ref.get_parameter(n).copy_(p.full_tensor())
        for x in batches:
            ref(x).pow(2).mean().backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        return {n: p.grad for n, p in ref.named_parameters()}

    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = zerofx.compile(nn.Linear(8, 4), mesh, stage=stage)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dropped = {}
        for how, zero in (("model", lambda: model.zero_grad()), ("optimizer", lambda: opt.zero_grad())):
            with model.no_sync():
                model(xs[0]).pow(2).mean().backward()
            zero()
            want = reference(model, [xs[1]])
            model(xs[1]).pow(2).mean().backward()
            got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            dropped[how] = max((got[n] - g).abs().max().item() for n, g in want.items())
            opt.step()  # (the optimizer's zero_grad drops the window from its first step on)
            opt.zero_grad()
        with model.no_sync():
            model(xs[2]).pow(2).mean().backward()
        try:
            opt.step()
            refused = "no error"
        except zerofx.ZeroFXError as e:
            refused = str(e)
        opt.zero_grad()
        calls = []
        for name, p in model.named_parameters():
            # the weight's through its module attribute, as users write it (a copy gathered for
            # that read: its hooks were dropped, silently, or torch's non-leaf error)
            target = model.weight if name == "weight" else p
            target.register_hook(lambda g: g * 0.5)
            target.register_post_accumulate_grad_hook(lambda p, name=name: calls.append(name))
        hooked = {}
        for window in (False, True):
            calls.clear()
            batches = [xs[0], xs[1]] if window else [xs[1]]
            want = reference(model, batches)
            for i, x in enumerate(batches):
                with model.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                    model(x).pow(2).mean().backward()
            got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            err = max((got[n] - 0.5 * g).abs().max().item() for n, g in want.items())
            hooked[f"window={window}"] = {"err": err, "calls": sorted(calls)}
            model.zero_grad()
        torch._dynamo.reset()
        out[f"stage{stage}"] = {"dropped": dropped, "refused": refused, "hooked": hooked}
    for label, hooked in (("hooked_before", True), ("hooked_on_rank0", rank == 0)):  # (wandb.watch on rank 0)
        early = nn.Linear(8, 4)
        if hooked:
            early.weight.register_hook(lambda g: g)
        try:
            zerofx.compile(early, mesh)
            out[label] = "no error"
        except zerofx.ZeroFXError as e:
            out[label] = str(e)
    return out


def ranks_disagree(rank: int, world: int, mesh) -> dict:
    """zerofx.compile where rank 1's model or options differ from rank 0's: what each rank raised
    (none may hang: before zerofx.agreement these crashed gloo or waited forever), then options
    a rank may set for itself (a host memory cap per machine), which must train."""
    import dataclasses

    from zerofx.errors import ZeroFXError

    odd = rank == 1
    cases = {
        "width": (dataclasses.replace(GPT_CFG, d_model=48) if odd else GPT_CFG, {}),
        "depth": (dataclasses.replace(GPT_CFG, n_layer=3) if odd else GPT_CFG, {}),
        "stage": (GPT_CFG, {"stage": 2} if odd else {}),
        "frozen": (GPT_CFG, {}),
        "host_memory_cap": (GPT_CFG, {"host_memory_cap": 2**30 * (1 + rank)}),
    }
    raised = {}
    for name, (cfg, options) in cases.items():
        torch.manual_seed(0)
        model = GPT(cfg)
        if name == "frozen" and odd:
            model.wte.weight.requires_grad_(False)
        try:
            compiled = zerofx.compile(model, mesh, **options)
            x, y = random_batch(GPT_CFG, 2, torch.Generator().manual_seed(rank))
            compiled(x, y).backward()
            raised[name] = None
        except ZeroFXError as e:
            raised[name] = str(e)
    return raised


def fail_on_rank_one(rank: int, world: int) -> None:
    """Rank 1 raises before a collective its peer is blocked in: the harness must not hang."""
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()


def grid_rank_differs(rank: int, world: int) -> tuple[str | None, str | None]:
    """On a 2x2 (replicate, shard) mesh rank 3's model is wider: what each rank raised. Rank 0
    shares no mesh group with rank 3, so it can only learn of the difference through the check's
    second round (and would wait forever in its first collective if rank 3's group raised alone).
    Then the same models, but rank 3 routes its tokens to other experts than every other rank:
    what each rank's first step raised (zerofx/runtime/lockstep.py, the same two rounds)."""
    import dataclasses

    from tests.models import RoutedExperts
    from zerofx.errors import ZeroFXError

    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(GPT_CFG, d_model=48) if rank == 3 else GPT_CFG)
    try:
        zerofx.compile(model, mesh)
        differs = None
    except ZeroFXError as e:
        differs = str(e)
    torch.manual_seed(0)
    experts = zerofx.compile(RoutedExperts(experts=4), mesh)
    route = torch.tensor([2, 3] if rank == 3 else [0, 1])
    try:
        experts(torch.randn(2, 8), route, torch.randn(2)).backward()
        routed = None
    except Exception as e:  # dynamo wraps what a graph raises
        routed = str(e)
    # one compiled frame reads two models: `pairs` sharded over ranks {0, 1} and {2, 3}, `whole`
    # over all four, whose second layer ranks 2 and 3 skip; odd ranks call `whole` first, so the
    # two ranks of a pair list the two models in other orders (each rank once took the first
    # model's groups alone; in input order, each pair's ranks would wait in different groups)
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    torch.manual_seed(0)
    pairs = zerofx.shard(torch.nn.Linear(8, 8), grid["shard"])
    whole = zerofx.shard(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)), init_device_mesh("cpu", (4,))
    )

    def both(x):
        h = pairs(whole[0](x)) if rank % 2 else whole[0](pairs(x))  # odd ranks: whole first
        return (whole[1](h) if rank < 2 else h).square().mean()

    try:
        torch.compile(both, backend="zerofx")(torch.randn(2, 8)).backward()
        two_models = None
    except Exception as e:
        two_models = str(e)
    return differs, routed, two_models


def gathered_after_changes(rank: int, world: int) -> dict:
    """Forwards inside ``zerofx.gathered`` after an optimizer step and after a load_state_dict
    there, at stages 1-3: the output, or the error, against the model's own output after the
    context exits (the values the shards hold)."""
    from zerofx import ZeroFXError

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def inside(model, change):
        with zerofx.gathered(model), torch.no_grad():
            model(x)
            change()
            try:
                seen = model(x)
            except ZeroFXError as e:
                return str(e)
        with torch.no_grad():
            return torch.equal(seen, model(x))

    out = {}
    for stage in (1, 2, 3):
        torch._dynamo.reset()
        model = zerofx.compile(build(), mesh, stage=stage)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        model(x).sum().backward()
        out[f"step_{stage}"] = inside(model, opt.step)
        other = build()
        with torch.no_grad():
            for p in other.parameters():
                p.mul_(-3.0)
        out[f"load_{stage}"] = inside(model, lambda: model.load_state_dict(other.state_dict()))
        with zerofx.gathered(model), torch.no_grad():  # entered again: the new values
            out[f"again_{stage}"] = torch.equal(model(x), other(x))
    return out
