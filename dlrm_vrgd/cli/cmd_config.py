"""``dlrm-vrgd config``: the config as the trainer reads it."""

from __future__ import annotations

import argparse

from dlrm_vrgd.cli.common import add_config, examples
from dlrm_vrgd.config import load_config


def add_show_config(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("config", help="print the resolved config")
    add_config(c, required=False)
    c.set_defaults(fn=cmd_show_config)
    examples(
        c,
        "The config as the trainer reads it: every default filled in, --set applied.",
        "dlrm-vrgd config --config configs/criteo_small.yaml --set run.steps=30",
    )


def cmd_show_config(args: argparse.Namespace) -> int:
    import yaml

    cfg = load_config(args.config, args.set)
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0
