"""The ``dlrm-vrgd jobs`` client's own errors and the names it checks arguments and answers
against."""

from __future__ import annotations

import re

DEFAULT_URL = "http://127.0.0.1:8000"


class CliError(Exception):
    """A mistake on the command line or in a file it names: printed as one line, exit 2."""


#: What a job id (or a prefix of one) may hold: the service's ids are 16 hex digits.
JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: Job states, as ``jobs list --state`` takes them.
STATES = ("queued", "running", "succeeded", "failed", "cancelled")
#: A checkpoint's manifest among a job's files.
CHECKPOINT = re.compile(r"checkpoints/step_(\d{1,12})/manifest\.json")
