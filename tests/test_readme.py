"""The README and the documentation pages, as a newcomer reads and pastes them.

The README opens with the two commands a newcomer types, stays a front page, and its tour
(train, watch, export, score) runs from a fresh directory; the commands of docs/ that a
newcomer pastes first (*Run a job* of docs/getting-started.md) run in order and exit 0; the
result line they quote has the format the trainer prints; every curl command of the README and
the docs fails on an HTTP error. Both run against a tiny config written here, standing in for
configs/demo.yaml. The site itself is built by tests/test_docs.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import tiny_config_dict

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.M | re.S)
VENV_BIN = ".venv/bin/"
MAX_README_LINES = 200


def page(name: str) -> str:
    """The text of docs/``name``."""
    return (DOCS / name).read_text()


def doc_pages() -> list[Path]:
    """Every hand-written page of the site (the generated study reports aside)."""
    return sorted(p for p in DOCS.glob("*.md"))


def section(text: str, title: str) -> str:
    """The text of ``## title`` up to the next ``## `` heading."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def commands(text: str) -> list[str]:
    """Shell commands of the fenced shell blocks in ``text``: one per line, comments dropped,
    lines ending in ``|`` or ``\\`` or inside a quoted string joined with the next."""
    out: list[str] = []
    for block in FENCE.findall(text):
        pending = ""
        for raw in block.splitlines():
            line = pending + raw.strip()
            pending = ""
            if not line or line.startswith("#"):
                continue
            if line.endswith(("|", "\\")):
                pending = line.rstrip("\\") + " "
                continue
            if not _complete(line):  # a quoted string goes on on the next line
                pending = line + " "
                continue
            out.append(line)
        assert not pending, f"a command runs past its block: {pending}"
    return out


def _complete(line: str) -> bool:
    try:
        shlex.split(line, comments=True)
    except ValueError:  # "No closing quotation"
        return False
    return True


def localised(cmd: str, config: Path) -> str:
    """The command as it runs here: the tiny config for configs/demo.yaml, the virtualenv of
    this test run for .venv/bin/."""
    bin_dir = Path(sys.executable).parent
    for name in re.findall(re.escape(VENV_BIN) + r"([\w.-]+)", cmd):
        assert (bin_dir / name).exists(), f"{VENV_BIN}{name}: not in {bin_dir}"
    return cmd.replace(VENV_BIN, f"{bin_dir}/").replace("configs/demo.yaml", str(config))


