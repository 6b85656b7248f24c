"""The checkpoint pass, its plan and its explanations, the offload ops, and bad input, in one process.

Joint graphs are captured from real models (one gloo rank) with the benchmark's capture helper,
so the pass sees exactly what the backend gives it.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import operator
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import zerofx
from benchmarks.checkpoint_vs_torch import capture_joint, clone, torch_partition
from tests.models import GPT_CFG, GraphBreakNet
from zerofx import ZeroFXError
from zerofx.measure.allocations import rss_bytes
from zerofx.models import GPT, random_batch
from zerofx.passes.checkpoint import checkpoint_pass, partition_by_plan
from zerofx.passes.cost_model import saved_activation_bytes, saved_values
from zerofx.passes.pipeline import PassContext
from zerofx.runtime.offload_store import DiskStore
from zerofx.runtime.params import runtime_of


@pytest.fixture(scope="module")
def gpt_joint(one_rank):
    torch.manual_seed(0)
    model = zerofx.shard(GPT(GPT_CFG), one_rank)
    return capture_joint(model, random_batch(GPT_CFG, 2, torch.Generator().manual_seed(0)))


def plan(joint_and_n, **options):
    """Run the checkpoint pass on a copy of the joint graph; return (graph, messages, plan dict)."""
    joint, n, kwargs = joint_and_n
    gm = clone(joint)
    ctx = PassContext("test", "joint", zerofx.Options(**options), num_fwd_outputs=n)
    gm = checkpoint_pass(gm, ctx)
    return gm, ctx.messages, gm.meta.get("zerofx_activation_plan")


class DropoutNet(nn.Module):
    """A random op: its output (the mask) can never be recomputed, so some bytes must stay."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 4)

    def forward(self, x, y):
        return F.mse_loss(self.b(F.dropout(torch.relu(self.a(x)), p=0.5, training=True)), y)


# -- the plan ------------------------------------------------------------------------------------


def test_budgets_bound_the_plan_and_recompute_grows_as_they_shrink(gpt_joint):
    _, _, full = plan(gpt_joint, activation_budget=1.0)
    unconstrained = full["unconstrained_bytes"]
    assert full["resident_bytes"] == unconstrained and full["recompute_flops"] == 0
    previous = 0
    for fraction in (0.75, 0.5, 0.25, 0.1):
        _, _, p = plan(gpt_joint, activation_budget=fraction)
        assert p["resident_bytes"] <= fraction * unconstrained
        assert p["recompute_flops"] >= previous
        previous = p["recompute_flops"]
    _, _, in_bytes = plan(gpt_joint, activation_budget=20_000)  # an int budget is bytes
    assert in_bytes["resident_bytes"] <= 20_000 and in_bytes["budget_bytes"] == 20_000


def test_default_plan_recomputes_norms_and_activations_never_matmuls_or_attention(gpt_joint):
    """No option given: the min-cut at CHEAP_PRICE (NOTE: cheap recompute) rebuilds GELU and
    LayerNorm outputs in the backward and keeps every matmul and attention output; it saves
    fewer bytes than torch's partitioner on the same joint graph."""
    joint, n, kwargs = gpt_joint
    gm, messages, p = plan(gpt_joint)
    assert p is not None and p["budget_bytes"] is None
    ops = {node.name: getattr(node.target, "__name__", str(node.target)) for node in gm.graph.nodes}
    recomputed = {ops[name].split(".")[0] for name in p["recomputed"]}
    assert {"gelu", "native_layer_norm"} <= recomputed, recomputed
    expensive = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu"}
    assert not recomputed & expensive
    assert p["recompute_flops"] > 0 and p["resident_bytes"] < p["unconstrained_bytes"]
    fw, _ = torch_partition(joint, n, kwargs, 1.0)
    assert p["resident_bytes"] < saved_activation_bytes(fw, n)
    assert any(m.startswith("cheap recompute:") for m in messages)
    # the partition saves exactly the plan, as under a budget
    fw, _ = partition_by_plan(gm, n)
    assert {v.name for v in saved_values(fw, n)} == set(p["saved"])


