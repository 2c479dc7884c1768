"""Loading a model directory: only an exact, complete, unaltered export loads; every tampered
directory is one ModelError naming the file and the reason (the CLI: rc != 0, no traceback),
and no file of it runs code. Random mutations (hypothesis) never load silently."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlrm_vrgd.serve import model as m

from ..tamper import Payload, mutate_dir, sha256, states_equal
from .test_score import Trained


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """A model of preprocessed raw rows with a frequency threshold: every optional file
    (vocab.npy, model.pt2) is there."""
    return Trained(tmp_path_factory.mktemp("model"), threshold=3)


def rehash(model_dir: Path, *names: str) -> None:
    """Make the manifest agree with the files ``names`` as they are now (an attacker who can
    write the directory can do this: only the loader's other checks stop them)."""
    path = model_dir / m.MANIFEST
    manifest = json.loads(path.read_text())
    for name in names:
        f = model_dir / name
        manifest["files"][name] = {"bytes": f.stat().st_size, "sha256": sha256(f)}
    path.write_text(json.dumps(manifest))


def edit_json(model_dir: Path, name: str, fn: Callable[[dict], object]) -> None:
    """Edit a JSON file in place (``fn`` changes the object) and rehash it."""
    raw = json.loads((model_dir / name).read_text())
    fn(raw)
    replace_json(model_dir, name, raw)


def replace_json(model_dir: Path, name: str, obj: object) -> None:
    (model_dir / name).write_text(json.dumps(obj))
    if name != m.MANIFEST:
        rehash(model_dir, name)


def edit_weights(model_dir: Path, fn: Callable[[dict], object]) -> None:
    state = torch.load(model_dir / m.WEIGHTS, weights_only=True)
    out = fn(state)  # a dict replaces the state; anything else: ``fn`` edited it
    torch.save(out if isinstance(out, dict) else state, model_dir / m.WEIGHTS)
    rehash(model_dir, m.WEIGHTS)


def manifest_files(fn: Callable[[dict], object]) -> Callable[[Path, Path], None]:
    return lambda d, _: edit_json(d, m.MANIFEST, lambda raw: fn(raw["files"]))


def symlinked_weights(d: Path, _: Path) -> None:
    outside = d.parent / "outside-weights.pt"
    shutil.copy(d / m.WEIGHTS, outside)
    (d / m.WEIGHTS).unlink()
    (d / m.WEIGHTS).symlink_to(outside)


def altered_unlisted_weights(d: Path, _: Path) -> None:
    edit_json(d, m.MANIFEST, lambda raw: raw["files"].pop(m.WEIGHTS))
    state = torch.load(d / m.WEIGHTS, weights_only=True)
    state["weight"] += 1
    torch.save(state, d / m.WEIGHTS)


def outside_entry(d: Path, _: Path) -> None:
    target = Path("/etc/hostname")
    entry = {"bytes": target.stat().st_size, "sha256": sha256(target)}
    edit_json(d, m.MANIFEST, lambda raw: raw["files"].__setitem__("../../../../../etc/hostname",
                                                                  entry))  # fmt: skip


def pickled_vocab(d: Path, _: Path) -> None:
    np.save(d / m.VOCAB, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    rehash(d, m.VOCAB)


CASES: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "manifest []": (lambda d, _: (d / m.MANIFEST).write_text("[]"),
                    r"manifest\.json: a JSON list, not an object"),
    "manifest null": (lambda d, _: (d / m.MANIFEST).write_text("null"),
                      r"manifest\.json: a JSON NoneType, not an object"),
    "manifest not UTF-8": (lambda d, _: (d / m.MANIFEST).write_bytes(b"\xff\xfe{}"),
                           r"manifest\.json: not valid UTF-8 JSON"),
    "no files key": (lambda d, _: edit_json(d, m.MANIFEST, lambda r: r.pop("files")),
                     r"manifest\.json: keys differ .*missing \['files'\]"),
    "files {}": (manifest_files(lambda f: f.clear()), r"manifest\.json: files does not list"),
    "weights unlisted and altered": (altered_unlisted_weights,
                                     r"manifest\.json: files does not list weights\.pt"),
    "entry ../../etc/hostname": (outside_entry,
                                 r"manifest\.json: files lists a name that is not a model file"),
    "bad sha256": (manifest_files(lambda f: f[m.WEIGHTS].__setitem__("sha256", "x")),
                   r"manifest\.json: files entry weights\.pt is not"),
    "extra key in model.json": (lambda d, _: edit_json(d, m.ARCH, lambda r: r.update(x=1)),
                                r"model\.json: keys are not exactly"),
    "model.json []": (lambda d, _: replace_json(d, m.ARCH, []),
                      r"model\.json: a JSON list, not an object"),
    "table_rows 1e12": (
        lambda d, _: edit_json(d, m.ARCH, lambda r: r.update(table_rows=[10**12] * 26)),
        r"weights\.pt: tensor weight is not \(26000000000000, 8\)"),
    "junk features.json": (lambda d, _: replace_json(d, m.FEATURES, {"junk": [1]}),
                           r"features\.json: not an object with exactly the keys"),
    "features of other tables": (
        lambda d, _: edit_json(d, m.FEATURES, lambda r: r.update(table_rows=[3] * 26)),
        r"features\.json: table_rows is not valid for this model"),
    "0-byte weights.pt": (lambda d, _: ((d / m.WEIGHTS).write_bytes(b""), rehash(d, m.WEIGHTS)),
                          r"weights\.pt: not a tensors-only state dict"),
    "symlinked weights.pt": (symlinked_weights, r"weights\.pt: cannot open \(a symlink\)"),
    "weights.pt a directory": (lambda d, _: ((d / m.WEIGHTS).unlink(), (d / m.WEIGHTS).mkdir()),
                               r"weights\.pt: not a regular file"),
    "NaN weights": (lambda d, _: edit_weights(d, lambda s: s["weight"].fill_(float("nan"))),
                    r"weights\.pt: tensor weight holds NaN or infinite values"),
    "a missing tensor": (lambda d, _: edit_weights(d, lambda s: s.pop("weight")),
                         r"weights\.pt: its tensors are not those of model\.json"),
    "row_offsets shifted": (lambda d, _: edit_weights(d, lambda s: s["row_offsets"].add_(1)),
                            r"weights\.pt: row_offsets are not the tables' starts"),
    "code-running weights.pt": (
        lambda d, marker: edit_weights(d, lambda s: {**s, "x": Payload(marker)}),
        r"weights\.pt: not a tensors-only state dict \(UnpicklingError\)"),
    "pickled vocab.npy": (pickled_vocab, r"vocab\.npy: not a plain \.npy array"),
    "an extra file": (lambda d, _: (d / "leak.txt").write_text("x"),
                      r"holds 1 file\(s\) not in manifest\.json"),
    "missing vocab.npy": (lambda d, _: (d / m.VOCAB).unlink(), r"vocab\.npy: missing"),
}  # fmt: skip


def tampered(trained: Trained, tmp_path: Path, case: str) -> tuple[Path, Path]:
    model = tmp_path / "model"
    shutil.copytree(trained.model, model, symlinks=True)
    marker = tmp_path / "PAYLOAD_RAN"
    CASES[case][0](model, marker)
    return model, marker


def test_the_untouched_export_loads(trained: Trained) -> None:
    model, layout, vocab = m.load_scoring(trained.model)
    assert (
        vocab is not None
        and layout.vocab
        and sorted(m.read_manifest(trained.model)["files"])
        == [
            "config.json",
            "features.json",
            "model.json",
            "model.pt2",
            "model_raw.pt2",
            "vocab.npy",
            "weights.pt",
        ]
    )


@pytest.mark.parametrize("case", list(CASES))
def test_a_tampered_model_is_one_model_error(trained: Trained, tmp_path: Path, case: str) -> None:
    model, marker = tampered(trained, tmp_path, case)
    with pytest.raises(m.ModelError, match=CASES[case][1]):
        m.load_model(model)
    assert not marker.exists()


@pytest.mark.parametrize(
    "case", ["manifest null", "entry ../../etc/hostname", "symlinked weights.pt", "NaN weights",
             "code-running weights.pt", "table_rows 1e12"],
)  # fmt: skip
def test_score_refuses_a_tampered_model_without_a_traceback(
    trained: Trained, tmp_path: Path, case: str
) -> None:
    model, marker = tampered(trained, tmp_path, case)
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "score", "--model", str(model), "--input",
         str(trained.root / "raw" / "day_0.tsv"), "--out", str(tmp_path / "p.csv"),
         "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0 and not (tmp_path / "p.csv").exists()
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    import re

    assert re.search(CASES[case][1], lines[0]), lines[0]
    assert not marker.exists()


# --------------------------------------------------------------------------------- fuzz
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_models_never_run_code_nor_load_silently(
    trained: Trained, data: st.DataObject
) -> None:
    want, want_layout, want_vocab = m.load_scoring(trained.model)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "model"
        shutil.copytree(trained.model, copy)
        marker = Path(tmp) / "PAYLOAD_RAN"
        kind, changed = mutate_dir(copy, data, marker)
        try:
            got = m.load_scoring(copy)
        except m.ModelError:
            got = None
        assert not marker.exists(), "a model file's pickle ran code"
        if got is not None:  # only what the export wrote loads
            model, layout, vocab = got
            assert states_equal(model.state_dict(), want.state_dict())
            assert layout == want_layout and np.array_equal(vocab, want_vocab)
        if changed and kind != "manifest":  # a file changed, removed, added or linked
            assert got is None, f"a model with a {kind} mutation loaded"
