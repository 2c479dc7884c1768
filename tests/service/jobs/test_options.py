"""Per-job Slurm options (service/jobs/options.py): no flag that raises a job above other
users' jobs, no value that ends its ``#SBATCH`` line, and docs/slurm.md lists the allow-list
the code enforces."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.jobs.options import EXTRA_FLAGS, SlurmOptions

DOCS = Path(__file__).resolve().parents[3] / "docs" / "slurm.md"


@pytest.mark.parametrize(
    "flag",
    ["--priority=4000000", "--priority", "--nice=-1000", "--nice=-1", "--nice=+-3",
     "--nice=2147483646", "--nice=1e9", "--nice=5\n", "--reservation=x\n"],
)  # fmt: skip
def test_flags_that_raise_a_job_or_end_its_line_are_refused(flag: str) -> None:
    with pytest.raises(ValidationError, match=r"raise the job above|lower itself|not --flag"):
        SlurmOptions.model_validate({"extra_flags": [flag]})


@pytest.mark.parametrize("flag", ["--nice", "--nice=0", "--nice=10", "--nice=+7",
                                  "--nice=2147483645", "--reservation=maint"])  # fmt: skip
def test_a_job_may_lower_itself(flag: str) -> None:
    assert SlurmOptions.model_validate({"extra_flags": [flag]}).sbatch_options() == [flag]


def test_the_docs_list_the_allowed_flags_the_code_enforces() -> None:
    text = " ".join(DOCS.read_text().split())
    listed = re.search(r"from this allow-list: (.*?)\. Not the flags", text)
    assert listed is not None
    assert set(re.findall(r"`(--[a-z-]+)`", listed.group(1))) == EXTRA_FLAGS
    assert "--priority" not in EXTRA_FLAGS