def test_default_plan_trains_bit_for_bit_like_torch_partitioner(one_rank):
    """Recompute runs the same ops on the same values: losses and gradients are identical with
    and without it (disable_passes=("checkpoint",) hands the cut back to torch)."""
    torch.manual_seed(0)
    base = GPT(GPT_CFG)
    models = {}
    for name, options in (("cheap", {}), ("torch", {"disable_passes": ("checkpoint",)})):
        models[name] = zerofx.compile(copy.deepcopy(base), one_rank, **options)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = random_batch(GPT_CFG, 2, gen)
        losses = {name: m(x, y) for name, m in models.items()}
        for loss in losses.values():
            loss.backward()
        assert torch.equal(losses["cheap"], losses["torch"])
        for a, b in zip(models["cheap"].parameters(), models["torch"].parameters()):
            assert torch.equal(a.grad, b.grad)
            a.grad = b.grad = None
    torch._dynamo.reset()


class ScalesItsInput(nn.Module):
    """A forward that overwrites its input (``x.mul_(s)``) and reads it before and after."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        y = self.b(torch.tanh(x))  # reads x before the write
        x.mul_(2.0)
        return (self.a(torch.tanh(x)) * y).sum()  # and after it


@pytest.mark.parametrize("options", [{}, {"activation_budget": 0.6}, {"checkpoint": "full"}])
def test_an_input_the_forward_overwrites_is_never_read_again_by_a_recompute(one_rank, options):
    """The backward runs after the forward's write to its input (AOTAutograd keeps the input
    mutation as ``copy_(x, x * 2)`` in the graph): an op recomputed from that input would read
    the new value (it scaled x twice in a.weight's gradient), so such ops are saved instead.
    Gradients equal eager's."""
    torch.manual_seed(0)
    eager = ScalesItsInput()
    model = zerofx.compile(copy.deepcopy(eager), one_rank, **options)
    for step in range(2):
        x = torch.linspace(-1, 1, 8).reshape(2, 4) + step
        eager(x.clone()).backward()
        xz = x.clone()
        model(xz).backward()
        torch.testing.assert_close(xz, x * 2, rtol=0, atol=0)  # the write itself still happens
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
            p.grad = q.grad = None
    torch._dynamo.reset()


def test_partition_saves_exactly_the_plan(gpt_joint):
    gm, _, p = plan(gpt_joint, activation_budget=0.4)
    fw, bw = partition_by_plan(gm, gpt_joint[1])
    assert {n.name for n in saved_values(fw, gpt_joint[1])} == set(p["saved"])
    assert saved_activation_bytes(fw, gpt_joint[1]) == p["resident_bytes"]
    # the forward nodes the backward runs are the plan's recomputed ones (views included)
    forward_in_backward = {
        n.name for n in bw.graph.nodes if n.name in {m.name for m in fw.graph.nodes} and n.op == "call_function"
    }
    assert forward_in_backward <= set(p["recomputed"])
    tags = {n.name: n.meta.get("recompute") for n in gm.graph.nodes}
    untagged = [(name, tags[name]) for name in p["recomputed"] if tags[name] != CheckpointPolicy.MUST_RECOMPUTE]
    assert not untagged


def test_report_lists_every_value_with_bytes_and_reason(gpt_joint):
    _, messages, p = plan(gpt_joint, activation_budget=0.5)
    text = "\n".join(messages)
    assert re.search(r"predicted activation peak .*: before [\d.]+ KiB, after [\d.]+ KiB", text)
    assert re.search(r"minimum feasible budget", text)
    for kind in ("saved", "recomputed"):
        for name in p[kind]:
            line = next(m for m in messages if re.match(rf"\s+{kind}\s+{name}\s", m))
            assert re.search(r"\d+(\.\d)? (B|KiB|MiB)\s+\S", line), line  # bytes, then a reason


def test_budget_below_any_schedule_names_the_minimum(one_rank):
    torch.manual_seed(0)
    model = zerofx.shard(DropoutNet(), one_rank)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    joint = capture_joint(model, (x, y))
    with pytest.raises(
        ZeroFXError,
        match=r"below what any schedule can meet: the minimum feasible budget for "
        r"this graph is (\d+) B",
    ) as info:
        plan(joint, activation_budget=1)
    minimum = int(re.search(r"budget for this graph is (\d+) B", str(info.value)).group(1))
    assert minimum > 0 and "random op" in str(info.value)
    _, _, p = plan(joint, activation_budget=minimum)  # exactly the minimum is feasible
    assert p["resident_bytes"] == minimum


def test_full_policy_saves_block_boundaries_and_recomputes_inside(gpt_joint):
    gm, messages, p = plan(gpt_joint, checkpoint="full")
    text = "\n".join(messages)
    assert "boundary of checkpointed blocks.0" in text
    boundaries = [m.split()[1] for m in messages if "boundary of checkpointed" in m and m.strip().startswith("saved")]
    assert boundaries, text
    recomputed_mm = [m for m in messages if m.strip().startswith("recomputed") and "inside checkpointed blocks." in m]
    assert recomputed_mm  # everything inside a block that the backward needs is recomputed
    # the two blocks' internal matmuls are not saved
    stacks = {n.name: str(n.meta.get("nn_module_stack", "")) for n in gm.graph.nodes}
    assert not [s for s in p["saved"] if "blocks.1.fc" in stacks.get(s, "") and s.startswith("addmm")]


@pytest.mark.parametrize("policy", [{"checkpoint": "full"}, {"checkpoint_modules": ("blocks.*",)}])
def test_checkpointed_blocks_with_dropout_save_its_outputs_and_train_like_no_checkpointing(one_rank, policy):
    """A dropout inside a checkpointed block is never drawn again: its output (a getitem of
    ``native_dropout``) is saved with the op it unpacks, where tagging it for recompute left
    the cut no solution. The rest of each block is still recomputed; with the same seeds (the
    same masks) two steps' losses and gradients equal those without the checkpoint pass, bit
    for bit."""
    cfg = dataclasses.replace(GPT_CFG, dropout=0.25)
    torch.manual_seed(0)
    base = GPT(cfg)
    batch = random_batch(cfg, 2, torch.Generator().manual_seed(0))
    gm, messages, p = plan(capture_joint(zerofx.shard(copy.deepcopy(base), one_rank), batch), **policy)
    dropped = [n.name for n in gm.graph.nodes if n.target is operator.getitem and "dropout" in n.args[0].name]
    assert dropped and not set(dropped) & set(p["recomputed"]), (dropped, p["recomputed"])
    kept = [name for name in dropped if name in p["saved"]]  # the rest only the forward reads
    assert kept
    for name in kept:
        line = next(m for m in messages if re.match(rf"\s+saved\s+{name}\s", m))
        assert "random op" in line, line
    assert any("inside checkpointed blocks." in m for m in messages if m.strip().startswith("recomputed"))

    models = {
        "policy": zerofx.compile(copy.deepcopy(base), one_rank, **policy),
        "torch": zerofx.compile(copy.deepcopy(base), one_rank, disable_passes=("checkpoint",)),
    }
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        x, y = random_batch(cfg, 2, gen)
        losses = {}
        for name, m in models.items():
            torch.manual_seed(100 + step)
            losses[name] = m(x, y)
            losses[name].backward()
        assert torch.equal(losses["policy"], losses["torch"])
        for a, b in zip(models["policy"].parameters(), models["torch"].parameters()):
            assert torch.equal(a.grad, b.grad)
            a.grad = b.grad = None
    torch._dynamo.reset()


def test_module_and_op_policies(gpt_joint):
    _, messages, p = plan(gpt_joint, checkpoint_modules=("blocks.1",))
    assert any("inside checkpointed blocks.1" in m for m in messages)
    assert not any("inside checkpointed blocks.0" in m for m in messages)
    gm, messages, p = plan(gpt_joint, checkpoint_save_ops=("aten.mm", "addmm"))
    nodes = {n.name: n for n in gm.graph.nodes}
    saved_ops = {str(nodes[s].target) for s in p["saved"] if nodes[s].op == "call_function"}
    assert saved_ops <= {"aten.mm.default", "aten.addmm.default"}, saved_ops
    assert any(str(nodes[r].target) == "aten.gelu.default" for r in p["recomputed"])


class CheckpointedGPT(GPT):
    """The test GPT calling torch.utils.checkpoint on each block itself, as many training
    scripts do."""

    def forward(self, tokens, targets):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return F.cross_entropy(self.lm_head(self.ln_f(x)).flatten(0, 1), targets.flatten())


def test_checkpoint_calls_in_the_model_are_recomputed_like_checkpointed_modules(one_rank, gpt_joint):
    """With no option given, a model's own torch.utils.checkpoint calls are regions the plan
    recomputes (NOTE: checkpoint calls in the model): the plan used to treat their tags as
    hints and saved what the model without the calls saves, undoing the user's checkpointing."""
    torch.manual_seed(0)
    model = zerofx.shard(CheckpointedGPT(GPT_CFG), one_rank)
    joint = capture_joint(model, random_batch(GPT_CFG, 2, torch.Generator().manual_seed(0)))
    gm, _, p = plan(joint)
    _, _, plain = plan(gpt_joint)
    _, _, as_modules = plan(gpt_joint, checkpoint_modules=("blocks.*",))
    targets = {n.name: str(n.target) for n in gm.graph.nodes}
    # the blocks' matmuls, which a plan without the calls keeps, are recomputed
    assert any("addmm" in targets[r] for r in p["recomputed"]), p["recomputed"]
    assert p["resident_bytes"] < 0.5 * plain["resident_bytes"], (p["resident_bytes"], plain["resident_bytes"])
    assert p["resident_bytes"] == as_modules["resident_bytes"]  # the same cut as checkpointing the blocks


def test_module_policies_plan_the_rest_as_the_default_plan_does(gpt_joint):
    """Outside the checkpointed modules (no budget) the plan recomputes what is cheap, as with
    no option (NOTE: cheap recompute): the final LayerNorm's output and blocks.0's GELU are
    rebuilt in the backward, not saved."""
    gm, _, p = plan(gpt_joint, checkpoint_modules=("blocks.1",))
    stacks = {n.name: str(n.meta.get("nn_module_stack", "")) for n in gm.graph.nodes}
    targets = {n.name: str(n.target) for n in gm.graph.nodes}
    recomputed = set(p["recomputed"])
    assert any("ln_f" in stacks[r] and "layer_norm" in targets[r] for r in recomputed), recomputed
    assert any("blocks.0" in stacks[r] and "gelu" in targets[r] for r in recomputed), recomputed


def test_offload_marks_travel_to_both_graphs(gpt_joint, tmp_path):
    gm, messages, p = plan(gpt_joint, activation_budget=0.3, offload_activations="disk", offload_dir=str(tmp_path))
    assert p["offloaded"] and p["resident_bytes"] <= 0.3 * p["unconstrained_bytes"]
    assert any(m.strip().startswith("offloaded") and "to disk" in m for m in messages)
    fw, bw = partition_by_plan(gm, gpt_joint[1])
    marked_fw = {n.name for n in saved_values(fw, gpt_joint[1]) if n.meta.get("zerofx_offload") == "disk"}
    marked_bw = {n.name for n in bw.graph.nodes if n.op == "placeholder" and n.meta.get("zerofx_offload")}
    assert marked_fw == set(p["offloaded"]) == marked_bw


# -- the offload tiers ---------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_offload_round_trip(tmp_path, tier):
    x = torch.randn(64, 33).t()  # non-contiguous: the layout must come back too
    parked = torch.ops.zerofx.offload(x, tier, str(tmp_path))
    assert parked.device.type == "cpu" and parked.is_contiguous()
    started = torch.ops.zerofx.reload(parked, tier, x.device, list(x.shape), list(x.stride()))
    back = torch.ops.zerofx.reload_wait(started)
    assert back.stride() == x.stride() and torch.equal(back, x)
    if tier == "disk":
        assert os.listdir(tmp_path) == []  # the file is unlinked at once; it lives while mapped


def test_a_full_disk_parking_an_activation_is_an_error_naming_the_folder(tmp_path, monkeypatch):
    """The write runs on the I/O thread; a full disk surfaced as a bare OSError where the
    backward waits for the reload. It is a ZeroFXError naming the folder and the way out."""
    from zerofx.ir import offload_ops

    def full(fd, data, offset=0):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(offload_ops, "_pwrite_all", full)
    x = torch.randn(16, 8)
    parked = torch.ops.zerofx.offload(x, "disk", str(tmp_path))
    started = torch.ops.zerofx.reload(parked, "disk", x.device, list(x.shape), list(x.stride()))
    with pytest.raises(ZeroFXError, match=rf"offload folder '{tmp_path}': no room to park an activation of 512 bytes"):
        torch.ops.zerofx.reload_wait(started)


def test_disk_store_pages_out(tmp_path):
    store = DiskStore(str(tmp_path))
    t = torch.randn(8 * 2**20 // 4)  # 8 MiB
    expected = t.clone()
    store.adopt(t)
    before = rss_bytes()
    assert torch.equal(t, expected)  # reading pages the file back in
    assert rss_bytes() - before > 6 * 2**20
    store.page_out(t)
    assert rss_bytes() - before < 2 * 2**20
    t.mul_(2)  # writes go to the file
    store.page_out(t)
    assert torch.equal(t, expected * 2)


_FILE_LIMIT_SCRIPT = """
import os, resource, sys, torch
from zerofx.errors import ZeroFXError
from zerofx.runtime.offload_store import DiskStore

open_now = len(os.listdir("/proc/self/fd"))
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
limit = open_now + 16
assert hard == resource.RLIM_INFINITY or hard > limit + 200, hard
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
store = DiskStore(sys.argv[1])
kept = [torch.full((8,), float(i)) for i in range(40)]  # two descriptors each: past the soft limit
for t in kept:
    store.adopt(t)
assert all(torch.equal(t, torch.full((8,), float(i))) for i, t in enumerate(kept))
assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard, "the soft limit was raised to the hard one"
at = len(os.listdir("/proc/self/fd")) + 6
resource.setrlimit(resource.RLIMIT_NOFILE, (at, at))  # now the hard limit too: nothing left to raise
try:
    for i in range(10):
        kept.append(torch.zeros(8))
        store.adopt(kept[-1])
except ZeroFXError as e:
    print("refused:", e)
"""


def _refused_at_the_file_limit(script: str, tmp_path) -> str:
    """Run ``script`` in a subprocess (a lowered hard limit is for good); it must end at a
    ZeroFXError naming ``ulimit -n``. Its stdout."""
    run = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),  # not the repository's root, whose zerofx/ lacks passes/ and codegen/ (tox installs)
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "refused: disk offload: this process has" in run.stdout and "ulimit -n" in run.stdout, run.stdout
    return run.stdout


def test_disk_offload_past_the_open_file_limit_raises_it_or_says_so(tmp_path):
    """Disk offload keeps two descriptors open per tensor: past the soft limit of open files
    (often 1024: a few hundred offloaded parameters) it raised a bare OSError (EMFILE) inside
    the first optimizer step. The store raises the soft limit to the hard one, and past the
    hard one says which limit, in a ZeroFXError. (A subprocess: a lowered hard limit is for
    good.)"""
    _refused_at_the_file_limit(_FILE_LIMIT_SCRIPT, tmp_path)


_PARK_AT_LIMIT_SCRIPT = """
import os, resource, sys, torch
import zerofx  # registers torch.ops.zerofx
from zerofx.errors import ZeroFXError

directory = sys.argv[1]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
limit = len(os.listdir("/proc/self/fd")) + 8
assert hard == resource.RLIM_INFINITY or hard > limit + 200, hard
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
filler = []
try:
    while True:
        filler.append(os.open(directory, os.O_RDONLY))
except OSError:
    pass
os.close(filler.pop())  # one descriptor left: the parked file's; its map needs another
x = torch.arange(12.0).view(3, 4)
parked = torch.ops.zerofx.offload(x, "disk", directory)
back = torch.ops.zerofx.reload_wait(torch.ops.zerofx.reload(parked, "disk", x.device, [3, 4], [4, 1]))
assert torch.equal(back, x), back
assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard, "the soft limit was raised to the hard one"
at = limit + 8
resource.setrlimit(resource.RLIMIT_NOFILE, (at, at))  # the hard limit too: nothing left to raise
try:
    while True:
        filler.append(os.open(directory, os.O_RDONLY))
except OSError:
    pass
os.close(filler.pop())  # again one descriptor left
try:
    torch.ops.zerofx.offload(x, "disk", directory)
except ZeroFXError as e:
    print("refused:", e)
filler.append(os.open(directory, os.O_RDONLY))  # the parked file's descriptor was closed
print("left open: none")
"""


def test_parking_an_activation_at_the_open_file_limit_raises_it_or_says_so(tmp_path):
    """Parking an activation on disk opens its file, and ``torch.from_file`` opens it once more
    to map it: at the limit of open files that second open raised torch's bare RuntimeError
    ("Too many open files"). It is handled as the first is: the soft limit is raised to the
    hard one, and past that a ZeroFXError names the limit, leaving no descriptor behind."""
    stdout = _refused_at_the_file_limit(_PARK_AT_LIMIT_SCRIPT, tmp_path)
    assert "left open: none" in stdout, stdout


def test_disk_store_keeps_a_permuted_shard_in_storage_order(tmp_path):
    """A shard split along dim 1 is its contiguous rows seen permuted (zerofx/ir/layout.py, NOTE:
    the sharded dim): the file holds its storage as it is, and the tensor keeps its strides. A
    strided slice (not dense) is refused."""
    store = DiskStore(str(tmp_path))
    rows = torch.randn(3, 2, 5)
    shard = rows.movedim(0, 1)  # [2, 3, 5], strides (5, 10, 1)
    expected, strides = shard.clone(), shard.stride()
    store.adopt(shard)
    assert shard in store and shard.stride() == strides and torch.equal(shard, expected)
    shard.mul_(2)
    store.page_out(shard)
    assert torch.equal(shard, expected * 2)
    with pytest.raises(ZeroFXError, match="disk offload keeps dense CPU tensors; got a strided tensor"):
        store.adopt(torch.randn(4, 6)[:, ::2])


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        ({"activation_budget": 1.5}, "must be in \\(0, 1\\]"),
        ({"activation_budget": "half"}, "fraction .* or bytes"),
        ({"activation_budget": True}, "fraction .* or bytes"),
        ({"checkpoint": "partial"}, "checkpoint='partial'"),
        ({"checkpoint_save_ops": ("aten.not_an_op",)}, "no op named 'aten.not_an_op'"),
        ({"offload_activations": "nvme"}, "offload_activations='nvme'"),
        ({"offload_optimizer": "auto"}, "set host_memory_cap"),
        ({"host_memory_cap": -1}, "positive number of bytes"),
    ],
)
def test_bad_memory_options_are_clear_errors(options, message):
    with pytest.raises(ZeroFXError, match=message):
        zerofx.Options(**options)