def run_in_order(cmds: list[str], tmp_path: Path) -> tuple[Path, list[str]]:
    """Run ``cmds`` one after another in a fresh directory, each exiting 0; the directory and
    each command's stdout."""
    config = tmp_path / "tiny.yaml"
    config.write_text(
        yaml.safe_dump(tiny_config_dict(run={"eval_every": 2, "checkpoint_every": 2}))
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    work = tmp_path / "newcomer"
    work.mkdir()
    outputs = []
    for cmd in cmds:
        proc = subprocess.run(
            localised(cmd, config),
            shell=True,
            executable="/bin/bash",
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
        outputs.append(proc.stdout)
    return work, outputs


# ------------------------------------------------------------------------------ the README
def test_the_readme_opens_with_make_demo_and_make_test() -> None:
    """Before any other text but the title: one shell block, exactly the two commands."""
    title, rest = README.split("\n", 1)
    assert title.startswith("# ")
    first = FENCE.search(rest)
    assert first and rest[: first.start()].strip() == ""
    assert [c.split("#")[0].strip() for c in commands(first.group(0))] == ["make demo", "make test"]


def test_the_readme_is_a_front_page_whose_links_resolve() -> None:
    assert len(README.splitlines()) <= MAX_README_LINES
    headings = re.findall(r"^## (.+)$", README, re.M)
    assert headings == [
        "What it is, and why",
        "A short tour",
        "The figures that matter",
        "Where to go next",
    ]
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert len(local) >= 20  # every page of the site is reachable from here
    assert [link for link in local if not (ROOT / link).is_file()] == []
    # every hand-written page is linked (the study reports through docs/study/README.md)
    linked = {(ROOT / link).resolve() for link in local}
    pages = {p.resolve() for p in doc_pages() if p.name != "index.md"}
    assert sorted(p.name for p in pages - linked) == []


def test_the_readme_tour_runs_from_a_fresh_directory(tmp_path: Path) -> None:
    """Train (with the VRGD optimizers), advise, export, generate and score, in order;
    `tensorboard` is a server: only its presence in the virtualenv is checked."""
    cmds = commands(section(README, "A short tour"))
    servers = [c for c in cmds if c.startswith(f"{VENV_BIN}tensorboard ")]
    assert len(servers) == 1
    localised(servers[0], tmp_path / "unused.yaml")  # asserts .venv/bin/tensorboard exists
    steps = [c for c in cmds if c not in servers]
    assert [c.split()[1] for c in steps if c.startswith(f"{VENV_BIN}dlrm-vrgd ")] == [
        "train",
        "advise",
        "export",
        "generate",
    ]
    work, outputs = run_in_order(steps, tmp_path)
    run = work / "runs" / "tour"
    assert json.loads((run / "result.json").read_text())["steps"] == 4
    optim = json.loads((run / "config.json").read_text())["optim"]
    assert (optim["dense"]["name"], optim["sparse"]["name"]) == ("vradam", "gsnr_rowwise_adagrad")
    assert "B_simple" in outputs[1]
    assert (work / "models" / "tour" / "manifest.json").is_file()
    probabilities = json.loads(outputs[-1])
    assert len(probabilities) == 5 and all(0.0 < p < 1.0 for p in probabilities)


# ------------------------------------------------------------------------- the docs' pages
@pytest.mark.slow  # trains twice from a fresh directory; the README's tour (in CI) covers the path
def test_run_a_job_commands_run_in_order_from_a_fresh_directory(tmp_path: Path) -> None:
    cmds = commands(section(page("getting-started.md"), "Run a job"))
    # every command uses the demo config, but `advise`, which reads a run the block trained
    assert len(cmds) >= 5 and all("configs/demo.yaml" in c or " advise " in c for c in cmds)
    work, outputs = run_in_order(cmds, tmp_path)
    outs = [Path(o) for c in cmds if " train " in c for o in re.findall(r"--out (\S+)", c)]
    assert len(set(outs)) == 2  # two runs, each in its own directory; the third resumes one
    for out in set(outs):
        assert json.loads((work / out / "result.json").read_text())["steps"] == 4
    resumed = next(o for c, o in zip(cmds, outputs, strict=True) if "--resume" in c)
    assert "nothing to resume" in resumed  # it had finished: the no-op, said so
    lr = json.loads((work / "runs/my-run-lr004/config.json").read_text())["optim"]["dense"]["lr"]
    assert lr == 0.004
    assert list((work / "data" / "demo").glob("*.npy"))
    advice = next(o for c, o in zip(cmds, outputs, strict=True) if " advise " in c)
    assert "B_simple" in advice and "global batch G = 256" in advice


@pytest.mark.parametrize("where", ["README.md", "docs/getting-started.md"])
def test_the_sample_result_line_has_the_demo_output_format(where: str) -> None:
    """The line quoted (README's tour, "Reading AUC" of getting started) is in the form the
    demo prints (service/demo.py's print_result, which `dlrm-vrgd train` shares): AUC, logloss,
    NE, oracle AUC and its gap, the gap being oracle minus AUC."""
    text = (ROOT / where).read_text()
    lines = [x for x in text.splitlines() if x.strip().startswith("test AUC")]
    assert lines
    for line in lines:
        m = re.fullmatch(
            r"  test AUC (0\.\d{4})  logloss (\d\.\d{4})  NE (\d\.\d{4})"
            r"   oracle AUC (0\.\d{4}) \(gap ([+-]0\.\d{4})\)",
            line,
        )
        assert m, line
        auc, oracle, gap = float(m[1]), float(m[4]), float(m[5])
        assert gap == pytest.approx(oracle - auc, abs=1.5e-4)


def test_every_dlrm_vrgd_command_of_the_readme_and_the_docs_parses() -> None:
    """Every `dlrm-vrgd` command line a page shows names a real subcommand with real options
    (argparse, as the CLI parses them; `jobs` has its own client, which parses on its own)."""
    from dlrm_vrgd.cli import build_parser

    parser = build_parser()
    texts = [README] + [p.read_text() for p in doc_pages()]
    seen = 0
    for text in texts:
        for cmd in commands(text):
            for part in re.split(r"\||&&", cmd):
                if "dlrm-vrgd" not in part:
                    continue
                words = shlex.split(part, comments=True)
                at = next(i for i, w in enumerate(words + [""]) if not re.match(r"\w+=", w))
                program = words[at] if at < len(words) else ""
                if program != "dlrm-vrgd" and not program.endswith("bin/dlrm-vrgd"):
                    continue  # another program (docker compose -p dlrm-vrgd, cd, git clone)
                if words[at + 1 : at + 2] == ["jobs"]:
                    continue
                try:
                    parser.parse_args(words[at + 1 :])
                except SystemExit:
                    pytest.fail(f"does not parse: {part.strip()}")
                seen += 1
    assert seen >= 35


def _curl_fails_on_http_errors(cmd: str) -> bool:
    words = shlex.split(cmd.split("#")[0], posix=True)
    flags = words[words.index("curl") + 1 :]
    short = [w for w in flags if re.fullmatch(r"-[A-Za-z]+", w)]
    return any("f" in w for w in short) or bool({"--fail", "--fail-with-body"} & set(flags))


def test_every_curl_command_of_the_readme_and_the_docs_fails_on_an_http_error() -> None:
    """With -f (or --fail-with-body) a 404 exits non-zero; without, `curl -O` saves the JSON
    error under the file's name and exits 0 (tests/service/api/routes/test_artifacts.py)."""
    texts = [README] + [p.read_text() for p in doc_pages()]
    curls = [
        part.strip()
        for text in texts
        for cmd in commands(text)
        for part in re.split(r"\||\$\(", cmd)
        if re.match(r"\s*curl\s", part)
    ]
    assert len(curls) >= 15
    assert [c for c in curls if not _curl_fails_on_http_errors(c)] == []
    downloads = [c for c in curls if " -O" in c or " -o " in c]
    assert downloads and all("--fail-with-body" not in c for c in downloads)  # saves no error
