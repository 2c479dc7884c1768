"""Real Criteo data: raw text -> preprocess -> memory-mapped reader, on files the tests write.

Expected values are computed here from the generating arrays, independently of the parser:
dense ``log(max(x, -3) + 5)`` (torchrec's transform for a file whose minimum is -3), ids
``hex value % cap``, labels as written.
"""

from __future__ import annotations

import gzip
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from dlrm_vrgd.config import CriteoData
from dlrm_vrgd.data import build_splits
from dlrm_vrgd.data.batch import TrainStream
from dlrm_vrgd.data.criteo.format import (
    CriteoFormatError,
    MalformedRowError,
    format_criteo_text,
)
from dlrm_vrgd.data.criteo.parse import ParseOptions, decode_hex
from dlrm_vrgd.data.criteo.preprocess import MANIFEST, preprocess
from dlrm_vrgd.data.criteo.source import CriteoDataError, CriteoDays

CAPS = 1000


# ------------------------------------------------------------------------------ helpers
def make_rows(n: int, seed: int) -> tuple[np.ndarray, np.ma.MaskedArray, np.ma.MaskedArray]:
    """``n`` random Criteo rows: labels, counts (negatives down to -3, 20% missing), 8-digit
    hex ids (10% missing)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    ints = np.floor(np.exp(rng.normal(1.0, 2.0, (n, 13)))).astype(np.int64)
    ints[:, 1] -= 3  # I2 is the column with negatives in Criteo
    ints[0, 1] = -3  # the file minimum is -3: torchrec's shift equals ours
    ints = np.ma.masked_array(ints, mask=rng.random((n, 13)) < 0.2)
    ints.mask[0, 1] = False
    cats = rng.integers(0, 2**32, (n, 26), dtype=np.uint64)
    cats = np.ma.masked_array(cats, mask=rng.random((n, 26)) < 0.1)
    return labels, ints, cats


def expected(
    labels: np.ndarray | None,
    ints: np.ma.MaskedArray,
    cats: np.ma.MaskedArray,
    cap: int | None = CAPS,
) -> dict[str, np.ndarray]:
    dense = np.log((np.maximum(ints.filled(0), -3) + 5).astype(np.float32))
    sparse = cats.filled(0).astype(np.uint64)
    if cap is not None:
        sparse = sparse % np.uint64(cap)
    n = len(dense)
    lab = np.full(n, -1) if labels is None else labels
    return {
        "dense": dense,
        "sparse": sparse.astype(np.int64),
        "labels": lab.astype(np.int32).reshape(n, 1),
    }


def run(inputs: list[Path], out: Path, **kw) -> dict:
    kw.setdefault("progress", False)
    kw.setdefault("workers", 2)
    return preprocess(inputs, out, **kw).manifest


def load_day(out: Path, day: int) -> dict[str, np.ndarray]:
    return {k: np.load(out / f"day_{day}_{k}.npy") for k in ("dense", "sparse", "labels")}


def assert_day(out: Path, day: int, want: dict[str, np.ndarray]) -> None:
    got = load_day(out, day)
    for kind in want:
        assert got[kind].dtype == want[kind].dtype, kind
        np.testing.assert_array_equal(got[kind], want[kind], err_msg=kind)


def leftovers(tmp_path: Path, inputs: set[str]) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name not in inputs)


# --------------------------------------------------------------------------- round trip
def test_round_trip_several_tsv_days(tmp_path: Path) -> None:
    """Three day files (plain; gzip; CRLF with trailing empty fields stripped) through small
    blocks and two parsing threads."""
    days = [make_rows(n, seed) for n, seed in ((700, 1), (500, 2), (900, 3))]
    paths = []
    for i, (lab, ints, cats) in enumerate(days):
        text = format_criteo_text(lab, ints, cats)
        path = tmp_path / f"day_{i}"
        if i == 1:
            path = path.with_suffix(".gz")
            path.write_bytes(gzip.compress(text))
        else:
            if i == 2:
                text = b"\r\n".join(ln.rstrip(b"\t") for ln in text.split(b"\n"))
            path.write_bytes(text)
        paths.append(path)
    out = tmp_path / "out"
    manifest = run(paths, out, max_rows_per_table=CAPS, block_bytes=4096)
    assert [d["rows"] for d in manifest["days"]] == [700, 500, 900]
    assert manifest["sparse"]["cardinalities"] == [CAPS] * 26
    assert [i["gzip"] for i in manifest["inputs"]] == [False, True, False]
    assert [i["padded_rows"] > 50 for i in manifest["inputs"]] == [False, False, True]
    for i, rows in enumerate(days):
        assert_day(out, i, expected(*rows))


def test_round_trip_kaggle_csv_with_header(tmp_path: Path) -> None:
    lab, ints, cats = make_rows(600, 4)
    text = format_criteo_text(lab, ints, cats, ",", header=True, ids=np.arange(600) + 10**7)
    assert text.startswith(b"Id,Label,I1,I2,")
    (tmp_path / "train.csv").write_bytes(text)
    unlabeled = format_criteo_text(None, ints[:50], cats[:50], ",", header=True, ids=np.arange(50))
    (tmp_path / "test.csv").write_bytes(unlabeled)
    out = tmp_path / "out"
    manifest = run([tmp_path / "train.csv", tmp_path / "test.csv"], out, max_rows_per_table=CAPS)
    assert [(i["format"], i["header"], i["labeled"]) for i in manifest["inputs"]] == [
        ("csv", True, True),
        ("csv", True, False),
    ]
    assert_day(out, 0, expected(lab, ints, cats))
    assert_day(out, 1, expected(None, ints[:50], cats[:50]))


def test_reader_returns_exactly_the_rows_written(tmp_path: Path) -> None:
    """criteo_splits over 3 days: train = days 0-1 read across the day boundary, val / test =
    the halves of day 2; labels float, dense transformed, ids hashed."""
    days = [make_rows(n, seed) for n, seed in ((300, 5), (200, 6), (101, 7))]
    paths = []
    for i, rows in enumerate(days):
        paths.append(tmp_path / f"day_{i}.tsv")
        paths[-1].write_bytes(format_criteo_text(*rows))
    out = tmp_path / "out"
    run(paths, out, max_rows_per_table=CAPS)
    splits = build_splits(CriteoData(path=out, shuffle_block_rows=64))
    want = [expected(*rows) for rows in days]
    train = splits.train
    assert (train.num_rows, train.block_rows, train.cardinalities) == (500, 64, [CAPS] * 26)
    rows = train.read(250, 420)  # 50 rows of day 0, 120 of day 1
    np.testing.assert_array_equal(
        rows.dense, np.concatenate([want[0]["dense"][250:], want[1]["dense"][:120]])
    )
    np.testing.assert_array_equal(
        rows.sparse, np.concatenate([want[0]["sparse"][250:], want[1]["sparse"][:120]])
    )
    assert rows.labels.dtype == np.float32 and rows.probs is None
    np.testing.assert_array_equal(
        rows.labels, np.concatenate([want[0]["labels"][250:, 0], want[1]["labels"][:120, 0]])
    )
    assert (splits.val.num_rows, splits.test.num_rows) == (50, 51)
    np.testing.assert_array_equal(splits.val.read(0, 50).sparse, want[2]["sparse"][:50])
    np.testing.assert_array_equal(splits.test.read(0, 51).dense, want[2]["dense"][50:])
    with pytest.raises(IndexError):
        train.read(10, 501)

    # the trainer's stream visits every train row once per epoch, in shuffled blocks
    stream = TrainStream(train, global_batch=100, micro_batch=50, seed=3)
    seen = np.concatenate(
        [stream.rows(s, g).sparse for s in range(5) for g in range(2)]
    )  # one epoch = 500 rows
    all_rows = np.concatenate([want[0]["sparse"], want[1]["sparse"]])
    assert not np.array_equal(seen, all_rows)  # shuffled
    order = np.lexsort(seen.T[::-1])
    np.testing.assert_array_equal(seen[order], all_rows[np.lexsort(all_rows.T[::-1])])


def test_read_time_cap_and_eval_limits(tmp_path: Path) -> None:
    days = [make_rows(100, s) for s in (8, 9, 10)]
    paths = [tmp_path / f"d{i}" for i in range(3)]
    for p, rows in zip(paths, days, strict=True):
        p.write_bytes(format_criteo_text(*rows))
    out = tmp_path / "out"
    manifest = run(paths, out)  # uncapped: the raw 32-bit ids, like torchrec's tsv_to_npys
    assert_day(out, 0, expected(*days[0], cap=None))
    assert max(manifest["sparse"]["cardinalities"]) > 2**31
    with pytest.raises(CriteoDataError, match="max_rows_per_table"):
        build_splits(CriteoData(path=out))
    cfg = CriteoData(
        path=out,
        train_days=[0],
        val_days=[1],
        test_days=[2],
        max_rows_per_table=77,
        max_val_rows=30,
    )
    splits = build_splits(cfg)
    assert splits.cardinalities == [77] * 26
    assert (splits.train.num_rows, splits.val.num_rows, splits.test.num_rows) == (100, 30, 100)
    np.testing.assert_array_equal(
        splits.test.read(0, 100).sparse, expected(*days[2], cap=None)["sparse"] % 77
    )


def test_same_output_whatever_the_blocks_and_threads(tmp_path: Path) -> None:
    lab, ints, cats = make_rows(1500, 11)
    text = format_criteo_text(lab, ints, cats)
    lines = text.split(b"\n")
    lines[7] = lines[7].rstrip(b"\t")  # some rows with stripped trailing fields
    lines[900] = b"\t".join(lines[900].split(b"\t")[:20])
    (tmp_path / "in.tsv").write_bytes(b"\n".join(lines))
    outs = []
    for i, (block, workers) in enumerate(((1 << 20, 1), (20_000, 3), (2000, 2))):
        outs.append(tmp_path / f"out{i}")
        m = run([tmp_path / "in.tsv"], outs[-1], block_bytes=block, workers=workers)
        assert m["inputs"][0]["padded_rows"] >= 1
    ref = load_day(outs[0], 0)
    for out in outs[1:]:
        for kind, arr in load_day(out, 0).items():
            np.testing.assert_array_equal(arr, ref[kind])


def test_matches_torchrec_tsv_to_npys(tmp_path: Path) -> None:
    """Same layout, dtypes and values as torchrec's own converter (uncapped ids)."""
    from torchrec.datasets.criteo import BinaryCriteoUtils

    lab, ints, cats = make_rows(300, 12)
    (tmp_path / "day_0").write_bytes(format_criteo_text(lab, ints, cats))
    ref = {k: tmp_path / f"ref_{k}.npy" for k in ("dense", "sparse", "labels")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        BinaryCriteoUtils.tsv_to_npys(
            str(tmp_path / "day_0"), str(ref["dense"]), str(ref["sparse"]), str(ref["labels"])
        )
    run([tmp_path / "day_0"], tmp_path / "out")
    got = load_day(tmp_path / "out", 0)
    for kind, path in ref.items():
        want = np.load(path)
        assert got[kind].dtype == want.dtype and got[kind].shape == want.shape, kind
        np.testing.assert_array_equal(got[kind], want, err_msg=kind)


# -------------------------------------------------------------------------- parse rules
ROW = ["1", "5", "-2", "", "0"] + [""] * 9 + ["68fd1e64", "", "0000000a"] + [""] * 23
ROW_NAMES = [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
HEX = 0x68FD1E64


def line(fields: list[str], sep: str = "\t") -> str:
    return sep.join(fields)


def test_parsing_rules_on_written_lines(tmp_path: Path) -> None:
    full = line(ROW)
    lines = [
        full,  # 1: empty fields in many columns
        "",  # 2: a blank line is skipped
        line(["0"] + [""] * 13 + ["ABCDEF01"]),  # 3: trailing empty fields stripped
        line(["", "-7"] + [""] * 38),  # 4: empty label (-> 0, counted), I1 below the floor
        "1",  # 5: everything but the label stripped
    ]
    (tmp_path / "in.txt").write_bytes(("\r\n".join(lines) + "\r\n").encode())
    out = tmp_path / "out"
    m = run([tmp_path / "in.txt"], out)
    rec = m["inputs"][0]
    assert (
        rec["rows"],
        rec["padded_rows"],
        rec["missing_labels"],
        rec["clamped_dense_values"],
    ) == (
        4,
        2,
        1,
        1,
    )
    got = load_day(out, 0)
    np.testing.assert_array_equal(got["labels"][:, 0], [1, 0, 0, 1])
    log5 = np.log(np.float32(5))  # a missing count is 0: log(0 - -3 + 2)
    # line 1: counts 5, -2, missing, 0, missing...
    np.testing.assert_array_equal(got["dense"][0, :4], np.log(np.float32([10, 3, 5, 5])))
    np.testing.assert_array_equal(got["dense"][0, 4:], np.full(9, log5))
    np.testing.assert_array_equal(got["dense"][1], np.full(13, log5))
    np.testing.assert_array_equal(got["dense"][2, 0], np.log(np.float32(2)))  # -7 -> -3 -> log 2
    np.testing.assert_array_equal(got["dense"][2, 1:], np.full(12, log5))
    np.testing.assert_array_equal(got["sparse"][0, :3], [HEX, 0, 10])
    np.testing.assert_array_equal(got["sparse"][1, 0], 0xABCDEF01)
    assert not got["sparse"][1, 1:].any() and not got["sparse"][2:].any()


def test_integral_floats_parse_as_integers_deepctr_csv(tmp_path: Path) -> None:
    """DeepCTR's Criteo sample writes counts as floats (``260.0``, empty for missing) under a
    ``label,I1..I13,C1..C26`` header: every row is kept and equals its integer twin; a count that
    is not integral (``1.5``) is still refused, naming the field and line."""
    lab, ints, cats = make_rows(300, 9)
    text = format_criteo_text(lab, ints, cats, ",")
    rows = []
    for i, row in enumerate(text.decode().splitlines()):
        f = row.split(",")
        f[0] = f"{f[0]}.0" if i % 3 == 0 else f[0]  # a float label now and then
        f[1:14] = [v if v == "" else (f"{v}.0" if i % 2 else f"{v}.") for v in f[1:14]]
        rows.append(",".join(f))
    names = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
    header = ",".join(names)
    assert sum(v.endswith(".0") for v in rows[1].split(",")[1:14]) >= 5
    (tmp_path / "criteo_sample.txt").write_text("\n".join([header, *rows]) + "\n")
    m = run([tmp_path / "criteo_sample.txt"], tmp_path / "out", max_rows_per_table=CAPS)
    assert (m["rows"], m["bad_rows"], m["inputs"][0]["header"]) == (300, 0, True)
    assert_day(tmp_path / "out", 0, expected(lab, ints, cats))

    f = rows[1].split(",")
    f[3] = "1.5"
    (tmp_path / "half.txt").write_text("\n".join([header, rows[0], ",".join(f)]) + "\n")
    with pytest.raises(MalformedRowError, match=r"half.txt:3: I3: not an integer"):
        run([tmp_path / "half.txt"], tmp_path / "out2")


def test_unlabeled_rows_and_header_and_gzip_members(tmp_path: Path) -> None:
    header = line(["label"] + [f"int_{i}" for i in range(13)] + [f"cat_{i}" for i in range(26)])
    part1 = gzip.compress(f"{header}\n{line(ROW)}\n".encode())
    part2 = gzip.compress(f"{line(ROW)}\n".encode())
    (tmp_path / "two_members").write_bytes(part1 + part2)  # cat a.gz b.gz
    test_rows = [line(ROW[1:]), line(ROW[1:15])]  # 39 fields; and one stripped
    (tmp_path / "test.txt").write_text("\n".join(test_rows) + "\n")
    out = tmp_path / "out"
    m = run([tmp_path / "two_members", tmp_path / "test.txt"], out)
    assert [(i["gzip"], i["header"], i["labeled"], i["rows"]) for i in m["inputs"]] == [
        (True, True, True, 2),
        (False, False, False, 2),
    ]
    assert [d["labeled"] for d in m["days"]] == [True, False]
    unlabeled = load_day(out, 1)
    np.testing.assert_array_equal(unlabeled["labels"][:, 0], [-1, -1])
    np.testing.assert_array_equal(unlabeled["sparse"][:, 0], [HEX, HEX])
    np.testing.assert_array_equal(load_day(out, 0)["sparse"][:, 0], [HEX, HEX])
    with pytest.raises(CriteoDataError, match="day 1 has no labels"):
        build_splits(CriteoData(path=out, train_days=[0], val_days=[1], test_days=[1]))


def test_hex_ids_of_any_length_up_to_16_digits() -> None:
    import pyarrow as pa

    values = [b"1a", b"", b"FFFFFFFFFFFFFFFF", b"0", b"68fd1e64", None]
    got = decode_hex(pa.array(values, pa.binary()))
    want = [0x1A, 0, 2**64 - 1, 0, HEX, 0]
    assert got.tolist() == want
    assert decode_hex(pa.array([b"68fd1e64", None, b"0000000A"], pa.binary())).tolist() == [
        HEX,
        0,
        10,
    ]


def test_pad_short_lines_leaves_blank_and_full_lines_alone() -> None:
    from dlrm_vrgd.data.criteo.format import Layout
    from dlrm_vrgd.data.criteo.parse import pad_short_lines

    layout = Layout("x", ",", has_header=False, has_id=False, labeled=True, gzip=False)
    full = ",".join(ROW)
    block = f"{full}\n\n1,2\n{full},x\n0\n".encode()
    padded, count = pad_short_lines(block, layout)
    assert count == 2
    assert padded.split(b"\n") == [
        full.encode(),
        b"",
        b"1,2" + b"," * 38,
        f"{full},x".encode(),  # too long: left for the reader to report
        b"0" + b"," * 39,
        b"",
    ]


def test_labels_option_overrides_the_guess(tmp_path: Path) -> None:
    # every row lost its empty C26: 39 fields, so the guess is "unlabeled"
    rows = [line(ROW[:-1]), line(ROW[:-1])]
    (tmp_path / "in").write_text("\n".join(rows) + "\n")
    m = run([tmp_path / "in"], tmp_path / "guess")
    assert m["inputs"][0]["labeled"] is False
    m = run([tmp_path / "in"], tmp_path / "told", labels="yes")
    assert m["inputs"][0]["labeled"] is True
    assert load_day(tmp_path / "told", 0)["labels"][:, 0].tolist() == [1, 1]


# ---------------------------------------------------------------------------- malformed
def _bad(fields: list[str]) -> str:
    return line(fields)


MALFORMED = {
    "too_many_fields": (_bad(ROW + ["x"]), "expected 40 fields (label, I1-I13, C1-C26), found 41"),
    "non_hex_id": (_bad(ROW[:14] + ["68fd1g64"] + ROW[15:]), "C1: not a hexadecimal"),
    "hex_too_long": (
        _bad(ROW[:16] + ["1" * 17] + ROW[17:]),
        "C3: not a hex",
    ),
    "non_integer_count": (_bad(ROW[:3] + ["1.5"] + ROW[4:]), "I3: not an integer"),
    "count_with_letters": (_bad(ROW[:13] + ["12abc"] + ROW[14:]), "I13: not an integer"),
    "int64_overflow": (_bad(ROW[:2] + ["9" * 19] + ROW[3:]), "I2: not a 64-bit integer"),
    "label_not_0_or_1": (_bad(["2"] + ROW[1:]), "label: not 0 or 1"),
    "label_not_a_number": (_bad(["yes"] + ROW[1:]), "label: not 0 or 1"),
    "stray_carriage_return": (_bad(ROW[:5] + ["1\r2"] + ROW[6:]), "carriage return inside a line"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_row_names_file_and_line_and_leaves_nothing(tmp_path: Path, case: str) -> None:
    bad, reason = MALFORMED[case]
    good = line(ROW)
    # the bad row is line 6 (after a blank line), in the second of several small blocks
    text = "\n".join([good, good, "", good, good, bad, good, good]) + "\n"
    path = tmp_path / "day_0"
    path.write_text(text, newline="")
    out = tmp_path / "out"
    with pytest.raises(MalformedRowError) as err:
        run([path], out, block_bytes=300)
    assert str(err.value).startswith(f"{path}:6: {reason}")
    assert "--skip-bad-rows" in str(err.value)
    assert (err.value.path, err.value.line) == (str(path), 6)
    assert leftovers(tmp_path, {"day_0"}) == []

    m = run([path], out, skip_bad_rows=True, block_bytes=300)
    assert (m["rows"], m["bad_rows"]) == (6, 1)
    assert m["bad_row_examples"][0]["line"] == 6
    assert m["bad_row_examples"][0]["reason"].startswith(reason)
    np.testing.assert_array_equal(load_day(out, 0)["sparse"][:, 0], [HEX] * 6)


def test_first_malformed_line_is_reported(tmp_path: Path) -> None:
    bad_value = line(ROW[:14] + ["zz"] + ROW[15:])
    too_long = line(ROW + ["1"])
    (tmp_path / "in").write_text("\n".join([line(ROW), bad_value, too_long]) + "\n")
    with pytest.raises(MalformedRowError, match=r":2: C1: not a hex"):
        run([tmp_path / "in"], tmp_path / "out")


@pytest.mark.parametrize(
    "name, data, message",
    [
        # mtime=0: the bytes, and so the test's id, must not depend on the clock, or the
        # pytest-xdist workers collect different tests and the run stops
        ("truncated.gz",
         gzip.compress(("\n".join([line(ROW)] * 200) + "\n").encode(), mtime=0)[:-30],
         "gzip stream ends early"),
        ("corrupt.gz", b"\x1f\x8b\x08\x00" + b"\x00" * 40, "corrupt gzip data"),
        ("header.csv", b"Id,Label,I1,I2\n1,0,1,2\n", "unrecognized header"),
        ("blob.bin", b"\x00" * 100, "neither tabs nor commas"),
    ],
    ids=["truncated.gz", "corrupt.gz", "header.csv", "blob.bin"],
)  # fmt: skip
def test_unreadable_inputs_leave_nothing(
    tmp_path: Path, name: str, data: bytes, message: str
) -> None:
    (tmp_path / name).write_bytes(data)
    with pytest.raises(CriteoFormatError, match=message):
        run([tmp_path / name], tmp_path / "out")
    assert leftovers(tmp_path, {name}) == []


def test_unlabeled_file_with_a_labeled_row_is_malformed(tmp_path: Path) -> None:
    # the guess reads the first block only (2 lines here)
    (tmp_path / "test.txt").write_text("\n".join([line(ROW[1:])] * 5 + [line(ROW)]) + "\n")
    with pytest.raises(MalformedRowError, match=r":6: expected 39 fields .* pass --labels yes"):
        run([tmp_path / "test.txt"], tmp_path / "out", block_bytes=150)


# ------------------------------------------------------------------ atomic output, reuse
def test_interrupted_run_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dlrm_vrgd.data.criteo import preprocess as preprocess_module

    (tmp_path / "in").write_text("\n".join([line(ROW)] * 400) + "\n")
    calls = 0
    real = preprocess_module.parse_block

    def interrupted(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(preprocess_module, "parse_block", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run([tmp_path / "in"], tmp_path / "out", block_bytes=2000)
    assert leftovers(tmp_path, {"in"}) == []


def test_a_killed_runs_staging_is_ignored_then_removed(tmp_path: Path) -> None:
    (tmp_path / "in").write_text(line(ROW) + "\n")
    dead = tmp_path / ".out.partial-999999999"  # no such process
    dead.mkdir()
    (dead / "day_0_dense.npy").write_bytes(b"half")
    with pytest.raises(CriteoDataError, match="no manifest.json"):
        CriteoDays(tmp_path / "out")  # nothing to trust under the real name
    run([tmp_path / "in"], tmp_path / "out")
    assert leftovers(tmp_path, {"in"}) == ["out"]


def test_overwrite_rules(tmp_path: Path) -> None:
    (tmp_path / "in").write_text(line(ROW) + "\n")
    out = tmp_path / "out"
    run([tmp_path / "in"], out, max_rows_per_table=10)
    with pytest.raises(FileExistsError, match="--overwrite"):
        run([tmp_path / "in"], out)
    run([tmp_path / "in"], out, overwrite=True)
    assert json.loads((out / MANIFEST).read_text())["sparse"]["max_rows_per_table"] is None
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="refusing to replace"):
        run([tmp_path / "in"], other, overwrite=True)
    assert (other / "notes.txt").read_text() == "keep me"
    assert leftovers(tmp_path, {"in", "out", "mine"}) == []


def test_reader_refuses_altered_files(tmp_path: Path) -> None:
    lab, ints, cats = make_rows(100, 13)
    for i in range(2):
        (tmp_path / f"d{i}").write_bytes(format_criteo_text(lab, ints, cats))
    out = tmp_path / "out"
    run([tmp_path / "d0", tmp_path / "d1"], out, max_rows_per_table=CAPS)
    sparse = out / "day_1_sparse.npy"
    data = bytearray(sparse.read_bytes())
    data[-1] ^= 1  # same size, one bit flipped
    sparse.write_bytes(bytes(data))
    CriteoDays(out)  # sizes and shapes still agree
    with pytest.raises(CriteoDataError, match="SHA-256 differs"):
        CriteoDays(out, verify_checksums=True)
    with open(sparse, "r+b") as f:
        f.truncate(len(data) - 8)
    with pytest.raises(CriteoDataError, match="truncated or replaced"):
        CriteoDays(out)


# -------------------------------------------------------------- options and semantics
def test_frequency_threshold_compacts_ids(tmp_path: Path) -> None:
    # C1 values (cap 100): 5 (x3), 105 (x1: same row as 5 after the cap), 7 (x2), 9 (x1)
    c1 = ["5", "5", "69", "7", "7", "9", "5"]  # hex 69 = 105
    rows = [line(["0"] + [""] * 13 + [c] + [""] * 25) for c in c1]
    (tmp_path / "in").write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    m = run([tmp_path / "in"], out, max_rows_per_table=100, frequency_threshold=3)
    # kept (count >= 3): capped id 5 (4 times) and missing C2..C26 = 0 (7 times)
    assert load_day(out, 0)["sparse"][:, 0].tolist() == [1, 1, 1, 0, 0, 0, 1]
    assert m["sparse"]["cardinalities"] == [2] + [2] * 25
    m = run([tmp_path / "in"], tmp_path / "f2", max_rows_per_table=100, frequency_threshold=2)
    assert load_day(tmp_path / "f2", 0)["sparse"][:, 0].tolist() == [1, 1, 1, 2, 2, 0, 1]
    assert m["sparse"]["cardinalities"][0] == 3
    with pytest.raises(ValueError, match="needs --max-rows-per-table"):
        run([tmp_path / "in"], tmp_path / "x", frequency_threshold=3)


def test_rows_per_day_and_per_table_caps(tmp_path: Path) -> None:
    lab, ints, cats = make_rows(250, 14)
    (tmp_path / "train.txt").write_bytes(format_criteo_text(lab, ints, cats))
    caps = list(range(50, 76))
    out = tmp_path / "out"
    m = run(
        [tmp_path / "train.txt"], out, rows_per_day=100, max_rows_per_table=",".join(map(str, caps))
    )
    assert [(d["rows"], d["source"]["rows"]) for d in m["days"]] == [
        (100, [0, 100]),
        (100, [100, 200]),
        (50, [200, 250]),
    ]
    want = expected(lab, ints, cats, cap=None)["sparse"] % np.array(caps)
    got = np.concatenate([load_day(out, d)["sparse"] for d in range(3)])
    np.testing.assert_array_equal(got, want)
    assert m["sparse"]["cardinalities"] == caps
    with pytest.raises(ValueError, match="one positive N or 26"):
        run([tmp_path / "train.txt"], tmp_path / "o2", max_rows_per_table="5,6")


def test_directory_input_is_read_in_natural_order(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in (10, 2, 1):
        (raw / f"day_{i}").write_text(line([str(i % 2)] + ROW[1:]) + "\n")
    m = run([raw], tmp_path / "out")
    assert [Path(i["path"]).name for i in m["inputs"]] == ["day_1", "day_2", "day_10"]


def test_empty_inputs_make_no_day(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "header_only.csv").write_text(",".join(["Label", *ROW_NAMES]) + "\n")
    (tmp_path / "day").write_text(line(ROW) + "\n")
    inputs = [tmp_path / "empty", tmp_path / "day", tmp_path / "header_only.csv"]
    m = run(inputs, tmp_path / "out")
    assert [(d["day"], d["source"]["input"]) for d in m["days"]] == [(0, 1)]
    assert [i["rows"] for i in m["inputs"]] == [0, 1, 0]
    assert "empty: no rows" in caplog.text
    with pytest.raises(CriteoFormatError, match="no rows"):
        run([tmp_path / "empty"], tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_split_config_errors_name_the_field(tmp_path: Path) -> None:
    (tmp_path / "in").write_text("\n".join([line(ROW)] * 10) + "\n")
    out = tmp_path / "out"
    run([tmp_path / "in"], out, max_rows_per_table=10)
    with pytest.raises(CriteoDataError, match="data.train_days: .* single labeled day"):
        build_splits(CriteoData(path=out))
    with pytest.raises(CriteoDataError, match="data.val_days: day 3 is not in"):
        build_splits(CriteoData(path=out, train_days=[0], val_days=[3]))
    with pytest.raises(ValueError, match="val_days \\[0\\] are also train_days"):
        CriteoData(path=out, train_days=[0], val_days=[0])
    with pytest.raises(CriteoDataError, match="no manifest.json"):
        build_splits(CriteoData(path=tmp_path))


def test_staging_dir_sits_next_to_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While running, the only thing next to OUT is the hidden staging directory."""
    from dlrm_vrgd.data.criteo import output

    seen: list[list[str]] = []
    real = output.publish

    def spy(staging: Path, out: Path) -> None:
        seen.append(sorted(os.listdir(staging)))
        assert not out.exists()
        real(staging, out)

    monkeypatch.setattr("dlrm_vrgd.data.criteo.preprocess.publish", spy)
    (tmp_path / "in").write_text(line(ROW) + "\n")
    run([tmp_path / "in"], tmp_path / "out")
    assert seen == [sorted([MANIFEST] + [f"day_0_{k}.npy" for k in ("dense", "labels", "sparse")])]


def test_parse_options_defaults() -> None:
    assert ParseOptions().dense_floor == -3 and ParseOptions().caps is None
