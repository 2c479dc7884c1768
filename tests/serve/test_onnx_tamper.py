"""Issue 39, item 8: a ``model.onnx`` tampered with by someone who rewrites the manifest too.
External data named anywhere in the graph (a ``Constant`` node's value, an ``If`` branch's
initializer, not only the top graph's initializers) other than the listed ``model.onnx.data``
is refused before ONNX Runtime sees the graph; whatever ONNX Runtime itself refuses (a graph it
cannot load, inputs or an output of other types or shapes, a run that fails) is one
:class:`ModelError` naming the file, and the CLI says it in one line (exit 2), never with a
traceback."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from dlrm_vrgd.data.criteo.format import format_criteo_text
from dlrm_vrgd.serve.export import export_model
from dlrm_vrgd.serve.model import ModelError
from dlrm_vrgd.serve.onnx import OnnxScorer
from dlrm_vrgd.serve.score import score

from ..data.criteo.test_criteo import make_rows
from .test_onnx import rehash
from .test_score import Trained


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory with ``model.onnx`` in one file (no external data)."""
    t = Trained(tmp_path_factory.mktemp("onnx_tamper"))
    out = t.root / "model_onnx"
    export_model(t.root / "run", out, program=False, onnx=True)
    return out


def outside_tensor(name: str, where: Path) -> TensorProto:
    """A float[4] tensor whose data is said to be in ``where`` (a host file)."""
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[4])
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", str(where)), ("offset", "0"), ("length", "16")):
        t.external_data.add(key=key, value=value)
    return t


def constant_node(graph: onnx.GraphProto, outside: Path) -> None:
    graph.node.append(
        helper.make_node("Constant", [], ["leak"], value=outside_tensor("c", outside))
    )


def if_branch(graph: onnx.GraphProto, outside: Path) -> None:
    out = [helper.make_tensor_value_info("o", TensorProto.FLOAT, [4])]
    then = helper.make_graph([helper.make_node("Identity", ["w"], ["o"])], "then", [], out,
                             initializer=[outside_tensor("w", outside)])  # fmt: skip
    zero = helper.make_tensor("z", TensorProto.FLOAT, [4], [0.0] * 4)
    other = helper.make_graph([helper.make_node("Identity", ["z"], ["o"])], "else", [], out,
                              initializer=[zero])  # fmt: skip
    cond = helper.make_tensor("t", TensorProto.BOOL, [], [True])
    graph.node.append(helper.make_node("Constant", [], ["cond"], value=cond))
    graph.node.append(helper.make_node("If", ["cond"], ["leak"], then_branch=then,
                                       else_branch=other))  # fmt: skip


def unknown_op(graph: onnx.GraphProto, outside: Path) -> None:
    graph.node.append(helper.make_node("NoSuchOp", ["dense"], ["x"]))


def _model(
    nodes: list[onnx.NodeProto],
    dense: int = TensorProto.FLOAT,
    out_shape: list[object] | None = None,
    inits: list[TensorProto] | None = None,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "tampered",
        [helper.make_tensor_value_info("dense", dense, ["B", 13]),
         helper.make_tensor_value_info("sparse", TensorProto.INT64, ["B", 26])],
        [helper.make_tensor_value_info("probability", TensorProto.FLOAT, out_shape or ["B"])],
        initializer=inits or [],
    )  # fmt: skip
    # the IR version of the exported graphs (helper's newest may be past ONNX Runtime's)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def out_of_range_gather() -> onnx.ModelProto:
    """A graph that loads, but whose run fails: ids index a 2-row table."""
    table = helper.make_tensor("table", TensorProto.FLOAT, [2], [0.25, 0.75])
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    return _model(
        [helper.make_node("Gather", ["table", "sparse"], ["g"]),
         helper.make_node("ReduceMax", ["g", "axes"], ["probability"], keepdims=0)],
        inits=[table, axes],
    )  # fmt: skip


def wrong_output_shape() -> onnx.ModelProto:
    """Runs, but gives B x 13 values for B rows."""
    return _model([helper.make_node("Sigmoid", ["dense"], ["probability"])], out_shape=["B", 13])


def wrong_input_type() -> onnx.ModelProto:
    """``dense`` taken as int64."""
    return _model(
        [helper.make_node("Cast", ["dense"], ["f"], to=TensorProto.FLOAT),
         helper.make_node("ReduceMean", ["f"], ["probability"], keepdims=0)],
        dense=TensorProto.INT64,
    )  # fmt: skip


EDITS: dict[str, Callable[[onnx.GraphProto, Path], None]] = {
    "constant-node": constant_node,
    "if-branch": if_branch,
    "unknown-op": unknown_op,
}
WHOLE: dict[str, Callable[[], onnx.ModelProto]] = {
    "run-fails": out_of_range_gather,
    "output-shape": wrong_output_shape,
    "input-type": wrong_input_type,
}
WHY = {
    "constant-node": "external data other than its listed model.onnx.data",
    "if-branch": "external data other than its listed model.onnx.data",
    "unknown-op": "ONNX Runtime cannot load it (InvalidGraph",
    "run-fails": "model.onnx: ONNX Runtime failed (",
    "output-shape": "model.onnx: gave (",
    "input-type": "inputs are not dense (tensor(float))",
}


def tampered(exported: Path, tmp_path: Path, kind: str) -> Path:
    model = tmp_path / "model"
    shutil.copytree(exported, model)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    if kind in EDITS:
        proto = onnx.load(str(model / "model.onnx"))
        EDITS[kind](proto.graph, outside)
    else:
        proto = WHOLE[kind]()
    (model / "model.onnx").write_bytes(proto.SerializeToString())
    rehash(model, "model.onnx")
    return model


@pytest.mark.parametrize("kind", [*EDITS, *WHOLE])
def test_a_tampered_graph_is_one_model_error(exported: Path, tmp_path: Path, kind: str) -> None:
    model = tampered(exported, tmp_path, kind)
    rows = tmp_path / "rows.tsv"
    rows.write_bytes(format_criteo_text(*make_rows(40, 4)))
    with pytest.raises(ModelError, match=re.escape(WHY[kind])):
        score(model, [rows], tmp_path / "p.csv", engine="onnxruntime", progress=False)
    assert not (tmp_path / "p.csv").exists()
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "score", "--model", str(model), "--input",
         str(rows), "--out", str(tmp_path / "q.csv"), "--engine", "onnxruntime",
         "--no-progress"],
        capture_output=True, text=True, timeout=300, env={**os.environ},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and WHY[kind] in proc.stderr, proc.stderr[-3000:]


def test_the_untampered_graph_scores(exported: Path, tmp_path: Path) -> None:
    scorer = OnnxScorer(exported)
    got = scorer(np.zeros((3, 13), np.float32), np.zeros((3, 26), np.int64))
    assert got.shape == (3,) and np.all((got > 0) & (got < 1))
