"""Read TensorBoard event files back with tensorboard's own reader (EventAccumulator)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="the tensorboard package (dev extra) reads the event files back",
)


def accumulator(logdir: Path) -> Any:
    acc = event_accumulator.EventAccumulator(
        str(logdir),
        size_guidance={
            event_accumulator.SCALARS: 0,
            event_accumulator.TENSORS: 0,
            event_accumulator.HISTOGRAMS: 0,  # all of them (the default keeps one)
        },
    )
    acc.Reload()
    return acc


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] in file order (a step written twice shows twice)."""
    acc = accumulator(logdir)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def f32(value: float) -> float:
    """What an event's simple_value holds for ``value``."""
    return float(np.float32(value))


def hparams(logdir: Path) -> tuple[dict[str, Any], list[str]]:
    """The HParams plugin's session-start hparams and the experiment's metric tags."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = accumulator(logdir)
    content = acc.PluginTagToContent("hparams")
    params: dict[str, Any] = {}
    metrics: list[str] = []
    for raw in content.values():
        data = plugin_data_pb2.HParamsPluginData.FromString(raw)
        if data.HasField("session_start_info"):
            for key, value in data.session_start_info.hparams.items():
                kind = value.WhichOneof("kind")
                params[key] = getattr(value, kind)
        if data.HasField("experiment"):
            metrics = [m.name.tag for m in data.experiment.metric_infos]
    return params, metrics


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