def test_checkpoint_module_patterns_that_match_no_module_are_errors_at_compile(one_rank):
    """A misspelt ``checkpoint_modules`` pattern used to checkpoint nothing, silently: it is an
    error naming it, the closest module name and some of the model's, before the model is
    sharded; explain checks the same."""
    model = GPT(GPT_CFG)
    message = r"checkpoint_modules: no module of GPT matches 'block\.\*' \(did you mean 'blocks\.\d'\?\), nor 'hed'"
    with pytest.raises(ZeroFXError, match=message) as info:
        zerofx.compile(model, one_rank, checkpoint_modules=("blocks.*", "block.*", "hed"))
    assert "'hed' (did you mean 'lm_head'?)" in str(info.value)
    assert "here wte, wpe, blocks, ln_f, lm_head, blocks.0 and" in str(info.value)
    assert runtime_of(model) is None  # refused before sharding
    with pytest.raises(ZeroFXError, match="no module of GPT matches 'nomatch'"):
        zerofx.explain(model, *random_batch(GPT_CFG, 2, torch.Generator()), checkpoint_modules=("nomatch",))
    torch._dynamo.reset()


def test_a_pattern_naming_only_the_layer_container_is_an_error(one_rank):
    """``checkpoint_modules=("blocks",)`` matched the ModuleList in named_modules(), passed the
    check, and checkpointed nothing (a ModuleList is never called, so no graph's module paths
    hold it): the peak stayed the default's. It is an error saying to name the members."""
    model = GPT(GPT_CFG)
    with pytest.raises(ZeroFXError, match=r"'blocks' \(use 'blocks\.\*' for its members\) names only a ModuleList"):
        zerofx.compile(model, one_rank, checkpoint_modules=("blocks",))
    assert runtime_of(model) is None

    class Stack(torch.nn.ModuleList):  # a container with a forward of its own is called: allowed
        def forward(self, x):
            for layer in self:
                x = layer(x)
            return x

    from zerofx.passes.checkpoint import check_module_patterns

    holder = torch.nn.Module()
    holder.blocks = Stack([torch.nn.Linear(2, 2)])
    check_module_patterns(("blocks",), holder)


