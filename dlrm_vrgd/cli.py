"""``dlrm-vrgd``: train, generate synthetic data, run the demo."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

from dlrm_vrgd.config import ConfigError, TrainConfig, load_config

REPO = Path(__file__).resolve().parent.parent


class ProgressLine:
    """A live progress bar for the terminal: step, loss, last AUC (and oracle), rows/s."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.bar: Any = None
        self.last_auc: str = "-"

    def on_start(self, info: dict[str, Any]) -> None:
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
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(
                f"loss {record['loss']:.4f} auc {self.last_auc} "
                f"{record['rows_per_s'] / 1000:.1f}k rows/s",
                refresh=False,
            )

    def on_eval(self, record: dict[str, Any]) -> None:
        oracle = record.get("oracle_auc")
        self.last_auc = f"{record['auc']:.4f}" + (f"/{oracle:.4f}" if oracle else "")
        if self.bar is not None:
            self.bar.set_postfix_str(f"{record['split']} auc {self.last_auc}")

    def on_end(self, result: Any) -> None:
        if self.bar is not None:
            self.bar.close()


def _print_result(result: Any) -> None:
    val, test = result.val, result.test
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
    if result.out_dir is not None:
        print(f"run directory: {result.out_dir}")


def cmd_train(args: argparse.Namespace) -> int:
    from dlrm_vrgd.train.loop import train

    cfg = load_config(args.config, args.set)
    result = train(cfg, args.out, callbacks=[ProgressLine()], resume=args.resume)
    _print_result(result)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from dlrm_vrgd.train.loop import train

    cfg = load_config(REPO / "configs" / "demo.yaml", args.set)
    out = Path(args.out or REPO / "runs" / time.strftime("demo-%Y%m%d-%H%M%S"))
    print(f"demo: {cfg.run.global_batch}-row global batches on synthetic Criteo -> {out}")
    result = train(cfg, out, callbacks=[ProgressLine()])
    _print_result(result)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from dlrm_vrgd.data.export import export_split

    cfg = load_config(args.config, args.set)
    for split in args.split:
        paths = export_split(cfg, split, Path(args.out))
        print(f"{split}: " + ", ".join(str(p) for p in paths))
    return 0


def cmd_show_config(args: argparse.Namespace) -> int:
    import yaml

    cfg: TrainConfig = load_config(args.config, args.set)
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlrm-vrgd", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp: argparse.ArgumentParser, required: bool = True) -> None:
        sp.add_argument("--config", required=required, help="YAML TrainConfig")
        sp.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config value, e.g. optim.dense.lr=0.1 (repeatable)",
        )

    t = sub.add_parser("train", help="train a model; writes a run directory")
    with_config(t)
    t.add_argument("--out", required=True, help="run directory")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    t.set_defaults(fn=cmd_train)

    d = sub.add_parser("demo", help="train configs/demo.yaml and print AUC beside the oracle")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    d.add_argument("--out", help="run directory (default runs/demo-TIMESTAMP)")
    d.set_defaults(fn=cmd_demo)

    g = sub.add_parser("generate", help="write synthetic splits as npy files")
    with_config(g)
    g.add_argument("--split", action="append", choices=["train", "val", "test"], required=True)
    g.add_argument("--out", required=True, help="output directory")
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("config", help="print the resolved config")
    with_config(c, required=False)
    c.set_defaults(fn=cmd_show_config)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # torchrec's import trips torch.fx's "is_fx_tracing" notice: noise for our users.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    try:
        return args.fn(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
