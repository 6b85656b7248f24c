"""Debug dumps: what every pass did to every graph, as files (``ZEROFX_DUMP``) or a report.

Layout written under ``<dump_dir>/rank<R>/`` (one folder per rank: graphs differ by rank when
shards are uneven; ``<dump_dir>/restart<N>/rank<R>/`` in a worker torchrun restarted, so a
failed attempt's dump survives the next)::

    summary.txt                     every graph, every pass: node deltas, collectives (dtype on
                                    the wire, bytes; quantized ones also the bytes before), saved values
    frame0_joint/00_input.py        the graph as the pass pipeline received it
    frame0_joint/01_regather.py     ... after each pass, readable with shapes, then which pass
                                    made each node zerofx added
    frame0_joint/01_regather.diff   unified diff against the previous file
    frame0_forward/...
    frame0_forward/NN_codegen.py    with executor="triton": the graph with its fused-kernel calls
    frame0_forward/kernels/NN_<kernel>.py   the generated Triton source of each kernel
    frame0_forward/kernels/<kernel>.FAILED.txt  a kernel that failed and ran as ATen instead
    frame0_backward/...

``frame<K>`` is the K-th graph zerofx compiled in this process (one per dynamo frame; a graph
break makes two). The same summary is what ``zerofx.explain`` prints (its own frames, in
``explain.txt`` beside ``summary.txt`` when it dumps too). A process's first write to a rank's
folder removes what an earlier run left there (its ``frame*`` folders and summaries), so the
files are this run's alone. A write that fails (a folder that cannot be made, a full disk) ends
the dump with one warning; training goes on.
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch.distributed as dist
from torch import fx

from zerofx.ir.collectives import COLLECTIVE_OPS, collective_group_size, collective_kind, mesh_dim_of, wire_bytes
from zerofx.ir.meta import PASS as PROVENANCE
from zerofx.ir.meta import QUANTIZED
from zerofx.passes.contract import PassContext
from zerofx.passes.cost_model import tensor_bytes


def _op_name(node: fx.Node) -> str:
    if node.op != "call_function":
        return node.op
    return str(node.target) if hasattr(node.target, "_schema") else getattr(node.target, "__name__", str(node.target))


def _graph_code(gm: fx.GraphModule) -> str:
    """The graph's readable code, then which pass made each node zerofx added (provenance)."""
    code = gm.print_readable(print_output=False, include_stride=False, include_device=False)
    made = [(n.name, n.meta[PROVENANCE]) for n in gm.graph.nodes if PROVENANCE in n.meta]
    if made:
        width = max(len(name) for name, _ in made)
        code += "\n# made by zerofx passes (node.meta['zerofx_pass']):\n"
        code += "".join(f"#   {name:<{width}}  {pass_name}\n" for name, pass_name in made)
    return code


def _collective_line(node: fx.Node) -> str:
    spec = COLLECTIVE_OPS[node.target]
    nbytes = tensor_bytes((node if spec.sized == "out" else node.args[0]).meta.get("val"))
    kind = collective_kind(node)
    wire = wire_bytes(kind, nbytes, collective_group_size(spec, node.args))
    val = node.meta["val"]
    dtype = str(val.dtype).replace("torch.", "")
    dim = mesh_dim_of(node.args[spec.group_name_arg])
    line = f"{kind:<15} {node.name:<28} {tuple(val.shape)} {dtype} on {dim}: {nbytes} B, {wire} B/rank on the wire"
    if QUANTIZED in node.meta:  # passes/quantize.py: what went on the wire, and what it replaced
        wire_format, was_dtype, was_wire = node.meta[QUANTIZED]
        line += f" as {wire_format}; {was_wire} B/rank as {was_dtype} before"
    return line


@dataclass
class PassRecord:
    graph_id: str
    kind: str  # graph kind (joint, forward, backward, inference)
    pass_name: str
    code: str
    nodes: int
    added: Counter
    removed: Counter
    collectives: list[str]
    seconds: float
    messages: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.pass_name == "input":  # collectives traced with the model (a tensor-parallel plan's)
            return "\n".join([f"  input: {self.nodes} nodes", *(f"      collective {c}" for c in self.collectives)])
        delta = lambda c, sign: ", ".join(f"{sign}{n} {op}" for op, n in sorted(c.items()))  # noqa: E731
        changes = "; ".join(x for x in (delta(self.added, "+"), delta(self.removed, "-")) if x) or "no change"
        lines = [f"  {self.pass_name}: {self.nodes} nodes ({changes}) in {self.seconds * 1e3:.1f} ms"]
        lines += [f"      {m}" for m in self.messages]
        lines += [f"      collective {c}" for c in self.collectives]
        return "\n".join(lines)


# rank folders this process has cleared of an earlier run's files (the first write to each)
_CLEARED: set[Path] = set()
_RUN_FILES = re.compile(r"frame\d+_\w+|summary\.txt|explain\.txt")


def _clear_earlier_run(folder: Path) -> None:
    """Remove from ``folder`` (a rank's, which zerofx owns) the files and folders an earlier run
    wrote there, once per process: left beside this run's, an old ``08_elide.py`` read as the last
    pass of a graph this run never bucketed, and old frames as graphs it compiled."""
    key = folder.resolve()
    if key in _CLEARED:
        return
    _CLEARED.add(key)
    if not folder.is_dir():
        return
    for child in folder.iterdir():
        if _RUN_FILES.fullmatch(child.name):
            shutil.rmtree(child) if child.is_dir() else child.unlink()


