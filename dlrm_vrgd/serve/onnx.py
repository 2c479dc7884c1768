"""ONNX export of the scoring module, a Triton model repository, and ONNX Runtime scoring.

``dlrm-vrgd export --format onnx`` (or ``all``) writes, into the model directory (all listed in
its manifest with their SHA-256, like every model file):

* ``model.onnx``: :class:`~dlrm_vrgd.serve.model.ScoringModel`, inputs ``dense`` ``B x 13``
  float32 (log-transformed, as in the day files) and ``sparse`` ``B x 26`` int64 table rows,
  output ``probability`` ``B`` float32 — what ``dlrm-vrgd score --engine onnxruntime`` runs
  after parsing and mapping rows in Python (:mod:`dlrm_vrgd.serve.features`);
* ``model_raw.onnx`` (models of Criteo data): the input transform in the graph
  (:class:`OnnxRawFeaturizer`: the dense log transform, the table caps, the frequency-threshold
  vocabulary, the read-time caps, the hashing of ids outside a table), inputs ``dense_raw``
  ``B x 13`` and ``ids_raw`` ``B x 26`` int64 (the integers and the hex ids as integers; what
  stays outside is text: :func:`~dlrm_vrgd.serve.featurizer.parse_raw_fields`);
* ``model_repository/NAME/config.pbtxt`` and ``model_repository/NAME/1/model.onnx``: a Triton
  Inference Server model repository (onnxruntime backend, dynamic batching) serving
  ``model_raw.onnx`` (else ``model.onnx``), a copy (``onnx`` and ONNX Runtime refuse external
  data with several hard links). ``docs/serving.md`` says how to serve and call it.

Every graph has opset :data:`OPSET` (the default domain; ONNX Runtime >= 1.14, so any recent
Triton) and a dynamic batch axis. Its tensors go to ONNX external data
(``model.onnx.data`` beside ``model.onnx``) when they exceed :data:`EXTERNAL_DATA_BYTES` (under
protobuf's 2 GiB limit of one file). Each file is checked at export with ``onnx.checker``, and
ONNX Runtime's output on sample rows is compared with the eager module's.

Loading (:class:`OnnxScorer`) verifies the model directory's manifest (every file's size and
SHA-256, no links; a thread hashes the other files while the graph loads, and any failure is
raised before the scorer is returned): an altered ``model.onnx`` (or ``weights.pt``, which
``score`` also checks tensor by tensor, :func:`~dlrm_vrgd.serve.model.load_features`) is
refused with the ``ModelError`` the torch loader gives. Every tensor of the graph (initializers,
``Constant`` values and other node attributes, subgraphs of ``If``/``Loop``/``Scan``,
functions) may name no external data but the listed ``NAME.onnx.data``. ONNX Runtime gets the
bytes that were hashed (a model without external data), or, with external data, the paths once
every file is checked; its errors (a graph it cannot load, inputs or an output of other types,
a run that fails) are ``ModelError`` naming the file, never a traceback.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlrm_vrgd.serve import model as m
from dlrm_vrgd.serve.features import FeatureLayout
from dlrm_vrgd.serve.featurizer import RawFeaturizer, RawScoringModel

logger = logging.getLogger(__name__)

#: The ONNX opset of every exported graph (torch 2.13's exporter's own: no version conversion).
OPSET = 18
#: Tensors over this many bytes in all go to external data (protobuf refuses files >= 2 GiB).
EXTERNAL_DATA_BYTES = 1_800_000_000
#: ``max_batch_size`` of the Triton config (rows in one request or one dynamic batch).
TRITON_MAX_BATCH = 65_536
#: Sample rows compared between ONNX Runtime and the eager module at export.
CHECK_ROWS = 256
#: Largest |ONNX Runtime - eager| probability accepted at export (float32 rounding).
CHECK_ATOL = 1e-5
OUTPUT = "probability"

_TRITON_NAME = re.compile(r"[^A-Za-z0-9_-]")


class OnnxRawFeaturizer(RawFeaturizer):
    """:class:`RawFeaturizer` with the vocabulary lookup as a branch-free binary search
    (ONNX has no ``searchsorted``): all tables at once, ``ceil(log2(largest table's kept ids))``
    gathers; the same rows as ``searchsorted`` (tested)."""

    def __init__(self, layout: FeatureLayout, vocab: np.ndarray | None = None) -> None:
        super().__init__(layout, vocab)
        sizes = torch.tensor(self.vocab_sizes or [0], dtype=torch.int64)
        self.register_buffer("vocab_len", sizes, persistent=False)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)[:-1]])
        self.register_buffer("vocab_start", starts, persistent=False)
        top = int(sizes.max())
        self.steps = [1 << k for k in reversed(range(top.bit_length()))]

    def kept_rows(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.steps:  # no table kept any id
            return torch.zeros_like(ids)
        size, start = self.vocab_len, self.vocab_start
        pos = torch.zeros_like(ids)  # the count of kept ids below ``ids``: lower_bound
        for step in self.steps:
            cand = pos + step
            inside = cand <= size
            at = (start + torch.minimum(cand, size) - 1).clamp(min=0)
            below = self.vocab.index_select(0, at.reshape(-1)).view_as(ids) < ids
            pos = torch.where(inside & below, cand, pos)
        at = (start + torch.minimum(pos, size - 1)).clamp(min=0)
        found = (pos < size) & (self.vocab.index_select(0, at.reshape(-1)).view_as(ids) == ids)
        return torch.where(found, pos + 1, torch.zeros_like(pos))


@dataclass(frozen=True)
class Graph:
    """One ONNX file of a model directory: its module, input names and sample inputs."""

    name: str
    module: torch.nn.Module
    inputs: dict[str, torch.Tensor]


def graphs(
    model: m.ScoringModel, layout: FeatureLayout, vocab: np.ndarray | None, seed: int = 0
) -> list[Graph]:
    """``model.onnx`` and (with raw features) ``model_raw.onnx``, with sample rows: random
    dense values, table rows (every table's first and last row among them), raw integers and
    ids (kept ids of the vocabulary among them)."""
    g = torch.Generator().manual_seed(seed)
    n, rows = CHECK_ROWS, torch.tensor(model.table_rows)
    dense = torch.randn(n, model.dense_arch[0].in_features, generator=g)
    if model.bag_sizes is not None:  # multi-hot: B x L, each column its table's rows
        rows = rows.repeat_interleave(torch.tensor(model.bag_sizes))
    sparse = (torch.rand(n, len(rows), generator=g) * rows).long()
    sparse[0], sparse[1] = 0, rows - 1
    out = [Graph(m.ONNX, model, {"dense": dense, "sparse": sparse})]
    if layout.raw_graph:
        rows = torch.tensor(model.table_rows)
        dense_raw = torch.randint(-10, 5000, (n, layout.num_dense), generator=g)
        ids_raw = torch.randint(0, 1 << 32, (n, len(rows)), generator=g)
        if vocab is not None and len(vocab):  # a third of the ids kept ones (found by search)
            pick = torch.randint(0, len(vocab), (n // 3, len(rows)), generator=g)
            ids_raw[: n // 3] = torch.as_tensor(np.asarray(vocab, np.int64))[pick]
        raw = RawScoringModel(OnnxRawFeaturizer(layout, vocab), model).eval()
        out.append(Graph(m.RAW_ONNX, raw, {"dense_raw": dense_raw, "ids_raw": ids_raw}))
    return out


def export_graph(graph: Graph, path: Path, external_bytes: int = EXTERNAL_DATA_BYTES) -> bool:
    """``torch.onnx.export`` (the dynamo exporter) of ``graph`` to ``path`` with a dynamic batch
    axis; its tensors to ``path.name + ".data"`` when over ``external_bytes``. Checked with
    ``onnx.checker`` and against the eager module on the sample rows (``ExportError``
    otherwise). Returns whether external data was written."""
    import onnx

    from dlrm_vrgd.serve.export import ExportError

    module = graph.module.eval()
    size = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    external = size > external_bytes
    batch = torch.export.Dim("batch", min=1, max=1 << 30)
    with warnings.catch_warnings():  # the exporter's notes (deprecations inside torch, axis names)
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            tuple(graph.inputs.values()),
            dynamo=True,
            input_names=list(graph.inputs),
            output_names=[OUTPUT],
            dynamic_shapes={k: {0: batch} for k in graph.inputs},
            opset_version=OPSET,
            optimize=True,
            verbose=False,
        )
        assert program is not None
        # the exporter's own writer (onnx_ir): tensors stream into the .data file, so a table
        # over 2 GiB never becomes one protobuf message (onnx.save would build it first)
        program.save(str(path), external_data=external)
    onnx.checker.check_model(str(path), full_check=True)  # a path: external data allowed
    with torch.no_grad():
        want = module(*graph.inputs.values()).numpy()
    got = _session(path, None).run(None, {k: v.numpy() for k, v in graph.inputs.items()})[0]
    diff = float(np.max(np.abs(got - want))) if got.shape == want.shape else float("inf")
    if not diff <= CHECK_ATOL:
        raise ExportError(f"{path.name}: ONNX Runtime differs from the model by {diff:.2e}")
    logger.info("%s: opset %d, %s, max |ORT - eager| %.1e", path.name, OPSET,
                "external data" if external else "one file", diff)  # fmt: skip
    return external


def triton_name(out: Path) -> str:
    """A Triton model name from the model directory's name (letters, digits, ``_``, ``-``)."""
    name = _TRITON_NAME.sub("_", out.name).strip("_") or "dlrm"
    return name[:64]


def triton_config(name: str, graph: Graph, max_batch_size: int = TRITON_MAX_BATCH) -> str:
    """``config.pbtxt`` for Triton's onnxruntime backend: the graph's inputs (batch axis
    implicit), one output of shape ``[B]`` (dims ``[1]`` reshaped to ``[]``: one probability
    a row), dynamic batching."""
    types = {torch.float32: "TYPE_FP32", torch.int64: "TYPE_INT64"}
    lines = [
        f'name: "{name}"',
        'backend: "onnxruntime"',
        f"max_batch_size: {max_batch_size}",
        "input [",
    ]
    entries = [
        f'  {{ name: "{k}" data_type: {types[v.dtype]} dims: [ {v.shape[1]} ] }}'
        for k, v in graph.inputs.items()
    ]
    lines += [",\n".join(entries), "]", "output ["]
    lines.append(
        f'  {{ name: "{OUTPUT}" data_type: TYPE_FP32 dims: [ 1 ] reshape: {{ shape: [ ] }} }}'
    )
    lines += ["]", "dynamic_batching { max_queue_delay_microseconds: 100 }", ""]
    return "\n".join(lines)


def write_onnx(
    staging: Path,
    model: m.ScoringModel,
    layout: FeatureLayout,
    vocab: np.ndarray | None,
    name: str,
    external_bytes: int = EXTERNAL_DATA_BYTES,
) -> None:
    """The ONNX files and the Triton repository (module docstring) into ``staging``."""
    written = []
    for graph in graphs(model, layout, vocab):
        external = export_graph(graph, staging / graph.name, external_bytes)
        written.append((graph, external))
    graph, external = written[-1]  # the raw graph where there is one: raw rows in
    version = staging / m.TRITON_DIR / name / "1"
    version.mkdir(parents=True)
    # copies, not hard links: onnx and ONNX Runtime refuse external data with several links
    shutil.copyfile(staging / graph.name, version / m.ONNX)
    if external:  # the graph names its data file (model_raw.onnx.data): the same name there
        data = graph.name + m.DATA_SUFFIX
        shutil.copyfile(staging / data, version / data)
    (version.parent / "config.pbtxt").write_text(triton_config(name, graph))


# ------------------------------------------------------------------------------ loading
def _session(
    model: Path | bytes, threads: int | None, providers: Any = None, spin: bool = True
) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3  # errors only
    if not spin:  # idle ORT threads sleep instead of spinning (they share cores with parsing)
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        opts.intra_op_num_threads = threads
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, opts, providers=providers or ["CPUExecutionProvider"])


def _verified_bytes(path: Path, meta: dict[str, Any]) -> bytes:
    """The content of ``path`` (no link), checked against its manifest entry."""
    fd = m._open_regular(path)
    with os.fdopen(fd, "rb") as f:
        data = f.read(meta["bytes"] + 1)
    if len(data) != meta["bytes"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
        raise m.ModelError(f"{path}: SHA-256 differs from the manifest (altered?)")
    return data


def _graph_tensors(graph: Any) -> Iterator[Any]:
    """Every tensor of a graph: initializers (sparse ones too) and node attributes (a
    ``Constant``'s value, ...), subgraphs (``If``, ``Loop``, ``Scan`` bodies) included."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node: Any) -> Iterator[Any]:
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        if attr.HasField("sparse_tensor"):
            yield from (attr.sparse_tensor.values, attr.sparse_tensor.indices)
        for sparse in attr.sparse_tensors:
            yield from (sparse.values, sparse.indices)
        if attr.HasField("g"):
            yield from _graph_tensors(attr.g)
        for sub in attr.graphs:
            yield from _graph_tensors(sub)


def external_locations(proto: Any) -> set[str]:
    """The external data files any tensor of the model names (its graph, every subgraph, every
    node attribute, every function); a tensor marked external without a location counts as
    ``""`` (never a listed file)."""
    from onnx import TensorProto

    tensors = list(_graph_tensors(proto.graph))
    for function in proto.functions:
        for node in function.node:
            tensors += _node_tensors(node)
    out = set()
    for t in tensors:
        where = [e.value for e in t.external_data if e.key == "location"]
        if t.data_location == TensorProto.EXTERNAL or t.external_data:
            out |= set(where) if where else {""}
    return out


def _ort_reason(err: Exception) -> str:
    """ONNX Runtime's message, first line, bounded (it repeats node names, never data)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text[:300]}"


class OnnxScorer:
    """ONNX Runtime on a model directory's ``model.onnx`` (``raw``: ``model_raw.onnx``):
    ``scorer(dense, sparse)`` -> probabilities, ``batch_rows`` rows a run."""

    def __init__(
        self,
        model_dir: str | Path,
        raw: bool = False,
        threads: int | None = None,
        device: str = "cpu",
        batch_rows: int = 16_384,
        verify: bool = True,
    ) -> None:
        model_dir = Path(model_dir)
        name = m.RAW_ONNX if raw else m.ONNX
        self.name = name
        manifest = m.read_manifest(model_dir, verify=False)  # its shape; the files below
        if name not in manifest["files"]:
            raise m.ModelError(f"{model_dir}: no {name} (export it with --format onnx or all)")
        self.inputs = ["dense_raw", "ids_raw"] if raw else ["dense", "sparse"]
        self.batch_rows = batch_rows
        # every other file's size and SHA-256, no links, checked by a thread while this one
        # reads, hashes and loads the graph (verify=False: the caller just did); nothing is
        # used before it is checked, and a problem of the directory is the one raised
        with ThreadPoolExecutor(1, thread_name_prefix="model-verify") as pool:
            others = pool.submit(m.read_manifest, model_dir, True, (name,)) if verify else None

            def checked() -> None:
                if others is not None:
                    others.result()

            try:
                self.session = self._load(model_dir, name, manifest, threads, device, checked)
            except BaseException:
                checked()
                raise
            checked()

    def _load(
        self,
        model_dir: Path,
        name: str,
        manifest: dict[str, Any],
        threads: int | None,
        device: str,
        checked: Callable[[], None],
    ) -> Any:
        """The ONNX Runtime session of ``name``, read once and hashed as read (the bytes ORT
        gets are the bytes checked), after its inputs, output and external data are checked."""
        import onnx

        path = model_dir / name
        data = _verified_bytes(path, manifest["files"][name])
        try:
            proto = onnx.load_model_from_string(data)
        except Exception as err:  # DecodeError: not an ONNX protobuf
            raise m.ModelError(f"{path}: not an ONNX model ({type(err).__name__})") from None
        data_name = name + m.DATA_SUFFIX
        locations = external_locations(proto)
        names = [i.name for i in proto.graph.input], [o.name for o in proto.graph.output]
        del proto  # the parsed copy of the tables: gone before ONNX Runtime makes its own
        if locations - {data_name} or (locations and data_name not in manifest["files"]):
            raise m.ModelError(f"{path}: external data other than its listed {data_name}")
        if names != (self.inputs, [OUTPUT]):
            raise m.ModelError(f"{path}: inputs are not {self.inputs} or the output not {OUTPUT!r}")
        providers = None
        if device != "cpu":
            import onnxruntime as ort

            if not device.startswith("cuda") or "CUDAExecutionProvider" not in (
                ort.get_available_providers()
            ):
                raise ValueError(
                    f"--device {device}: this onnxruntime has no CUDA provider; use "
                    "--engine torch (or onnxruntime-gpu)"
                )
            index = device.partition(":")[2] or "0"
            providers = [("CUDAExecutionProvider", {"device_id": int(index)})]
        if locations:  # ORT reads the data file itself, by the graph's path: checked first
            checked()
        try:  # with external data ORT reads the data file itself, by the graph's path
            session = _session(path if locations else data, threads, providers, spin=False)
        except Exception as err:  # onnxruntime's Fail, InvalidGraph, NotImplemented, ...
            raise m.ModelError(
                f"{path}: ONNX Runtime cannot load it ({_ort_reason(err)})"
            ) from None
        self._check_signature(path, session)
        return session

    def _check_signature(self, path: Path, session: Any) -> None:
        """The graph takes what :meth:`__call__` feeds (``B x 13`` float32 or int64 dense,
        ``B x 26`` int64 ids) and gives one float32 probability a row."""
        dense_type = "tensor(int64)" if self.raw else "tensor(float)"
        want = [(self.inputs[0], dense_type), (self.inputs[1], "tensor(int64)")]
        got = [(i.name, i.type) for i in session.get_inputs()]
        outputs = [(o.name, o.type) for o in session.get_outputs()]
        shapes = [i.shape for i in session.get_inputs()]
        if (
            got != want
            or outputs != [(OUTPUT, "tensor(float)")]
            or any(len(shape) != 2 for shape in shapes)
        ):
            raise m.ModelError(
                f"{path}: inputs are not {want[0][0]} ({want[0][1]}) and {want[1][0]} "
                f"(tensor(int64)), both B x N, or the output is not {OUTPUT} (tensor(float))"
            )

    def __call__(self, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
        out = np.empty(len(dense), dtype=np.float32)
        # passes of exactly batch_rows (the rest last): ONNX Runtime's arena, sized by the
        # first, never grows (passes of varying sizes grew it ~45 MB over 400k rows)
        step = self.batch_rows
        for a in range(0, len(dense), step):
            feed = {
                self.inputs[0]: np.ascontiguousarray(dense[a : a + step],
                                                     dtype=np.int64 if self.raw else np.float32),
                self.inputs[1]: np.ascontiguousarray(sparse[a : a + step], dtype=np.int64),
            }  # fmt: skip
            try:
                got = self.session.run(None, feed)[0]
            except Exception as err:  # onnxruntime's InvalidArgument, RuntimeException, ...
                raise m.ModelError(
                    f"{self.name}: ONNX Runtime failed ({_ort_reason(err)})"
                ) from None
            n = min(step, len(dense) - a)
            if not isinstance(got, np.ndarray) or got.size != n:
                raise m.ModelError(f"{self.name}: gave {getattr(got, 'shape', '?')} for {n} rows")
            out[a : a + n] = got.reshape(n)
        return out

    @property
    def raw(self) -> bool:
        return self.inputs[0] == "dense_raw"
