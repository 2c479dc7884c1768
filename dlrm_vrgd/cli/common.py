"""What the commands share: ``--config`` / ``--set``, the examples of ``CMD -h``, the live
progress line, and a finished run's result as printed (with what a user should not miss)."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

#: The checkout (``configs/``, ``runs/``): the default places of ``demo`` and ``study``.
REPO = Path(__file__).resolve().parents[2]

#: The ``--set`` help of the commands that read a TrainConfig.
SET_HELP = (
    "override a config value, e.g. --set run.steps=100 or --set optim.dense.lr=0.1 "
    "(repeatable; the value is YAML: null, [64, 16]; run.steps replaces the file's "
    "run.epochs and the other way round)"
)


def add_set(parser: argparse.ArgumentParser, help: str = SET_HELP) -> None:
    """``--set KEY=VALUE`` (repeatable): ``args.set`` is the list, in order."""
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=help)


def add_config(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """``--config`` (a YAML TrainConfig) and its ``--set`` overrides."""
    parser.add_argument("--config", required=required, help="YAML TrainConfig")
    add_set(parser)


def examples(parser: argparse.ArgumentParser, description: str, *lines: str) -> None:
    """``CMD -h`` opens with ``description`` and ends with the example command ``lines``."""
    parser.description = textwrap.fill(description, 88)
    parser.epilog = "examples:\n" + "\n".join(f"  {e}" for e in lines)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


class ProgressLine:
    """A live progress bar for the terminal: step, loss, last AUC (and oracle), rows/s, and the
    share of the step spent waiting for input (``input wait 12%``: the GPU starving) where the
    step waited at least 0.5% of its time.

    Not on a terminal (a log file: the service's jobs, Slurm's output), it writes a plain line
    at most every ``PROGRESS_EVERY_S`` seconds (``DLRM_VRGD_PROGRESS_EVERY_S``, default 10)
    instead of carriage-return redraws, so that every line of a log is whole (and keeps its
    rank label under ``srun --label``)."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.bar: Any = None
        self.last_auc: str = "-"
        isatty = getattr(self.stream, "isatty", None)
        self.plain = not (isatty and isatty())
        self.every_s = float(os.environ.get("DLRM_VRGD_PROGRESS_EVERY_S", "10"))
        self._printed = -float("inf")
        self._total = 0

    def on_start(self, info: dict[str, Any]) -> None:
        self._total = info["total_steps"]
        if self.plain:
            return
        from tqdm import tqdm

        self.bar = tqdm(
            total=info["total_steps"],
            initial=info["start_step"],
            unit="step",
            file=self.stream,
            dynamic_ncols=True,
            desc=f"G={info['global_batch']} ({info['accumulation']}x{info['micro_batch']})",
        )

    def on_step(self, record: dict[str, Any]) -> None:
        if self.plain:
            now = time.monotonic()
            if now - self._printed >= self.every_s or record["step"] == self._total:
                self._printed = now
                self._line(
                    f"step {record['step']}/{self._total} loss {record['loss']:.4f} "
                    f"auc {self.last_auc} {record['rows_per_s'] / 1000:.1f}k rows/s"
                    + input_wait(record)
                )
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(
                f"loss {record['loss']:.4f} auc {self.last_auc} "
                f"{record['rows_per_s'] / 1000:.1f}k rows/s" + input_wait(record),
                refresh=False,
            )

    def on_eval(self, record: dict[str, Any]) -> None:
        oracle = record.get("oracle_auc")
        self.last_auc = f"{record['auc']:.4f}" + (f"/{oracle:.4f}" if oracle else "")
        if self.plain:
            self._line(f"{record['split']} auc {self.last_auc}")
        elif self.bar is not None:
            self.bar.set_postfix_str(f"{record['split']} auc {self.last_auc}")

    def on_end(self, result: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _line(self, text: str) -> None:
        """One whole line in one write (unbuffered, as in a job, ``print`` writes the text and
        its newline apart, and another writer's bytes may land between them)."""
        self.stream.write(text + "\n")
        self.stream.flush()


def input_wait(record: dict[str, Any]) -> str:
    """`` input wait 12%``: the share of a step spent waiting for its micro-batches (``""``
    below 0.5%, or when the record does not say)."""
    wait, step = record.get("data_wait_s"), record.get("step_seconds")
    if not isinstance(wait, int | float) or not isinstance(step, int | float) or step <= 0:
        return ""
    share = wait / step
    return f" input wait {share:.0%}" if share >= 0.005 else ""


def print_result(result: Any) -> None:
    """A finished run (a ``RunResult``) for people: its figures on stdout, then on stderr the
    :func:`result_warnings`."""
    val, test = result.val, result.test
    if result.already_finished:
        print(
            f"{result.out_dir} finished all {result.steps} steps before ({result.samples:,} "
            "rows): nothing to resume, its result.json is unchanged"
        )
    else:
        print(
            f"trained {result.steps} steps, {result.samples:,} rows at "
            f"{result.rows_per_second:,.0f} rows/s"
        )
    for name, m in (("val", val), ("test", test)):
        line = f"  {name:4s} AUC {m['auc']:.4f}  logloss {m['logloss']:.4f}  NE {m['ne']:.4f}"
        if "oracle_auc" in m:
            gap = m["oracle_auc"] - m["auc"]
            line += f"   oracle AUC {m['oracle_auc']:.4f} (gap {gap:+.4f})"
        print(line)
    target = getattr(result, "target", None)
    if target and target.get("reached"):
        print(
            f"  target AUC {target['target_auc']:g} reached at step {target['step']} "
            f"({target['samples']:,} rows, {target['epochs']:.4g} epochs, "
            f"{target['wall_seconds']:.1f} s wall with evals)"
        )
    elif target:
        print(f"  target AUC {target['target_auc']:g} not reached in {target['evals']} evals")
    if result.out_dir is not None:
        print(f"run directory: {result.out_dir}")
    for warning in result_warnings(result):
        print(f"warning: {warning}", file=sys.stderr)


#: A run whose steps waited this share of their time or more for input is told so at its end.
INPUT_WAIT_WARN = 0.10


def result_warnings(result: Any) -> list[str]:
    """What a user should not miss in a run's final figures: a final model worse than the best
    checkpoint's (overfitting, a learning rate too high), an NE above 1 (worse than predicting
    the click rate for every row), steps that waited for their input (a starved device)."""
    out = []
    share = result.input_wait_share
    if share is not None and share >= INPUT_WAIT_WARN:
        out.append(
            f"the steps waited for their input {share:.0%} of their time (after the first "
            "step): the input, not the model, set the pace. Day files made once "
            "(dlrm-vrgd generate or preprocess) read far faster than live synthetic rows, and "
            "run.input.workers adds builders (docs: Feeding the trainer)"
        )
    best, val = result.best_val, result.val
    if best is not None and val.get("auc") is not None and val["auc"] < best["auc"]:
        line = (
            f"the final model's validation AUC {val['auc']:.4f} is below the best checkpoint's "
            f"{best['auc']:.4f} (step {best['step']}), as the periodic evals measured it (on "
            "run.eval_rows rows of validation)"
        )
        if result.out_dir is not None:
            line += f": export that one with dlrm-vrgd export --run {result.out_dir} --best"
        out.append(line)
    for name, m in (("val", val), ("test", result.test)):
        ne = m.get("ne")
        if isinstance(ne, float) and ne > 1:
            out.append(
                f"{name} NE {ne:.4f} > 1: the model predicts {name} clicks worse than the click "
                "rate alone would (too few rows for this model, overfitting, or a learning "
                "rate too high)"
            )
    return out


#: The optional extras (pyproject.toml's ``[project.optional-dependencies]``): per extra, the
#: top-level modules it installs. ``pip install dlrm-vrgd`` alone is the trainer and the
#: optimizers; a command that needs more names the extra (:func:`require_extra`, and ``main``
#: for an ImportError of one of these modules).
EXTRAS: dict[str, tuple[str, ...]] = {
    "service": ("fastapi", "starlette", "uvicorn", "sqlalchemy", "httpx", "pydantic_settings"),
    "onnx": ("onnx", "onnxscript", "onnx_ir", "onnxruntime"),
    "tracking": ("mlflow", "alembic"),
    "study": ("matplotlib",),
}


class MissingExtra(ImportError):
    """``dlrm-vrgd COMMAND`` needs ``extra``, which is not installed (``main``: exit 2)."""

    def __init__(self, command: str, extra: str, hint: str = "") -> None:
        self.command, self.extra = command, extra
        msg = f"dlrm-vrgd {command} needs the {extra} extra: pip install 'dlrm-vrgd[{extra}]'"
        super().__init__(msg + (f" ({hint})" if hint else ""))


def extra_of(err: BaseException) -> str | None:
    """The extra whose module an ImportError (or one it was raised from) failed to import;
    None where it is no extra's."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MissingExtra):
            return e.extra
        if isinstance(e, ImportError) and e.name:
            top = e.name.partition(".")[0]
            for extra, modules in EXTRAS.items():
                if top in modules:
                    return extra
        e = e.__cause__ or e.__context__
    return None


def require_extra(command: str, extra: str, *modules: str, hint: str = "") -> None:
    """Raise :class:`MissingExtra` unless the extra's ``modules`` (default: the ones the
    command imports first, :data:`EXTRAS`) can be found; checked before a command starts
    work, without importing them."""
    import importlib.util

    for module in modules or EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise MissingExtra(command, extra, hint)