def rank_folder(dump_dir: str | os.PathLike) -> Path:
    """This rank's folder under ``dump_dir``: ``rank<R>``, or ``restart<N>/rank<R>`` in a
    worker torchrun's elastic agent restarted (``TORCHELASTIC_RESTART_COUNT`` N > 0), so that
    the restarted run, which clears its folder of an earlier run's files, keeps the dump of the
    attempt that failed."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    base = Path(dump_dir)
    if restart.isdigit() and int(restart) > 0:
        base = base / f"restart{int(restart)}"
    return base / f"rank{rank}"


@dataclass
class Recorder:
    """Observer for ``run_pipeline`` that keeps every pass's result and, optionally, writes it
    (``summary_name``: the summary's file; explain's recorder writes its own)."""

    dump_dir: str | os.PathLike | None = None
    records: list[PassRecord] = field(default_factory=list)
    notes: dict[str, list[str]] = field(default_factory=dict)
    kernel_sources: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    plans: dict[str, dict] = field(default_factory=dict)  # graph id -> its checkpoint plan's numbers
    summary_name: str = "summary.txt"
    write_failed: bool = False  # a write failed: the dump stopped (``_files``)

    @property
    def writes(self) -> bool:
        return self.dump_dir is not None and not self.write_failed

    def _files(self, write: Callable[[Path], None]) -> None:
        """Run ``write`` on this rank's folder. A failure (a folder that cannot be made, a full
        disk) ends the dump with one warning: a debug aid must not fail the compile it runs in
        (on one rank only, where only that rank's folder is at fault)."""
        if not self.writes:
            return
        try:
            folder = self._rank_dir()
            _clear_earlier_run(folder)
            write(folder)
        except OSError as e:
            self.write_failed = True
            warnings.warn(
                f"zerofx dump: cannot write under dump_dir {str(self.dump_dir)!r} ({e}); the dump stops here and "
                "training goes on (zerofx.explain reports every pass without writing)",
                stacklevel=3,
            )

    def __call__(
        self, ctx: PassContext, pass_name: str, before: fx.GraphModule | None, after: fx.GraphModule, seconds: float
    ) -> None:
        before_ops = Counter(_op_name(n) for n in before.graph.nodes) if before is not None else Counter()
        after_ops = Counter(_op_name(n) for n in after.graph.nodes)
        before_names = {n.name for n in before.graph.nodes} if before is not None else set()
        collectives = [
            _collective_line(n) for n in after.graph.nodes if n.target in COLLECTIVE_OPS and n.name not in before_names
        ]
        code = _graph_code(after) if self.writes else ""  # only files need the code
        record = PassRecord(
            ctx.graph_id,
            ctx.kind,
            pass_name,
            code,
            len(after.graph.nodes),
            after_ops - before_ops if before is not None else Counter(),
            before_ops - after_ops if before is not None else Counter(),
            collectives,
            seconds,
            list(ctx.messages) if before is not None else [],
        )
        self.records.append(record)
        self._files(lambda folder: self._write(folder, record))

    def note(self, graph_id: str, kind: str, text: str) -> None:
        """Attach a line to a graph's summary (e.g. what the partitioner saved)."""
        self.notes.setdefault(f"{graph_id}_{kind}", []).append(text)
        self._files(self._write_summary)

    def kernels(self, graph_id: str, kind: str, sources: list[tuple[str, str]]) -> None:
        """Keep the generated kernel sources of a graph (written as ``kernels/NN_<name>.py``)."""
        self.kernel_sources[f"{graph_id}_{kind}"] = list(sources)

        def write(rank_dir: Path) -> None:
            folder = rank_dir / f"{graph_id}_{kind}" / "kernels"
            folder.mkdir(parents=True, exist_ok=True)
            for i, (name, source) in enumerate(sources):
                (folder / f"{i:02d}_{name}.py").write_text(source)

        self._files(write)

    def kernel_failed(self, graph_id: str, kind: str, name: str, error: str) -> None:
        """A kernel fell back to ATen at run time: say so next to its source."""

        def write(rank_dir: Path) -> None:
            folder = rank_dir / f"{graph_id}_{kind}" / "kernels"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{name}.FAILED.txt").write_text(error + "\n")

        self._files(write)

    def summary(self) -> str:
        out: list[str] = []
        current = None
        for r in self.records:
            key = f"{r.graph_id}_{r.kind}"
            if key != current:
                current = key
                out.append(f"{key}:")
                out += [f"  note: {line}" for line in self.notes.get(key, [])]
            out.append(r.summary())
        for key, lines in self.notes.items():
            if not any(f"{r.graph_id}_{r.kind}" == key for r in self.records):
                out.append(f"{key}:")
                out += [f"  note: {line}" for line in lines]
        return "\n".join(out)

    def _rank_dir(self) -> Path:
        return rank_folder(self.dump_dir)

    def _write(self, rank_dir: Path, record: PassRecord) -> None:
        folder = rank_dir / f"{record.graph_id}_{record.kind}"
        folder.mkdir(parents=True, exist_ok=True)
        same_graph = [r for r in self.records if (r.graph_id, r.kind) == (record.graph_id, record.kind)]
        index = len(same_graph) - 1
        path = folder / f"{index:02d}_{record.pass_name}.py"
        path.write_text(record.code)
        if index > 0:
            prev = same_graph[-2]
            diff = difflib.unified_diff(
                prev.code.splitlines(keepends=True),
                record.code.splitlines(keepends=True),
                f"{index - 1:02d}_{prev.pass_name}.py",
                path.name,
            )
            (folder / f"{index:02d}_{record.pass_name}.diff").write_text("".join(diff))
        self._write_summary(rank_dir)

    def _write_summary(self, rank_dir: Path) -> None:
        rank_dir.mkdir(parents=True, exist_ok=True)
        (rank_dir / self.summary_name).write_text(self.summary() + "\n")