def test_plan_checks_checkpoint_module_patterns_against_the_model_it_plans(tmp_path):
    """``zerofx plan --checkpoint-modules`` fails on a pattern matching no module (exit 1, the
    message); a pattern naming a block deeper than the shallow traces have passes, and the model
    is traced whole (planned by depth from traces of 3 and 4 blocks, which have no block 4, the
    plan checkpointed nothing). In subprocesses: the planner refuses to run beside this
    module's process group."""
    import subprocess
    import sys

    (tmp_path / "mymodels.py").write_text(
        "from zerofx.models import GPT, GPTConfig\n"
        "def build(layers=2):\n"
        "    return GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=layers, n_head=2, d_model=16))\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "zerofx.cli", "plan", "mymodels:build", "--mesh", "2", "--device", "cpu",
         "--checkpoint-modules", "blocks.*,nomatch.*"],
        capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
    )  # fmt: skip
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "zerofx plan: option checkpoint_modules: no module of GPT matches 'nomatch.*'" in run.stderr, run.stderr
    deep = (
        "import zerofx, mymodels\n"
        "p = zerofx.plan(mymodels.build, (2,), device='cpu', depth_kwarg='layers', factory_kwargs={'layers': 5},\n"
        "                checkpoint_modules=('blocks.4',))\n"
        "print('traced', p.traced_depths)\n"
    )
    run = subprocess.run([sys.executable, "-c", deep], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert run.returncode == 0 and "traced None" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]


