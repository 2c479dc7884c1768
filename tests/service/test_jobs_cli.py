"""``dlrm-vrgd jobs``: the real CLI (a subprocess) against a real service process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from service.client import ServiceClient
from service.launcher import LocalService

from .conftest import long_job, tiny_job, wait_for


def jobs(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """``dlrm-vrgd jobs ARGS`` with only the connection settings given in ``env``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DLRM_VRGD_")}
    clean["XDG_CONFIG_HOME"] = "/nonexistent"  # no client config unless a test writes one
    return subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", "jobs", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**clean, **(env or {})},
    )


def env_of(svc: LocalService) -> dict[str, str]:
    return {"DLRM_VRGD_URL": svc.base_url, "DLRM_VRGD_TOKEN": svc.token}


def test_submit_follow_list_status_and_logs(
    tmp_path: Path,
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    svc = start_service()
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_job(eval_every=2)))

    done = jobs("submit", str(config), "--set", "run.steps=3", "--follow", env=env_of(svc))
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("submitted train job ") and "(tiny)" in first
    job_id = first.split()[3]
    assert done.stdout.splitlines()[-1] == f"job {job_id} succeeded"
    assert svc.token not in done.stdout + done.stderr

    job = client_of(svc).job(job_id)
    assert job["name"] == "tiny" and job["config"]["run"]["steps"] == 3  # --set reached it
    assert job["progress"]["step"] == 3

    listed = jobs("list", env=env_of(svc))
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith(job_id[:14]))
    assert row.split()[1:5] == ["tiny", "train", "succeeded", "3/3"]
    as_json = json.loads(jobs("list", "--json", "--state", "succeeded", env=env_of(svc)).stdout)
    assert [j["id"] for j in as_json["data"]] == [job_id]

    status = jobs("status", job_id, env=env_of(svc))
    assert status.returncode == 0 and f"id:           {job_id}" in status.stdout
    assert "state:        succeeded" in status.stdout and "step:         3/3" in status.stdout

    logs = jobs("logs", job_id, env=env_of(svc))
    assert logs.returncode == 0 and logs.stdout == client_of(svc).logs(job_id, tail=200)


def test_cancel_and_a_failed_follow_exit_1(
    tmp_path: Path, start_service: Callable[..., LocalService]
) -> None:
    svc = start_service()
    config = tmp_path / "long.yaml"
    config.write_text(yaml.safe_dump(long_job()))
    sub = jobs("submit", str(config), "--name", "long one", env=env_of(svc))
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.split()[3]
    client = ServiceClient(svc.base_url, svc.token)
    try:
        wait_for(lambda: client.job(job_id)["state"] == "running", timeout=120)
        cancelled = jobs("cancel", job_id, env=env_of(svc))
        assert cancelled.returncode == 0, cancelled.stderr
        assert cancelled.stdout.startswith(f"job {job_id}: ")
        wait_for(lambda: client.job(job_id)["state"] == "cancelled", timeout=60)
    finally:
        client.close()
    status = jobs("status", job_id, "--json", env=env_of(svc))
    assert json.loads(status.stdout)["name"] == "long one"


def test_token_from_the_client_config_file_and_clear_errors(
    tmp_path: Path, start_service: Callable[..., LocalService]
) -> None:
    svc = start_service()
    (tmp_path / "dlrm-vrgd").mkdir()
    (tmp_path / "dlrm-vrgd" / "client.toml").write_text(
        f'url = "{svc.base_url}"\ntoken = "{svc.token}"\n'
    )
    cfg_env = {"XDG_CONFIG_HOME": str(tmp_path)}
    ok = jobs("list", env=cfg_env)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("ID ")

    # a wrong token: the service's 401, one line, no traceback, the token not echoed
    bad = jobs("list", env={"DLRM_VRGD_URL": svc.base_url, "DLRM_VRGD_TOKEN": "x" * 30})
    assert bad.returncode == 1 and bad.stderr.startswith("error: the service answered 401")
    assert "Traceback" not in bad.stderr and "x" * 30 not in bad.stderr

    # a bad config field: the service's 422 names it
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(tiny_job()))
    bad_field = jobs("submit", str(config), "--set", "run.steps=-1", env=env_of(svc))
    assert bad_field.returncode == 1 and "422" in bad_field.stderr
    assert "run.steps" in bad_field.stderr and "Traceback" not in bad_field.stderr

    # a client config with an unknown key names the file and the key
    (tmp_path / "dlrm-vrgd" / "client.toml").write_text('uri = "http://127.0.0.1:1"\n')
    unknown = jobs("list", env=cfg_env)
    assert unknown.returncode == 2 and "client.toml: unknown key 'uri'" in unknown.stderr

    # YAML that is not a mapping names the file
    config.write_text("- a\n- b\n")
    not_mapping = jobs("submit", str(config), env=env_of(svc))
    assert not_mapping.returncode == 2
    assert f"{config}: the top level must be a mapping" in not_mapping.stderr

    # nothing listens: one line naming the URL
    gone = jobs("list", env={"DLRM_VRGD_URL": "http://127.0.0.1:9"})
    assert gone.returncode == 1 and "cannot reach the service at http://127.0.0.1:9" in gone.stderr


