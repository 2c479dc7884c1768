"""README.md's commands, as a newcomer pastes them: every fenced shell command of "Run a job"
runs, in order, in a fresh directory (against a tiny config written here, standing in for
configs/demo.yaml), and exits 0; every curl command of the README fails on an HTTP error."""

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
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.M | re.S)
VENV_BIN = ".venv/bin/"


def section(title: str) -> str:
    """The text of ``## title`` up to the next ``## `` heading."""
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end >= 0 else None]


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


def test_run_a_job_commands_run_in_order_from_a_fresh_directory(tmp_path: Path) -> None:
    cmds = commands(section("Run a job"))
    # every command uses the demo config, but `advise`, which reads a run the block trained
    assert len(cmds) >= 5 and all("configs/demo.yaml" in c or " advise " in c for c in cmds)
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


def test_the_sample_result_line_has_the_demo_output_format() -> None:
    """The line quoted under "Reading AUC" is in the form the demo prints (service/demo.py's
    print_result, which `dlrm-vrgd train` shares): AUC, logloss, NE, oracle AUC and its gap,
    the gap being oracle minus AUC."""
    block = section("Reading AUC")
    line = next(x for x in block.splitlines() if x.strip().startswith("test AUC"))
    m = re.fullmatch(
        r"  test AUC (0\.\d{4})  logloss (\d\.\d{4})  NE (\d\.\d{4})"
        r"   oracle AUC (0\.\d{4}) \(gap ([+-]0\.\d{4})\)",
        line,
    )
    assert m, line
    auc, oracle, gap = float(m[1]), float(m[4]), float(m[5])
    assert gap == pytest.approx(oracle - auc, abs=1.5e-4)


def _curl_fails_on_http_errors(cmd: str) -> bool:
    words = shlex.split(cmd.split("#")[0], posix=True)
    flags = words[words.index("curl") + 1 :]
    short = [w for w in flags if re.fullmatch(r"-[A-Za-z]+", w)]
    return any("f" in w for w in short) or bool({"--fail", "--fail-with-body"} & set(flags))


def test_every_curl_command_of_the_readme_fails_on_an_http_error() -> None:
    """With -f (or --fail-with-body) a 404 exits non-zero; without, `curl -O` saves the JSON
    error under the file's name and exits 0 (tests/service/api/routes/test_artifacts.py)."""
    curls = [
        part.strip()
        for cmd in commands(README)
        for part in re.split(r"\||\$\(", cmd)
        if re.match(r"\s*curl\s", part)
    ]
    assert len(curls) >= 15
    assert [c for c in curls if not _curl_fails_on_http_errors(c)] == []
    downloads = [c for c in curls if " -O" in c or " -o " in c]
    assert downloads and all("--fail-with-body" not in c for c in downloads)  # saves no error