def test_unwritable_offload_dir_fails_at_compile(one_rank, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    bad = str(blocker / "offload")  # even root cannot make a folder inside a file
    for key in ("offload_activations", "offload_optimizer"):
        model = GraphBreakNet()
        with pytest.raises(ZeroFXError, match=r"offload_dir=.*a-file/offload.* is not a writable folder"):
            zerofx.compile(model, one_rank, **{key: "disk", "offload_dir": bad})
    # the backend entry point checks when the options are built, before anything is traced
    with pytest.raises(Exception, match="not a writable folder"):
        torch.compile(nn.Linear(2, 2), backend="zerofx", options={"offload_activations": "disk", "offload_dir": bad})(
            torch.randn(1, 2)
        )
    torch._dynamo.reset()


def test_offload_optimizer_needs_a_model_compiled_for_it(one_rank):
    model = zerofx.compile(GraphBreakNet(), one_rank)
    with pytest.raises(ZeroFXError, match="offload_optimizer="):
        zerofx.offload_optimizer(torch.optim.AdamW(model.parameters()))
    torch._dynamo.reset()


def test_offload_optimizer_refuses_fused_kernels_without_a_dtensor_strategy(one_rank, tmp_path):
    model = zerofx.compile(GraphBreakNet(), one_rank, offload_optimizer="disk", offload_dir=str(tmp_path))
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True), lambda ps: torch.optim.Adagrad(ps, fused=True)):
        with pytest.raises(ZeroFXError, match=r"\(fused=True\) has no DTensor kernel"):
            zerofx.offload_optimizer(make(model.parameters()))
    zerofx.offload_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))  # not fused: fine
    torch._dynamo.reset()


def test_disk_offloaded_optimizer_matches_in_memory_exactly(one_rank, tmp_path):
    torch.manual_seed(0)
    model = GraphBreakNet()
    ref = copy.deepcopy(model)
    zerofx.compile(model, one_rank, offload_optimizer="auto", host_memory_cap=1024, offload_dir=str(tmp_path))
    assert runtime_of(model).state_tier == "disk"  # params + Adam state exceed 1 KiB: auto picks disk
    opt = zerofx.offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(4, 12, generator=gen), torch.randn(4, 4, generator=gen)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x, y).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    for p in model.parameters():
        for value in opt.state[p].values():
            if value.dim() > 0:
                assert (
                    value.untyped_storage().data_ptr() != 0 and value in zerofx.runtime.offload_store.state_store(p)[1]
                )
    torch._dynamo.reset()