def test_resubmit_resumes_a_cancelled_job_from_its_checkpoint(
    tmp_path: Path,
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    svc = start_service()
    client = client_of(svc)
    config = tmp_path / "long.yaml"
    raw = long_job()
    raw["run"]["checkpoint_every"] = 3
    config.write_text(yaml.safe_dump(raw))
    job_id = jobs("submit", str(config), env=env_of(svc)).stdout.split()[3]
    ckpts = svc.data_dir / "jobs" / job_id / "run" / "checkpoints"
    wait_for(lambda: any(ckpts.glob("step_*")), timeout=180)
    client.cancel(job_id)
    first = wait_for(lambda: (j := client.job(job_id))["state"] == "cancelled" and j, timeout=60)
    # the cancel (SIGTERM) stopped it after a step and checkpointed that step
    stopped = json.loads((ckpts.parent / "status.json").read_text())["step"]
    assert (ckpts / f"step_{stopped:08d}").is_dir()
    again = jobs("resubmit", job_id[:6], env=env_of(svc))  # a unique prefix of the id
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"resubmitted job {job_id} (long): queued; it resumes from "
                                   f"step {stopped}, its newest checkpoint")  # fmt: skip
    twice = jobs("resubmit", job_id, env=env_of(svc))  # queued now: not resubmittable
    assert twice.returncode == 1 and "409" in twice.stderr

    def second_attempt_trains() -> dict | None:
        j = client.job(job_id)
        steps = j["progress"].get("step") or 0
        ok = j["state"] == "running" and j["attempt"] == 2 and steps > first["progress"]["step"]
        return j if ok else None

    job = wait_for(second_attempt_trains, timeout=180)
    assert [a["attempt"] for a in job["attempts"]] == [1, 2]
    resumed = job["attempts"][1]["resumed_from_step"]
    assert resumed == stopped
    assert job["error"] is None and job["exit_code"] is None
    client.cancel(job_id)
    wait_for(lambda: client.job(job_id)["state"] == "cancelled", timeout=60)
    steps = [r["step"] for r in client.metrics(job_id, kind="train")["data"]]
    assert steps == list(range(1, len(steps) + 1))  # contiguous: no step twice, none missing


def test_tags_group_jobs_and_bad_tags_are_422(
    tmp_path: Path,
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    svc = start_service()
    client = client_of(svc)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_job()))
    made = {}
    for name, tags in (("a", ["sweep-1", "lr:0.1"]), ("b", ["sweep-1"]), ("c", [])):
        args = [a for t in tags for a in ("--tag", t)]
        done = jobs("submit", str(config), "--name", name, *args, env=env_of(svc))
        assert done.returncode == 0, done.stderr
        made[name] = done.stdout.split()[3]
    assert client.job(made["a"])["tags"] == ["sweep-1", "lr:0.1"]
    assert client.job(made["c"])["tags"] == []

    def listed(*tags: str) -> list[str]:
        args = [a for t in tags for a in ("--tag", t)]
        out = jobs("list", "--json", *args, env=env_of(svc))
        assert out.returncode == 0, out.stderr
        return sorted(j["name"] for j in json.loads(out.stdout)["data"])

    assert listed("sweep-1") == ["a", "b"]
    assert listed("sweep-1", "lr:0.1") == ["a"]
    assert listed("nope") == []
    assert listed() == ["a", "b", "c"]
    status = jobs("status", made["a"], env=env_of(svc))
    assert "tags:         sweep-1, lr:0.1" in status.stdout

    bad = jobs("submit", str(config), "--tag", "no spaces", env=env_of(svc))
    assert bad.returncode == 1 and "422" in bad.stderr and "tags" in bad.stderr
    body = {"name": "x", "config": tiny_job(), "tags": [f"t{i}" for i in range(21)]}
    too_many = client.http.post("/api/v1/jobs", json=body)
    assert too_many.status_code == 422 and "tags" in too_many.text


def test_resubmit_of_a_job_without_a_checkpoint_says_it_starts_from_step_0(
    tmp_path: Path, start_service: Callable[..., LocalService]
) -> None:
    svc = start_service(DLRM_VRGD_MAX_CONCURRENT_JOBS="0")  # it stays queued: never trains
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_job()))
    job_id = jobs("submit", str(config), env=env_of(svc)).stdout.split()[3]
    assert jobs("cancel", job_id, env=env_of(svc)).returncode == 0
    again = jobs("resubmit", job_id, env=env_of(svc))
    assert again.returncode == 0, again.stderr
    assert "it has no checkpoint (stopped before its first): it starts again from step 0" in (
        again.stdout
    )


