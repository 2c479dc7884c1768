"""The scoring module of an exported model, and loading a model directory (plain PyTorch).

:class:`ScoringModel` is the trained click model for inference: ``forward(dense, sparse)`` with
``dense`` ``B x 13`` float32 (already transformed, as in the day files) and ``sparse`` ``B x 26``
int64 table-local row ids gives ``B`` click probabilities. A multi-hot model (``bag_sizes`` in
``model.json``) takes ``sparse`` ``B x L``, ``L = Σ bag_sizes``: each table's bag of ids side by
side (table 0's first, as training's rows), pooled by sum as training pools them. Its layers
are those of
:mod:`dlrm_vrgd.torch_model` (which mirrors torchrec's DLRM / DLRM_DCN exactly); the tables are
one ``Σrows x D`` buffer read with ``index_select`` (one id per table and row: sum pooling of a
single id is the row itself; multi-hot: the rows of a bag summed). Nothing here imports torchrec
or FBGEMM.

A model directory (written by :mod:`dlrm_vrgd.serve.export`)::

    MODEL/
      manifest.json   format, version, source run and step, and bytes + SHA-256 of every file
      model.json      architecture (ScoringModel's arguments)
      config.json     the training run's TrainConfig
      features.json   how a raw Criteo row becomes model inputs (serve/features.py)
      weights.pt      state dict of ScoringModel (tensors only: torch.load(weights_only=True))
      vocab.npy       kept ids per table (only for data preprocessed with a frequency threshold)
      model.pt2       torch.export program of ScoringModel (dynamic batch size)
      model_raw.pt2   torch.export program of RawScoringModel (raw integers in)
      model.onnx, model_raw.onnx (+ .data: ONNX external data), model_repository/NAME/...
                      ONNX graphs and a Triton model repository (serve/onnx.py)
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import re
import stat
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dlrm_vrgd import safejson
from dlrm_vrgd.serve.features import MULTI_HOT_KEYS, SYNTHESIS, FeatureLayout
from dlrm_vrgd.torch_model import LowRankCrossNet, mlp

MODEL_FORMAT = "dlrm-vrgd/model"
MODEL_VERSION = 1
MANIFEST = "manifest.json"
ARCH = "model.json"
CONFIG = "config.json"
FEATURES = "features.json"
WEIGHTS = "weights.pt"
VOCAB = "vocab.npy"
PROGRAM = "model.pt2"
#: ``torch.export`` of :class:`~dlrm_vrgd.serve.featurizer.RawScoringModel`: raw integers in.
RAW_PROGRAM = "model_raw.pt2"
#: ONNX graphs (:mod:`dlrm_vrgd.serve.onnx`), their external data, and the Triton repository
ONNX = "model.onnx"
RAW_ONNX = "model_raw.onnx"
DATA_SUFFIX = ".data"
TRITON_DIR = "model_repository"
#: the files of a Triton repository a model directory may hold (NAME/config.pbtxt, NAME/1/...)
_TRITON_FILE = re.compile(
    r"^model_repository/[A-Za-z0-9_-]{1,64}/(config\.pbtxt|1/model\.onnx"
    r"|1/model(_raw)?\.onnx\.data)$"
)


class ModelError(ValueError):
    """A model directory that is missing, incomplete or altered."""


class ScoringModel(nn.Module):
    """DLRM or DLRM_DCN for inference (see the module docstring)."""

    def __init__(
        self,
        arch: str,
        table_rows: list[int],
        embedding_dim: int,
        num_dense: int,
        dense_arch: list[int],
        over_arch: list[int],
        dcn_num_layers: int = 3,
        dcn_low_rank_dim: int = 16,
        meta_tables: bool = False,
        bag_sizes: list[int] | None = None,
    ) -> None:
        super().__init__()
        if arch not in ("dlrm", "dlrm_dcn"):
            raise ModelError(f"model.json: arch {arch!r} is not dlrm or dlrm_dcn")
        self.arch = arch
        self.table_rows = [int(r) for r in table_rows]
        num_sparse, dim = len(self.table_rows), embedding_dim
        starts = torch.tensor([0, *self.table_rows[:-1]], dtype=torch.int64).cumsum(0)
        self.register_buffer("row_offsets", starts)
        #: multi-hot: the fixed bag size of each table (ids a row: ``L = Σ bag_sizes``)
        self.bag_sizes = None if bag_sizes is None else [int(b) for b in bag_sizes]
        if self.bag_sizes is not None:
            if len(self.bag_sizes) != num_sparse or min(self.bag_sizes) < 1:
                raise ModelError(
                    f"model.json: bag_sizes {self.bag_sizes} are not one size >= 1 for each of "
                    f"the {num_sparse} tables"
                )
            # each id column's table start, and each bag's columns [a, b)
            first = [0, *np.cumsum(self.table_rows[:-1]).tolist()]
            cols = np.repeat(np.asarray(first, dtype=np.int64), self.bag_sizes)
            self.register_buffer("col_offsets", torch.from_numpy(cols), persistent=False)
            ends = np.cumsum(self.bag_sizes).tolist()
            self.bounds = list(zip([0, *ends[:-1]], ends, strict=True))
        # meta_tables: no storage for the tables, for loading them with assign=True
        weight = torch.empty(sum(self.table_rows), dim, device="meta" if meta_tables else None)
        self.register_buffer("weight", weight if meta_tables else weight.zero_())
        self.dense_arch = mlp([num_dense, *dense_arch])
        if arch == "dlrm":
            # the upper triangle (no diagonal) of the N x N dot products, as flat positions:
            # index_select of them is ~2x faster than advanced indexing by (rows, cols)
            triu = torch.triu_indices(num_sparse + 1, num_sparse + 1, offset=1)
            flat = triu[0] * (num_sparse + 1) + triu[1]
            self.register_buffer("triu_flat", flat, persistent=False)
            over_in = dim + (num_sparse + 1) * num_sparse // 2
        else:
            self.crossnet = LowRankCrossNet(
                (num_sparse + 1) * dim, dcn_num_layers, dcn_low_rank_dim
            )
            over_in = (num_sparse + 1) * dim
        sizes = [over_in, *over_arch]
        self.over_arch = nn.Sequential(mlp(sizes[:-1]), nn.Linear(sizes[-2], sizes[-1]))

    def tables(self) -> list[torch.Tensor]:
        """Views of the embedding tables, one ``rows x D`` tensor each."""
        return list(self.weight.split(self.table_rows))

    @property
    def width(self) -> int:
        """Ids a row: one a table, or (multi-hot) the sum of the bag sizes."""
        return len(self.table_rows) if self.bag_sizes is None else sum(self.bag_sizes)

    def embeddings(self, sparse: torch.Tensor) -> torch.Tensor:
        """``B x T x D``: each table's row (one-hot ``B x T`` ids), or the sum of its bag's
        rows (multi-hot ``B x L``: the bags side by side, table 0's first), as training's sum
        pooling."""
        n, t = sparse.shape
        if self.bag_sizes is None:
            rows = (sparse + self.row_offsets).reshape(-1)
            return self.weight.index_select(0, rows).view(n, t, -1)
        if t != self.width:
            raise ValueError(
                f"a multi-hot model takes {self.width} ids a row (bag sizes {self.bag_sizes}), "
                f"got sparse of shape {tuple(sparse.shape)}"
            )
        rows = (sparse + self.col_offsets).reshape(-1)
        ids = self.weight.index_select(0, rows).view(n, t, -1)  # B x L x D
        return torch.stack([ids[:, a:b].sum(1) for a, b in self.bounds], dim=1)

    def logits(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        n = sparse.shape[0]
        emb = self.embeddings(sparse)  # B x T x D
        d = self.dense_arch(dense)
        combined = torch.cat([d.unsqueeze(1), emb], dim=1)
        if self.arch == "dlrm":
            dots = torch.bmm(combined, combined.transpose(1, 2)).flatten(1)
            dots = dots.index_select(1, self.triu_flat)
            features = torch.cat([d, dots], dim=1)
        else:
            features = self.crossnet(combined.reshape(n, -1))
        return self.over_arch(features).squeeze(-1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(dense, sparse))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------------ validation
#: every key of manifest.json (export writes exactly these)
_MANIFEST_KEYS = {
    "format": str, "version": int, "created": str, "run": str, "checkpoint": str,
    "step": int, "world_size": int, "torch": str, "files": dict,
}  # fmt: skip
_REQUIRED_FILES = (ARCH, CONFIG, FEATURES, WEIGHTS)
_OPTIONAL_FILES = (VOCAB, PROGRAM, RAW_PROGRAM, ONNX, RAW_ONNX, ONNX + DATA_SUFFIX,
                   RAW_ONNX + DATA_SUFFIX)  # fmt: skip
_ARCH_KEYS = (
    "arch", "table_rows", "embedding_dim", "num_dense", "dense_arch", "over_arch",
    "dcn_num_layers", "dcn_low_rank_dim",
)  # fmt: skip
#: model.json keys of multi-hot models only (absent: one id a table)
_OPTIONAL_ARCH_KEYS = ("bag_sizes",)
#: largest bag of a multi-hot table (ids a row of it)
_MAX_BAG = 1 << 16
_MAX_SIZE = 1 << 40  # any one count of model.json (rows of all tables included)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_MAX_JSON_BYTES = 16 << 20  # model.json / features.json / config.json / manifest.json


def _is_int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _open_regular(path: Path) -> int:
    """An fd of ``path``, a regular file (never a link: O_NOFOLLOW), or ModelError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ModelError(f"{path}: missing") from None
    except OSError as err:  # ELOOP: a symlink
        why = "a symlink" if err.errno == errno.ELOOP else err.strerror
        raise ModelError(f"{path}: cannot open ({why}); a model holds regular files only") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ModelError(f"{path}: not a regular file")
    return fd


def read_training_config(model_dir: str | Path) -> dict[str, Any]:
    """The training run's config (``config.json``) of a model directory, read as every model
    file is (no links, bounded size); verify the manifest first (:func:`read_manifest`)."""
    config = _read_json(Path(model_dir) / CONFIG)
    if not isinstance(config, dict):
        raise ModelError(f"{Path(model_dir) / CONFIG}: not a JSON object")
    return config


def _read_json(path: Path) -> Any:
    fd = _open_regular(path)
    with os.fdopen(fd, "rb") as f:
        data = f.read(_MAX_JSON_BYTES + 1)
    if len(data) > _MAX_JSON_BYTES:
        raise ModelError(f"{path}: over {_MAX_JSON_BYTES >> 20} MiB, not a model file")
    try:
        return safejson.loads(data.decode("utf-8"))  # bounded nesting: ValueError only
    except ValueError as err:  # the reason says where, never what (no text of the file)
        raise ModelError(f"{path}: not valid UTF-8 JSON ({safejson.describe(err)})") from None


def _manifest_problem(manifest: Any) -> str | None:
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    keys = set(manifest)
    if keys != set(_MANIFEST_KEYS):
        missing, extra = sorted(set(_MANIFEST_KEYS) - keys), len(keys - set(_MANIFEST_KEYS))
        return f"keys differ from a model manifest's (missing {missing}, {extra} unexpected)"
    for key, kind in _MANIFEST_KEYS.items():
        v = manifest[key]
        if not isinstance(v, kind) or isinstance(v, bool):
            return f"{key!r} is not a JSON {kind.__name__}"
    if manifest["format"] != MODEL_FORMAT or manifest["version"] != MODEL_VERSION:
        return f"not format {MODEL_FORMAT!r} version {MODEL_VERSION}"
    if manifest["step"] < 0 or manifest["world_size"] < 1:
        return "step or world_size out of range"
    names = set(manifest["files"])
    for name in names:
        if name not in _REQUIRED_FILES + _OPTIONAL_FILES and not _TRITON_FILE.match(name):
            return "files lists a name that is not a model file"  # never echoed: any string
    for name in _REQUIRED_FILES:
        if name not in names:
            return f"files does not list {name}"
    for name, meta in manifest["files"].items():
        if (
            not isinstance(meta, dict)
            or set(meta) != {"bytes", "sha256"}
            or not _is_int(meta["bytes"])
            or not isinstance(meta["sha256"], str)
            or not _SHA256.match(meta["sha256"])
        ):
            return f"files entry {name} is not {{bytes, sha256}} (a size and a hex SHA-256)"
    return None


def read_manifest(
    model_dir: Path, verify: bool = True, hashed_on_read: Collection[str] = ()
) -> dict[str, Any]:
    """The manifest of a model directory, checked for its exact shape (:class:`ModelError`
    naming the file and the reason otherwise); with ``verify``, also that the directory holds
    exactly the files it lists, each a regular file (no links) of the listed size and SHA-256
    (hashed by parallel threads; the first file in the manifest's order that fails is named).
    ``hashed_on_read``: files the caller checks itself as it reads them (``OnnxScorer``'s
    ``model.onnx``), not hashed twice."""
    model_dir = Path(model_dir)
    path = model_dir / MANIFEST
    if model_dir.is_symlink() or not model_dir.is_dir():
        raise ModelError(f"{model_dir}: not a directory (pass the --out of `dlrm-vrgd export`)")
    if not path.exists() and not path.is_symlink():
        raise ModelError(f"{path}: missing; not a complete `dlrm-vrgd export` output")
    manifest = _read_json(path)
    problem = _manifest_problem(manifest)
    if problem:
        raise ModelError(f"{path}: {problem}")
    if verify:
        present = _present_files(model_dir) - {MANIFEST}
        listed = set(manifest["files"])
        if present - listed:
            raise ModelError(
                f"{model_dir}: holds {len(present - listed)} file(s) not in {MANIFEST}"
            )
        files = [
            (model_dir / k, v) for k, v in manifest["files"].items() if k not in hashed_on_read
        ]
        threads = max(1, min(len(files), len(os.sched_getaffinity(0)), 8))
        with ThreadPoolExecutor(threads, thread_name_prefix="model-hash") as pool:
            for _ in pool.map(lambda item: _verify_file(*item), files):  # hashlib drops the GIL
                pass
    return manifest


def _present_files(model_dir: Path) -> set[str]:
    """The names (``a/b`` below a subdirectory) of everything in a model directory; only the
    Triton repository may be a directory, and none of its entries a link."""
    present = set(os.listdir(model_dir))
    top = model_dir / TRITON_DIR
    if TRITON_DIR not in present or top.is_symlink() or not top.is_dir():
        return present
    present.discard(TRITON_DIR)
    stack = [(top, TRITON_DIR, 0)]
    while stack:
        folder, rel, depth = stack.pop()
        for entry in os.scandir(folder):
            name = f"{rel}/{entry.name}"
            if entry.is_dir(follow_symlinks=False) and depth < 2:
                stack.append((Path(entry.path), name, depth + 1))
            else:  # a file (checked when verified), or a link or a folder too deep: unlisted
                present.add(name)
    return present


def _verify_file(path: Path, meta: dict[str, Any]) -> None:
    fd = _open_regular(path)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != meta["bytes"]:
            raise ModelError(
                f"{path}: {size} bytes, the manifest says {meta['bytes']} (truncated?)"
            )
        h = hashlib.sha256()
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != meta["sha256"]:
        raise ModelError(f"{path}: SHA-256 differs from the manifest (altered?)")


def _arch_problem(arch: Any) -> str | None:
    if not isinstance(arch, dict):
        return f"a JSON {type(arch).__name__}, not an object"
    if not set(_ARCH_KEYS) <= set(arch) <= set(_ARCH_KEYS + _OPTIONAL_ARCH_KEYS):
        return f"keys are not exactly {list(_ARCH_KEYS)} (and bag_sizes for a multi-hot model)"
    if "bag_sizes" in arch:
        bags = arch["bag_sizes"]
        if (
            not isinstance(bags, list)
            or not isinstance(arch["table_rows"], list)
            or len(bags) != len(arch["table_rows"])
            or not all(_is_int(b, 1) and b <= _MAX_BAG for b in bags)
        ):
            return f"bag_sizes is not one size (1 to {_MAX_BAG}) for each table of table_rows"
    if arch["arch"] not in ("dlrm", "dlrm_dcn"):
        return "arch is not dlrm or dlrm_dcn"
    for key in ("embedding_dim", "num_dense", "dcn_num_layers", "dcn_low_rank_dim"):
        if not _is_int(arch[key], 1):
            return f"{key} is not a positive integer"
    for key in ("table_rows", "dense_arch", "over_arch"):
        v = arch[key]
        if not isinstance(v, list) or not v or not all(_is_int(x, 1) for x in v):
            return f"{key} is not a non-empty list of positive integers"
    sizes = [
        v for k in _ARCH_KEYS[1:] for v in (arch[k] if isinstance(arch[k], list) else [arch[k]])
    ]
    if max(sizes) > _MAX_SIZE or len(sizes) > 4096:
        return f"sizes over {_MAX_SIZE} or over 4096 of them"
    if arch["over_arch"][-1] != 1:
        return "over_arch does not end in 1 (one logit)"
    if arch["arch"] == "dlrm" and arch["dense_arch"][-1] != arch["embedding_dim"]:
        return "dense_arch does not end in embedding_dim (dlrm)"
    return None


def _layout(raw: Any, arch: dict[str, Any], has_vocab: bool) -> FeatureLayout:
    fields = {f.name: f for f in dataclasses.fields(FeatureLayout)}
    required = set(fields) - set(MULTI_HOT_KEYS)
    if not isinstance(raw, dict) or not required <= set(raw) <= set(fields):
        raise ModelError(
            f"{FEATURES}: not an object with exactly the keys {sorted(required)} (and "
            f"{list(MULTI_HOT_KEYS)} for a multi-hot model)"
        )
    t = len(arch["table_rows"])
    bags = arch.get("bag_sizes")
    if bags is None and any(k in raw for k in MULTI_HOT_KEYS):
        raise ModelError(f"{FEATURES}: multi-hot keys for a model of one id a table (model.json)")
    if bags is not None:
        if set(MULTI_HOT_KEYS) - set(raw):
            raise ModelError(f"{FEATURES}: no {list(MULTI_HOT_KEYS)} for a multi-hot model")
        synth, seed = raw["multi_hot_synthesis"], raw["multi_hot_seed"]
        if raw["multi_hot_sizes"] != bags:
            raise ModelError(
                f"{FEATURES}: multi_hot_sizes differ from model.json's bag_sizes {bags}"
            )
        if not (synth is None and seed is None) and not (
            synth == SYNTHESIS and _is_int(seed) and seed < 1 << 32
        ):
            raise ModelError(
                f"{FEATURES}: multi_hot_synthesis / multi_hot_seed are not {SYNTHESIS!r} and a "
                "seed, or both null"
            )

    def int_list(v: Any, lo: int) -> bool:
        return isinstance(v, list) and len(v) in (1, t) and all(_is_int(x, lo) for x in v)

    checks = {
        "source": raw["source"] in ("criteo", "synthetic"),
        "num_dense": raw["num_dense"] == arch["num_dense"] and _is_int(raw["num_dense"], 1),
        "table_rows": raw["table_rows"] == arch["table_rows"],
        "dense_floor": isinstance(raw["dense_floor"], int)
        and not isinstance(raw["dense_floor"], bool)
        and abs(raw["dense_floor"]) < 1 << 31,
        "preprocess_caps": raw["preprocess_caps"] is None or int_list(raw["preprocess_caps"], 1),
        "frequency_threshold": _is_int(raw["frequency_threshold"]),
        "data_cardinalities": raw["data_cardinalities"] is None
        or (int_list(raw["data_cardinalities"], 1) and len(raw["data_cardinalities"]) == t),
        "read_caps": raw["read_caps"] is None or int_list(raw["read_caps"], 1),
        "vocab": raw["vocab"] is has_vocab,
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise ModelError(f"{FEATURES}: {bad[0]} is not valid for this model (model.json)")
    return FeatureLayout(**raw)


def _vocab(path: Path, layout: FeatureLayout) -> np.ndarray:
    fd = _open_regular(path)
    try:
        with os.fdopen(fd, "rb") as f:
            vocab = np.load(f, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise ModelError(f"{path}: not a plain .npy array ({type(err).__name__})") from None
    cards = layout.data_cardinalities or []
    if (
        not isinstance(vocab, np.ndarray)
        or vocab.ndim != 1
        or vocab.dtype.kind not in "iu"
        or not layout.frequency_threshold
        or len(vocab) != sum(c - 1 for c in cards)
    ):
        raise ModelError(f"{path}: not the kept ids of features.json's tables")
    return vocab


def _weights(path: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    fd = _open_regular(path)
    try:  # through the fd: the file checked is the file loaded
        state = torch.load(f"/proc/self/fd/{fd}", map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # UnpicklingError (a global not allowed), a bad archive
        raise ModelError(f"{path}: not a tensors-only state dict ({type(err).__name__})") from None
    finally:
        os.close(fd)
    if not isinstance(state, dict) or set(state) != set(expected):
        raise ModelError(f"{path}: its tensors are not those of model.json's architecture")
    for name, want in expected.items():
        got = state[name]
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            raise ModelError(f"{path}: tensor {name} is not {tuple(want.shape)} {want.dtype}")
        if got.is_floating_point() and not _all_finite(got):
            raise ModelError(f"{path}: tensor {name} holds NaN or infinite values")
    return state


def _all_finite(t: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """Every element finite, looked at ``chunk`` elements at a time (a table of any size is
    checked with a few MB beside it; its memory-mapped pages are read, not copied)."""
    flat = t.reshape(-1)
    return all(
        bool(torch.isfinite(flat[i : i + chunk]).all()) for i in range(0, flat.numel(), chunk)
    )


def _checked_state(model_dir: Path, arch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``weights.pt``, memory-mapped, holding exactly ``arch``'s tensors, all finite, its
    ``row_offsets`` the tables' starts (:class:`ModelError` otherwise)."""
    with torch.device("meta"):  # shapes only: an architecture of any size costs nothing here
        expected = ScoringModel(**arch).state_dict()
    state = _weights(model_dir / WEIGHTS, expected)
    starts = torch.tensor([0, *arch["table_rows"][:-1]], dtype=torch.int64).cumsum(0)
    if not torch.equal(state["row_offsets"], starts):
        raise ModelError(f"{model_dir / WEIGHTS}: row_offsets are not the tables' starts")
    return state


def _read_arch(model_dir: Path) -> dict[str, Any]:
    arch = _read_json(model_dir / ARCH)
    problem = _arch_problem(arch)
    if problem:
        raise ModelError(f"{model_dir / ARCH}: {problem}")
    return arch


def _read_features(
    model_dir: Path, manifest: dict[str, Any], arch: dict[str, Any]
) -> tuple[FeatureLayout, np.ndarray | None]:
    """``features.json`` and ``vocab.npy`` (or None) checked against the architecture, and
    ``config.json`` a JSON object."""
    has_vocab = VOCAB in manifest["files"]
    layout = _layout(_read_json(model_dir / FEATURES), arch, has_vocab)
    vocab = _vocab(model_dir / VOCAB, layout) if has_vocab else None
    cfg = _read_json(model_dir / CONFIG)
    if not isinstance(cfg, dict):
        raise ModelError(f"{model_dir / CONFIG}: not a JSON object")
    return layout, vocab


def load_features(
    model_dir: str | Path, verify: bool = True
) -> tuple[FeatureLayout, np.ndarray | None]:
    """The feature layout and vocab (or None) of a model directory, for a forward that does
    not run the torch module (ONNX Runtime on ``model.onnx``): the whole directory checked as
    :func:`load_scoring` checks it, whichever engine scores. The manifest and every file's
    size and SHA-256 verified (a tampered ``weights.pt`` or ``model.onnx`` is refused with the
    same :class:`ModelError`), the JSON files and ``vocab.npy`` checked, and ``weights.pt``
    held to the architecture's exact tensors, all finite, as the torch loader holds it: it is
    memory-mapped and checked a few MB at a time, then let go (no second copy of the tables
    beside ONNX Runtime's)."""
    model_dir = Path(model_dir)
    manifest = read_manifest(model_dir, verify)
    arch = _read_arch(model_dir)
    _checked_state(model_dir, arch)  # checked, then let go (unmapped)
    return _read_features(model_dir, manifest, arch)


def load_scoring(
    model_dir: str | Path, device: str | torch.device = "cpu", verify: bool = True
) -> tuple[ScoringModel, FeatureLayout, np.ndarray | None]:
    """The model, feature layout and vocab (or None) of a model directory, all validated.

    Each file is opened once, without following links, and checked for its exact shape:
    ``model.json``'s arguments, ``weights.pt`` holding exactly the tensors (names, shapes,
    dtypes) that architecture has, all finite (so ``table_rows`` is bounded by what the file
    holds), ``row_offsets`` the tables' starts, ``features.json`` matching the architecture.
    Any problem is one :class:`ModelError` naming the file and the reason.
    """
    model_dir = Path(model_dir)
    manifest = read_manifest(model_dir, verify)
    arch = _read_arch(model_dir)
    state = _checked_state(model_dir, arch)
    layout, vocab = _read_features(model_dir, manifest, arch)
    model = ScoringModel(**arch, meta_tables=True)  # the loaded tables are taken, not copied
    model.load_state_dict(state, assign=True)
    return model.to(device).eval(), layout, vocab


def load_model(
    model_dir: str | Path, device: str | torch.device = "cpu", verify: bool = True
) -> ScoringModel:
    """The :class:`ScoringModel` of a model directory, in eval mode on ``device``
    (validated as :func:`load_scoring` says)."""
    return load_scoring(model_dir, device, verify)[0]


def load_program(model_dir: str | Path, raw: bool = False) -> Any:
    """The ``torch.export`` program of a model directory (``.module()`` gives a callable);
    ``raw``: ``model_raw.pt2``, which takes raw integers (:mod:`dlrm_vrgd.serve.featurizer`).

    ``torch.export.load`` unpickles parts of ``model.pt2``: use it on model directories you
    made, never on one an untrusted party could write (``load_model`` is safe for those; the
    CLI and the service never call this)."""
    model_dir = Path(model_dir)
    manifest = read_manifest(model_dir)
    name = RAW_PROGRAM if raw else PROGRAM
    if name not in manifest["files"]:
        raise ModelError(f"{model_dir}: no {name} (exported with --no-program, or synthetic data)")
    return torch.export.load(str(model_dir / name))
