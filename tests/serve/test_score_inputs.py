"""Score inputs as an attacker could shape them, through the real CLI: links out of the input
root (in a directory input, swapped in for a file, or as a directory on the way) are refused
when the job runs and nothing of the linked file is echoed; a 10 MB line and a non-UTF-8 Kaggle
``Id`` are bad rows named by FILE:LINE (score and preprocess alike)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dlrm_vrgd.data.criteo.format import format_criteo_text

from ..data.criteo.test_criteo import make_rows
from .test_score import Trained

SECRET = b"SECRET-0123456789\tTOKEN-abcdef"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    return Trained(tmp_path_factory.mktemp("score_inputs"))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", *args, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )


def score_cli(trained: Trained, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return cli("score", "--model", str(trained.model), "--out", str(out), *args)


@pytest.fixture
def data_root(tmp_path: Path) -> Path:
    """``root/`` with a good input file, and a secret outside it."""
    root = tmp_path / "root"
    (root / "inputs").mkdir(parents=True)
    lab, ints, cats = make_rows(50, 7)
    (root / "inputs" / "day_0.tsv").write_bytes(format_criteo_text(lab, ints, cats))
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.tsv").write_bytes(SECRET + b"\n")
    return root


def assert_refused(proc: subprocess.CompletedProcess[str], out: Path, why: str) -> None:
    assert proc.returncode != 0 and not out.exists()
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert why in proc.stderr, proc.stderr[-2000:]
    assert "SECRET" not in proc.stderr and "TOKEN" not in proc.stderr


def test_the_root_accepts_its_own_files(trained: Trained, data_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.csv"
    proc = score_cli(trained, out, "--input", str(data_root / "inputs"),
                     "--input-root", str(data_root))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_text().count("\n") == 51


def test_a_link_in_a_directory_input_is_refused(
    trained: Trained, data_root: Path, tmp_path: Path
) -> None:
    (data_root / "inputs" / "leak.tsv").symlink_to(tmp_path / "outside" / "secret.tsv")
    out = tmp_path / "p.csv"
    proc = score_cli(trained, out, "--input", str(data_root / "inputs"),
                     "--input-root", str(data_root))  # fmt: skip
    assert_refused(proc, out, "inputs/leak.tsv: a symlink")


def test_an_input_swapped_for_a_link_is_refused(
    trained: Trained, data_root: Path, tmp_path: Path
) -> None:
    """The job was queued with a plain file, which was then replaced by a link."""
    victim = data_root / "inputs" / "day_0.tsv"
    victim.unlink()
    victim.symlink_to(tmp_path / "outside" / "secret.tsv")
    out = tmp_path / "p.csv"
    proc = score_cli(trained, out, "--input", str(victim), "--input-root", str(data_root))
    assert_refused(proc, out, "day_0.tsv: a symlink")


def test_a_linked_directory_on_the_way_is_refused(
    trained: Trained, data_root: Path, tmp_path: Path
) -> None:
    (data_root / "elsewhere").symlink_to(tmp_path / "outside")
    out = tmp_path / "p.csv"
    proc = score_cli(trained, out, "--input", str(data_root / "elsewhere" / "secret.tsv"),
                     "--input-root", str(data_root))  # fmt: skip
    assert_refused(proc, out, "secret.tsv: outside the input root")


def test_a_header_that_is_not_criteo_is_not_echoed(trained: Trained, tmp_path: Path) -> None:
    bad = tmp_path / "secret.csv"
    bad.write_bytes(b"Id,SECRET,TOKEN\n1,2,3\n")
    out = tmp_path / "p.csv"
    proc = score_cli(trained, out, "--input", str(bad))
    assert_refused(proc, out, "secret.csv:1: unrecognized header (3 fields)")


# ------------------------------------------------------------------------- FILE:LINE
def with_long_line(path: Path) -> None:
    lab, ints, cats = make_rows(50, 8)
    lines = format_criteo_text(lab, ints, cats).split(b"\n")
    lines[5] = b"1\t" + b"7" * (10 << 20)  # line 6: 10 MB
    path.write_bytes(b"\n".join(lines))


def kaggle_with_bad_id(path: Path) -> None:
    _, ints, cats = make_rows(50, 9)
    ids = np.arange(50) + 10**7
    lines = format_criteo_text(None, ints, cats, ",", header=True, ids=ids).split(b"\n")
    lines[3] = b"\xff\xfe" + lines[3]  # line 4 (the header is line 1)
    path.write_bytes(b"\n".join(lines))


CASES = [
    (with_long_line, "long.tsv", "long.tsv:6: a line longer than 1,048,576 bytes"),
    (kaggle_with_bad_id, "test.csv", "test.csv:4: field Id is not UTF-8 text"),
]


@pytest.mark.parametrize(("make", "name", "message"), CASES)
def test_score_names_file_and_line(
    trained: Trained, tmp_path: Path, make: object, name: str, message: str
) -> None:
    path = tmp_path / name
    make(path)  # type: ignore[operator]
    out = tmp_path / "p.csv"
    proc = score_cli(trained, out, "--input", str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"error: {tmp_path}/{message}" in proc.stderr, proc.stderr[-2000:]
    proc = score_cli(trained, out, "--input", str(path), "--skip-bad-rows")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "skipped 1 malformed rows" in proc.stdout and message in proc.stdout
    assert out.read_text().count("\n") == 1 + 49


@pytest.mark.parametrize(("make", "name", "message"), CASES)
def test_preprocess_names_file_and_line(
    tmp_path: Path, make: object, name: str, message: str
) -> None:
    path = tmp_path / name
    make(path)  # type: ignore[operator]
    proc = cli("preprocess", "--input", str(path), "--out", str(tmp_path / "days"),
               "--max-rows-per-table", "50")  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"error: {tmp_path}/{message}" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "days").exists()


def test_generated_days_and_npy_files_are_refused_saying_what_to_do(
    trained: Trained, tmp_path: Path
) -> None:
    """`score --input` a `dlrm-vrgd generate` directory, or one of its .npy files: not read as
    text (\"unrecognized header\"), but refused saying what score reads and where a model
    trained on those days has its figures."""
    import yaml

    from ..conftest import tiny_config_dict

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config_dict()))
    gen = tmp_path / "gen"
    done = cli("generate", "--config", str(config), "--out", str(gen))
    assert done.returncode == 0, done.stderr
    out = tmp_path / "p.csv"
    refused = score_cli(trained, out, "--input", str(gen))
    assert_refused(refused, out, "written by `dlrm-vrgd generate`")
    assert "dlrm-vrgd preprocess" in refused.stderr and "result.json" in refused.stderr
    npy = score_cli(trained, out, "--input", str(gen / "day_0_dense.npy"))
    assert_refused(npy, out, "a NumPy array (.npy), not raw Criteo text")
    assert "unrecognized header" not in npy.stderr


def test_scoring_the_training_days_warns_once(trained: Trained, tmp_path: Path) -> None:
    out = tmp_path / "p.csv"
    done = score_cli(trained, out, "--input", str(trained.data))
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("the model trained on") == 1, done.stderr
