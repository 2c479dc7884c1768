"""``dlrm-vrgd export``: a run's checkpoint as a model directory, optionally logged to (and
registered in) the run's own MLflow run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dlrm_vrgd.cli.common import examples, require_extra


def add_export(sub: argparse._SubParsersAction) -> None:
    ex = sub.add_parser("export", help="a run's checkpoint -> a model directory (plain PyTorch)")
    ex.add_argument("--run", required=True, help="run directory (its checkpoints/)")
    ex.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    ex.add_argument(
        "--best", action="store_true", help="the best-validation checkpoint (checkpoints/best.json)"
    )
    ex.add_argument("--out", required=True, help="model directory (appears when complete)")
    ex.add_argument("--overwrite", action="store_true", help="replace an earlier --out")
    ex.add_argument("--no-program", action="store_true", help="skip the torch.export model.pt2")
    ex.add_argument(
        "--format",
        choices=["pt2", "onnx", "all"],
        default="pt2",
        help="programs beside the weights: torch.export .pt2 (default), ONNX + a Triton "
        "model repository, or both",
    )
    ex.add_argument(
        "--mlflow",
        action="store_true",
        help="also log the model to the run's MLflow run (trained with run.mlflow)",
    )
    ex.add_argument(
        "--register-model",
        metavar="NAME",
        help="with --mlflow (implied): register it as NAME (default: run.mlflow.register_model)",
    )
    ex.set_defaults(fn=cmd_export)
    examples(
        ex,
        "A run's checkpoint (the newest, --step N, or --best) as a model directory that "
        "scores without the trainer.",
        "dlrm-vrgd export --run runs/criteo_small --best --out models/criteo_small",
        "dlrm-vrgd export --run runs/demo --out models/demo --format onnx",
    )


def cmd_export(args: argparse.Namespace) -> int:
    """A refusal raises ValueError (``main``: ``error: ...``, exit 2) before anything is
    written."""
    from dlrm_vrgd.serve.export import export_model

    step = args.step
    if args.best:
        from dlrm_vrgd.checkpoint import BEST, CheckpointError, best_checkpoint

        if step is not None:
            raise ValueError("--best and --step name two checkpoints: pass one")
        try:
            step = int(best_checkpoint(Path(args.run)).name.removeprefix("step_"))
        except CheckpointError as err:
            raise ValueError(f"--best: {err}") from None
        print(f"the best-validation checkpoint (checkpoints/{BEST}): step {step}")
    if args.format in ("onnx", "all"):  # the extras are checked before anything is written
        require_extra(f"export --format {args.format}", "onnx", "onnx", "onnxscript")
    if args.mlflow or args.register_model:
        require_extra("export --mlflow", "tracking", "mlflow")
    target = None
    if args.mlflow or args.register_model:  # checked before anything is written
        target = _mlflow_target(Path(args.run))
    if args.no_program and args.format != "pt2":
        raise ValueError("--no-program writes no program: it takes no --format")
    program = not args.no_program and args.format in ("pt2", "all")
    result = export_model(
        args.run, args.out, step, program=program, overwrite=args.overwrite,
        onnx=args.format in ("onnx", "all"),
    )  # fmt: skip
    written = [p for p in Path(result.out).rglob("*") if p.is_file()]  # the manifest too
    size = sum(p.stat().st_size for p in written)
    print(
        f"exported step {result.step} ({result.world_size} rank(s)) of {args.run} -> "
        f"{result.out} ({len(written)} files, {size / 1e6:,.1f} MB)"
    )
    if target is not None:
        return _export_to_mlflow(*target, result.out, args.register_model)
    return 0


def _mlflow_target(run: Path) -> tuple[Any, str]:
    """The run's own MLflow run for ``export --mlflow``: its ``config.json``'s ``run.mlflow``
    and ``result.json``'s ``mlflow.run_id`` (ValueError when it has none)."""
    from pydantic import ValidationError

    from dlrm_vrgd.config import MlflowConfig

    try:
        stored = json.loads((run / "result.json").read_text())
        run_id = stored["mlflow"]["run_id"]
        cfg = MlflowConfig.model_validate(
            json.loads((run / "config.json").read_text())["run"]["mlflow"]
        )
    except (OSError, ValueError, KeyError, TypeError, ValidationError) as err:
        raise ValueError(
            f"--mlflow: {run} has no MLflow run to log to (result.json's mlflow.run_id "
            f"and config.json's run.mlflow; train it with run.mlflow set): {type(err).__name__}"
        ) from None
    if not isinstance(run_id, str):
        raise ValueError(f"--mlflow: {run}/result.json: mlflow.run_id is not a string")
    return cfg, run_id


def _export_to_mlflow(cfg: Any, run_id: str, model_dir: Path, name: str | None) -> int:
    """``export --mlflow``: the model directory into the run's MLflow run, registered as
    ``name`` (else ``run.mlflow.register_model``)."""
    from dlrm_vrgd.redact import redact
    from dlrm_vrgd.tracking.mlflow_sink import _client, log_model

    try:
        fields = log_model(_client(cfg), run_id, model_dir, name or cfg.register_model)
    except Exception as err:
        print(f"error: MLflow at {redact(cfg.tracking_uri)}: {type(err).__name__}: "
              f"{redact(str(err))}", file=sys.stderr)  # fmt: skip
        return 1
    line = f"MLflow run {run_id}: logged {fields['model_uri']}"
    if "registered_model" in fields:
        reg = fields["registered_model"]
        line += f", registered as {reg['name']!r} version {reg['version']}"
    print(line)
    return 1 if "registry_error" in fields else 0
