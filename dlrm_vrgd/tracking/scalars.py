"""What a run's records become as tracked series: ``(tag, value, step)`` triples.

One mapping for every tracker (TensorBoard, MLflow) and for both live writing and rebuilding
from a run directory, so a rebuilt ``tb/`` holds exactly what live writing did. Every numeric
field flows through, so fields added to ``metrics.jsonl`` or ``gsnr.jsonl`` records later are
tracked without a change here. Non-finite values are skipped (JSON stores them as null, so a
rebuild could not reproduce them).

Tags:

- ``train/<field>`` per logged step (loss, lr_dense, lr_sparse, rows_per_s, step_seconds,
  data_wait_s: the step's wait for input, gsnr_ratio, ...),
- ``val/<field>``, ``test/<field>``, ``train_eval/<field>`` per eval (auc beside oracle_auc,
  logloss, ne, calibration, ...),
- ``rows/<the same tag>`` with rows seen (``samples``) as the step, to compare batch sizes,
- ``gsnr/dense/<tensor>/<field>`` and ``gsnr/table/<table>/<field>`` (ratio, frac_clipped,
  raw_gsnr, multi_group_rows, ...),
- ``noise_scale/<model|dense|tables>/<field>`` (b_simple, b_simple_raw, g2, s, g2_raw, s_raw),
  ``noise_scale/tensor/<tensor>/<field>``, ``noise_scale/table/<table>/<field>``, and
  ``noise_scale/global_batch`` (the line B_simple is read against), ``noise_scale/window_steps``,
- ``hparams/<figure>``: the final metrics the hparams summary is set against.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

Scalar = tuple[str, float, int]

#: The field every record gets when it is written (:class:`~dlrm_vrgd.tracking.sink.Sinks`):
#: Unix time in seconds, the wall time of its events (a rebuilt ``tb/`` keeps the run's clock).
WALL_TIME = "wall_time"
#: Eval record fields that say which rows were scored, not how well.
_EVAL_SKIP = {"kind", "split", "step", "samples", "rows", WALL_TIME}
_TRAIN_SKIP = {"kind", "step", "samples", WALL_TIME}
#: gsnr.jsonl entry fields that name the entry or never change.
_GSNR_SKIP = {"name", "table", "numel"}
#: gsnr.jsonl list key -> tag group.
_GSNR_GROUPS = {"dense": "dense", "tables": "table"}
SPLIT_PREFIX = {"train": "train_eval"}
#: The noise scale's aggregate entries.
_NOISE_SCOPES = ("model", "dense", "tables")


def number(value: Any) -> float | None:
    """``value`` as a finite float, or None (bools, strings, null, NaN, Inf)."""
    kind = type(value)
    if kind is float:  # the common case first: this runs ~300 times per step
        return value if math.isfinite(value) else None
    if kind is int:
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def wall_time(record: dict[str, Any], default: float) -> float:
    """The record's ``wall_time``, or ``default`` (records written before it existed)."""
    value = number(record.get(WALL_TIME))
    return default if value is None else value


def metric_scalars(record: dict[str, Any]) -> list[Scalar]:
    """The series of one ``metrics.jsonl`` record (``kind`` train or eval; others: none)."""
    kind = record.get("kind")
    if kind == "train":
        prefix, skip = "train", _TRAIN_SKIP
    elif kind == "eval":
        split = str(record.get("split"))
        prefix, skip = SPLIT_PREFIX.get(split, split), _EVAL_SKIP
    else:
        return []
    step = int(record["step"])
    samples = record.get("samples")
    out: list[Scalar] = []
    rows: list[Scalar] = []
    for key, raw in record.items():
        value = number(raw)
        if key in skip or value is None:
            continue
        out.append((f"{prefix}/{key}", value, step))
        if samples is not None:
            rows.append((f"rows/{prefix}/{key}", value, int(samples)))
    return out + rows


def noise_scalars(noise: dict[str, Any], step: int) -> list[Scalar]:
    """The series of a record's ``noise_scale`` (DESIGN.md 4.6): ``noise_scale/<scope>/<field>``
    for the aggregates (model, dense, tables), ``noise_scale/tensor/<name>/<field>`` and
    ``noise_scale/table/<table>/<field>``, and the run's global batch and the EMA's window."""
    out: list[Scalar] = []
    for key in ("global_batch", "window_steps"):
        value = number(noise.get(key))
        if value is not None:
            out.append((f"noise_scale/{key}", value, step))
    parts: list[tuple[str, Any]] = [(scope, noise.get(scope)) for scope in _NOISE_SCOPES]
    for key, group, name_key in (("per_tensor", "tensor", "name"), ("per_table", "table", "table")):
        entries = noise.get(key)
        if isinstance(entries, list):
            parts += [
                (f"{group}/{e.get(name_key)}", e) for e in entries if isinstance(e, dict)
            ]  # fmt: skip
    for prefix, entry in parts:
        if not isinstance(entry, dict):
            continue
        for field, raw in entry.items():
            value = number(raw)
            if value is not None and field not in _GSNR_SKIP:
                out.append((f"noise_scale/{prefix}/{field}", value, step))
    return out


def gsnr_scalars(record: dict[str, Any]) -> list[Scalar]:
    """The series of one ``gsnr.jsonl`` record: every numeric field of every entry, and the
    noise scale's (:func:`noise_scalars`)."""
    step = int(record["step"])
    out: list[Scalar] = []
    noise = record.get("noise_scale")
    if isinstance(noise, dict):
        out += noise_scalars(noise, step)
    for key, entries in record.items():
        if not isinstance(entries, list):
            continue
        group = _GSNR_GROUPS.get(key, key)
        for entry in entries:
            if not isinstance(entry, dict):
                continue
            name = entry.get("name", entry.get("table"))
            for field, raw in entry.items():
                value = number(raw)
                if field in _GSNR_SKIP or value is None:
                    continue
                out.append((f"gsnr/{group}/{name}/{field}", value, step))
    return out


def final_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The figures of ``result.json`` a run is judged by (keys without the ``hparams/``)."""
    out: dict[str, float] = {}
    for split in ("val", "test", "train"):
        for key, raw in (result.get(split) or {}).items():
            value = number(raw)
            if value is not None and key not in ("step", "samples", "rows"):
                out[f"{split}_{key}"] = value
    extra = {
        "final_loss": result.get("final_loss"),
        "best_val_auc": (result.get("best_val") or {}).get("auc"),
        "rows_per_s": (result.get("timings") or {}).get("rows_per_s"),
        "train_seconds": (result.get("timings") or {}).get("train_seconds"),
    }
    for key, raw in extra.items():
        value = number(raw)
        if value is not None:
            out[key] = value
    return out


def hparam_scalars(result: dict[str, Any]) -> list[Scalar]:
    step = int(result.get("steps") or 0)
    return [(f"hparams/{k}", v, step) for k, v in final_metrics(result).items()]


def flatten(config: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Dotted keys of a nested config; lists become JSON text, None stays None."""
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from flatten(value, path + ".")
        elif isinstance(value, list | tuple):
            yield path, json.dumps(value, separators=(",", ":"))
        else:
            yield path, value
