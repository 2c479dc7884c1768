"""The GPU allocator on its own: the GPU list, detection through nvidia-smi, what a job asks
for, the scheduling rule (head-of-line blocking vs backfill) and the no-sharing invariant."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.jobs.gpus import (
    GpuAllocator,
    GpuError,
    detect_gpus,
    gpu_request,
    gpus_needed,
    next_job,
    parse_gpu_spec,
    parse_nvidia_smi,
    read_assignment,
    resolve_gpus,
    write_assignment,
)
from service.settings import Settings

from ...conftest import tiny_config

NVIDIA_SMI_L = """\
GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-11111111-2222-3333-4444-555555555555)
GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee)
  MIG 3g.20gb     Device  0: (UUID: MIG-f1f1f1f1-0000-1111-2222-333333333333)
  MIG 3g.20gb     Device  1: (UUID: MIG-f2f2f2f2-0000-1111-2222-333333333333)
GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-99999999-2222-3333-4444-555555555555)
"""


# ---------------------------------------------------------------------- the GPU list
@pytest.mark.parametrize(
    ("spec", "devices"),
    [
        ("0,1,2,3", ("0", "1", "2", "3")),
        (" 0, 1 ,2 ", ("0", "1", "2")),
        ("3 1", ("3", "1")),
        ("GPU-11111111-2222,MIG-f1f1f1f1-0000", ("GPU-11111111-2222", "MIG-f1f1f1f1-0000")),
        ("none", ()),
        ("", ()),
        ("auto", None),
        ("AUTO", None),
    ],
)
def test_gpu_spec(spec: str, devices: tuple[str, ...] | None) -> None:
    assert parse_gpu_spec(spec) == devices


@pytest.mark.parametrize("spec", ["0,1,0", "0,;1", "0,$(id)"])
def test_bad_gpu_specs_are_refused(spec: str) -> None:
    with pytest.raises(GpuError):
        parse_gpu_spec(spec)


def test_the_setting_is_checked_when_the_service_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLRM_VRGD_GPUS", "0,1,2,3")
    monkeypatch.setenv("DLRM_VRGD_GPU_BACKFILL", "true")
    monkeypatch.setenv("DLRM_VRGD_JOBS_ROOT", "/shared/dlrm/jobs")
    s = Settings()
    assert s.gpus == "0,1,2,3" and s.gpu_backfill is True
    assert s.jobs_dir == Path("/shared/dlrm/jobs")
    assert Settings(jobs_root=None).jobs_dir == s.data_dir / "jobs"
    monkeypatch.setenv("DLRM_VRGD_GPUS", "0,0")
    with pytest.raises(ValueError, match="more than once"):
        Settings()


def test_nvidia_smi_output_gives_gpu_indices_and_mig_instances() -> None:
    assert parse_nvidia_smi(NVIDIA_SMI_L) == (
        "0",
        "MIG-f1f1f1f1-0000-1111-2222-333333333333",
        "MIG-f2f2f2f2-0000-1111-2222-333333333333",
        "2",
    )
    assert parse_nvidia_smi("") == ()
    assert parse_nvidia_smi("No devices were found\n") == ()


def _fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    exe = tmp_path / "bin" / "nvidia-smi"
    exe.parent.mkdir()
    exe.write_text(f"#!{sys.executable}\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")


def test_detection_runs_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_nvidia_smi(
        tmp_path,
        monkeypatch,
        "import sys\nassert sys.argv[1:] == ['-L']\nprint('GPU 0: A (UUID: GPU-a)\\nGPU 1: B')",
    )
    assert detect_gpus() == ("0", "1")
    assert resolve_gpus("auto") == ("0", "1")
    assert resolve_gpus("auto", inherited="1") == ("1",)  # the service's own CUDA_VISIBLE_DEVICES
    assert resolve_gpus("auto", inherited="") == ()
    assert resolve_gpus("2,3", inherited="1") == ("2", "3")  # an explicit list wins


def test_a_failing_nvidia_smi_means_no_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _fake_nvidia_smi(
        tmp_path, monkeypatch, "import sys\nprint('NVIDIA-SMI has failed')\nsys.exit(9)"
    )
    assert detect_gpus() == ()
    assert "exited with 9" in caplog.text


def test_no_nvidia_smi_means_no_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect_gpus() == ()


# ------------------------------------------------------------------ what a job asks for
RUN = "config.run.nproc_per_node"


@pytest.mark.parametrize(
    ("config", "request_"),
    [
        ({"run": {"device": "cuda", "nproc_per_node": 4}}, (4, RUN)),
        ({"run": {"device": "cuda", "nproc_per_node": 2, "nnodes": 3}}, (2, RUN)),
        ({"run": {"device": "cpu", "nproc_per_node": 4}}, (0, RUN)),
        ({"run": {"device": "cuda"}}, (1, RUN)),
        ({"base": {"run": {"device": "cuda", "nproc_per_node": 2}}}, (2, f"config.base.{RUN[7:]}")),
        ({"script": "print(1)"}, (0, RUN)),
    ],
)  # fmt: skip
def test_a_job_asks_for_nproc_per_node_gpus_when_on_cuda(
    config: dict[str, object], request_: tuple[int, str]
) -> None:
    assert gpu_request(config) == request_
    assert gpus_needed(config) == request_[0]


def test_a_resolved_train_config_asks_through_its_run_section() -> None:
    cpu = tiny_config().to_dict()
    cuda = tiny_config("run.device=cuda", "run.nproc_per_node=2").to_dict()
    assert (gpus_needed(cpu), gpus_needed(cuda)) == (0, 2)


# --------------------------------------------------------------------- the scheduling rule
def test_head_of_line_blocking_by_default() -> None:
    queue = [("big", 3), ("small", 1)]
    assert next_job(queue, free=2) == (None, ["big"])  # small does not overtake big
    assert next_job(queue, free=3) == ("big", [])
    assert next_job([], free=4) == (None, [])
    assert next_job([("cpu", 0)], free=0) == ("cpu", [])


def test_backfill_lets_a_later_job_that_fits_start() -> None:
    queue = [("big", 3), ("medium", 2), ("small", 1)]
    assert next_job(queue, free=1, backfill=True) == ("small", ["big", "medium"])
    assert next_job(queue, free=0, backfill=True) == (None, ["big", "medium", "small"])
    assert next_job(queue, free=3, backfill=True) == ("big", [])


# ----------------------------------------------------------------------------- allocator
def test_allocate_and_release() -> None:
    gpus = GpuAllocator(["0", "1", "2", "3"])
    assert gpus.capacity == 4 and gpus.fits(4) and not gpus.fits(5)
    assert gpus.allocate("a", 2) == ("0", "1")
    assert gpus.allocate("b", 2) == ("2", "3")
    assert gpus.free() == () and not gpus.fits(1) and gpus.fits(0)
    assert gpus.allocate("cpu", 0) == ()
    with pytest.raises(GpuError, match="needs 1 GPU"):
        gpus.allocate("c", 1)
    assert gpus.release("a") == ("0", "1")
    assert gpus.allocate("c", 1) == ("0",)
    with pytest.raises(GpuError, match="already holds"):
        gpus.allocate("c", 1)
    assert gpus.holders() == {"b": ("2", "3"), "c": ("0",)}
    assert gpus.release("nobody") == ()


def test_adopted_gpus_are_held_and_conflicts_reported() -> None:
    gpus = GpuAllocator(["0", "1", "2", "3"])
    assert gpus.adopt("old", ["2", "3"]) == []
    assert gpus.allocate("new", 2) == ("0", "1")
    problems = gpus.adopt("weird", ["1", "7"])
    assert any("also held by job new" in p for p in problems)
    assert any("GPU 7 is not among" in p for p in problems)


def test_a_gpu_listed_twice_is_refused() -> None:
    with pytest.raises(GpuError):
        GpuAllocator(["0", "0"])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["alloc", "release"]), st.integers(0, 5), st.integers(0, 5)),
        max_size=40,
    )
)
def test_no_gpu_is_ever_held_by_two_jobs(ops: list[tuple[str, int, int]]) -> None:
    gpus = GpuAllocator(["0", "1", "2", "3", "4"])
    for op, job, count in ops:
        name = f"job{job}"
        if op == "alloc" and not gpus.held(name) and gpus.fits(count):
            got = gpus.allocate(name, count)
            assert len(got) == count
        elif op == "release":
            gpus.release(name)
        held = [d for devices in gpus.holders().values() for d in devices]
        assert len(held) == len(set(held))
        assert set(held) | set(gpus.free()) == set(gpus.devices)
        assert not set(held) & set(gpus.free())


# ------------------------------------------------------------- what a job was given
def test_assignment_round_trip(tmp_path: Path) -> None:
    assert read_assignment(tmp_path) is None
    write_assignment(tmp_path, ("2", "3"))
    assert read_assignment(tmp_path) == ("2", "3")
    write_assignment(tmp_path, ())
    assert read_assignment(tmp_path) == ()


def test_assignment_from_the_environment_of_a_running_job(tmp_path: Path) -> None:
    """A job started before gpus.json existed: its process environment tells."""
    if not Path("/proc/self/environ").exists():
        pytest.skip("needs /proc")
    # The child says when it runs its own program: right after Popen returns, /proc/PID/environ
    # may still be the parent's (fork done, exec not yet), which read None in 11 of 40 tries.
    proc = subprocess.Popen(
        [sys.executable, "-c", "print('ready', flush=True); import time; time.sleep(30)"],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "1,3"},
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        assert read_assignment(tmp_path, proc.pid) == ("1", "3")
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
