"""Job files: artifact names, log tails."""

from __future__ import annotations

import pytest

from service.errors import InvalidInput
from service.jobs.files import check_artifact_name, tail_lines


@pytest.mark.parametrize(
    "name", ["", "/etc/passwd", "../x", "a/../b", "a//b", "./a", "a\\b", "a\x00b", "x" * 1025]
)
def test_bad_artifact_names_are_invalid_input_naming_path(name: str) -> None:
    with pytest.raises(InvalidInput) as err:
        check_artifact_name(name)
    assert err.value.field == "path"


def test_good_artifact_names_pass() -> None:
    assert check_artifact_name("checkpoints/step_00000004/rank0.pt")


def test_tail_lines_keeps_the_last_redraw_of_each_line(tmp_path) -> None:
    log = tmp_path / "train.log"
    assert tail_lines(log, 5) == []
    log.write_text("a\r\rb\n10%\r50%\r100%\nend\n\n")
    assert tail_lines(log, 5) == ["b", "100%", "end"]
    assert tail_lines(log, 1) == ["end"]
