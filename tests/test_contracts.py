"""Pass contracts: declared by each pass module, checked when the pipeline is built, documented
once (docs/architecture.md), and visible in the graphs (provenance)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import zerofx  # noqa: F401  (registers the marker ops)
from zerofx.dump import Recorder
from zerofx.errors import ZeroFXError
from zerofx.ir.meta import KEYS, OFFLOAD_TIER, PASS, ROLE
from zerofx.passes.contract import GRAPH_KINDS, Pass, PassContext
from zerofx.passes.pipeline import PASS_NAMES, check_contracts, default_pipeline, run_pipeline

ROOT = Path(__file__).resolve().parents[1]


def _noop(gm, ctx):
    return gm


def test_the_pipeline_is_built_from_each_pass_modules_declaration():
    passes = default_pipeline()
    assert tuple(p.name for p in passes) == PASS_NAMES
    for p in passes:
        module = __import__(p.fn.__module__, fromlist=["PASS"])
        assert module.PASS is p, p.name  # the declaration lives with the pass
        assert set(p.kinds) <= set(GRAPH_KINDS) and p.doc


def test_a_pass_reading_a_key_no_earlier_pass_writes_is_refused():
    reader = Pass("reader", _noop, ("forward",), reads=(OFFLOAD_TIER,))
    writer = Pass("writer", _noop, ("joint",), writes=(OFFLOAD_TIER,))
    check_contracts((writer, reader))  # writer first: fine
    with pytest.raises(ZeroFXError, match=r"pass 'reader' reads meta key\(s\) \['zerofx_offload'\] that no earlier"):
        check_contracts((reader, writer))
    with pytest.raises(ZeroFXError, match="declared twice"):
        check_contracts((writer, writer))
    with pytest.raises(ValueError, match="unknown graph kind"):
        Pass("bad", _noop, ("backwards",))


def test_every_meta_key_zerofx_reads_in_passes_is_declared_by_a_contract():
    """The source of every pass names only keys of zerofx.ir.meta, each declared by that pass."""
    declared = {p.fn.__module__.rsplit(".", 1)[1]: {*p.reads, *p.writes} for p in default_pipeline()}
    literal = re.compile(r"meta(?:\.get|\.pop|\.setdefault)?[\[(]\"(zerofx_\w+|recompute)\"")
    for module, keys in declared.items():
        source = (ROOT / "passes" / f"{module}.py").read_text()
        assert not literal.findall(source), f"passes/{module}.py spells a meta key as a string literal"
        used = {k for k in KEYS if re.search(rf"meta(?:\.get|\.pop|\.setdefault)?[\[(]{_const(k)}\b", source)}
        assert used <= keys, (module, sorted(used - keys))


def _const(key) -> str:
    import zerofx.ir.meta as meta

    return next(name for name in meta.__all__ if getattr(meta, name) is key)


def test_the_architecture_doc_lists_the_declared_contracts():
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("<!-- pass-contracts")[1].split("<!-- /pass-contracts -->")[0]
    rows = [r for r in table.splitlines() if r.startswith("| `")]
    cells = lambda r: [c.strip() for c in r.strip("|").split("|")]  # noqa: E731
    documented = [(c[0].strip("`"), c[1], c[2], c[3]) for c in map(cells, rows)]
    fmt = lambda keys: ", ".join(f"`{k}`" for k in keys) or "-"  # noqa: E731
    declared = [(p.name, ", ".join(p.kinds), fmt(p.reads), fmt(p.writes)) for p in default_pipeline()]
    assert documented == declared


def test_nodes_a_pass_creates_carry_its_name_and_the_dump_shows_it(tmp_path):
    unshard = torch.ops.zerofx.unshard

    def fw(s, x):
        return x @ unshard(s, 2, "g", 6).t()

    gm = make_fx(fw, tracing_mode="fake")(torch.randn(3, 5), torch.randn(2, 5))
    before = {n.name for n in gm.graph.nodes}
    recorder = Recorder(dump_dir=tmp_path)
    gm = run_pipeline(
        gm, PassContext("test", "forward"), observer=recorder, disabled=("transport",)
    )  # transport asks the process group for its backend
    made = {n.name: n.meta.get(PASS) for n in gm.graph.nodes if n.name not in before}
    assert made and set(made.values()) == {"gather"}, made
    assert all(
        n.meta.get(ROLE) == "gather"
        for n in gm.graph.nodes
        if n.name in made
        and n.op == "call_function"
        and n.target is torch.ops._c10d_functional.all_gather_into_tensor.default
    )
    assert all(PASS not in n.meta for n in gm.graph.nodes if n.name in before)
    dumped = (tmp_path / "rank0" / "test_forward" / "01_gather.py").read_text()
    assert "# made by zerofx passes" in dumped
    for name in made:
        assert re.search(rf"#\s+{name}\s+gather$", dumped, re.M), name