def test_whole_ids_prefixes_options_after_the_command_and_the_401_hint(
    tmp_path: Path,
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    svc = start_service(DLRM_VRGD_MAX_CONCURRENT_JOBS="0")  # jobs stay queued
    client = client_of(svc)
    ids = [client.submit(f"j{i}", tiny_job())["id"] for i in range(3)]
    listed = jobs("list", env=env_of(svc))
    assert listed.returncode == 0, listed.stderr
    for job_id in ids:  # whole ids, as `jobs status` takes them
        assert any(line.split()[0] == job_id for line in listed.stdout.splitlines()), listed.stdout
    status = jobs("status", ids[0][:5], env=env_of(svc))
    if sum(i.startswith(ids[0][:5]) for i in ids) == 1:
        assert status.returncode == 0 and f"id:           {ids[0]}" in status.stdout
    shared = os.path.commonprefix(ids[:2])  # maybe "": every id starts with it
    ambiguous = jobs("status", shared or "", env=env_of(svc))
    assert ambiguous.returncode == 2 and "Traceback" not in ambiguous.stderr
    nothing = jobs("status", "zz", env=env_of(svc))
    assert nothing.returncode == 2 and "no job has the id zz" in nothing.stderr
    hostile = jobs("status", "../../health", env=env_of(svc))
    assert hostile.returncode == 2 and "is not a job id" in hostile.stderr

    # --url and --token-file after the subcommand, as before it
    token_file = tmp_path / "token"
    token_file.write_text(svc.token + "\n")
    for argv in (
        ["list", "--url", svc.base_url, "--token-file", str(token_file)],
        ["--url", svc.base_url, "list", "--token-file", str(token_file)],
        ["--url", svc.base_url, "--token-file", str(token_file), "status", ids[1]],
        ["status", ids[1], "--url", svc.base_url, "--token-file", str(token_file)],
    ):
        done = jobs(*argv)
        assert done.returncode == 0, (argv, done.stderr)

    # no token: the 401 says how to give one
    no_token = jobs("list", "--url", svc.base_url)
    assert no_token.returncode == 1
    assert "--token-file" in no_token.stderr and "DLRM_VRGD_TOKEN" in no_token.stderr


def test_ctrl_c_on_a_follow_and_a_closed_pipe_end_without_a_traceback(
    tmp_path: Path,
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    import select
    import signal
    import time

    svc = start_service()
    client = client_of(svc)
    job = client.submit("long", long_job())
    wait_for(lambda: (client.job(job["id"])["progress"].get("step") or 0) >= 2, timeout=120)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DLRM_VRGD_")}
    env = {**clean, "XDG_CONFIG_HOME": "/nonexistent", **env_of(svc)}
    follow = subprocess.Popen(
        [sys.executable, "-m", "dlrm_vrgd.cli", "jobs", "logs", job["id"], "--follow"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
        # a terminal's Ctrl-C: the child starts with SIGINT's default disposition whatever this
        # worker inherited (Python leaves an inherited SIG_IGN in place, and no KeyboardInterrupt
        # comes; twice a full-suite run's follow outlived its SIGINT, never alone)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    # it prints the log's tail first, then waits for more: interrupt it once it is following
    # (a fixed sleep raced the CLI's start on a loaded machine)
    assert follow.stdout is not None
    try:
        ready, _, _ = select.select([follow.stdout], [], [], 120)
        first = follow.stdout.readline() if ready else ""
        time.sleep(0.5)
        follow.send_signal(signal.SIGINT)
        out, err = follow.communicate(timeout=60)
    finally:  # a follow that outlived the test would leak into the next one's warnings
        if follow.poll() is None:
            follow.kill()
            follow.communicate()
    assert follow.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "step " in first + out  # the log's tail came first
    for i in range(30):  # enough jobs that --json is longer than a pipe's buffer
        client.submit(f"more{i}", tiny_job())
    piped = subprocess.run(
        f"{sys.executable} -m dlrm_vrgd.cli jobs list --json --limit 40 | head -n 1",
        shell=True, capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert piped.stdout == "{\n" and "Traceback" not in piped.stderr, piped.stderr
    assert piped.stderr == "", piped.stderr
    client.cancel(job["id"])


def test_logs_follow_prints_the_tail_then_each_new_line_once_and_plain_progress(
    tmp_path: Path,
    start_service: Callable[..., LocalService],
    client_of: Callable[[LocalService], ServiceClient],
) -> None:
    svc = start_service()
    client = client_of(svc)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_job(steps=30, log_every=1)))
    done = jobs("submit", str(config), "--follow", env=env_of(svc))
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.split()[3]
    # off a terminal the follow line writes whole lines, no carriage-return redraws
    assert "\r" not in done.stderr and "step 30/30 loss" in done.stderr, done.stderr
    follow = jobs("logs", job_id, "--follow", "--tail", "5", env=env_of(svc))
    assert follow.returncode == 0, follow.stderr
    whole = client.logs(job_id, tail=10_000)
    assert follow.stdout == "".join(whole.splitlines(keepends=True)[-5:])
