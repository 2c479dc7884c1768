"""Typed domain errors of the job layer; one exception handler (``service.main``) maps them to
HTTP answers: not found -> 404, illegal transition -> 409, invalid input -> 422."""

from __future__ import annotations


class ServiceError(Exception):
    """Base of the errors the API answers with a 4xx status."""

    status_code = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(ServiceError):
    status_code = 404


class JobNotFound(NotFound):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job with id {job_id!r}")
        self.job_id = job_id


class ArtifactNotFound(NotFound):
    pass


class ResultNotFound(NotFound):
    pass


class IllegalTransition(ServiceError):
    """The job's state does not allow the request (cancel a finished job, delete a running one)."""

    status_code = 409


class InvalidInput(ServiceError):
    """Input that passed the schema but not a semantic check; names the offending field."""

    status_code = 422

    def __init__(self, field: str, message: str, loc: tuple[str | int, ...] = ()) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.loc = loc or tuple(field.split("."))
        self.detail = message


class Unavailable(ServiceError):
    """What runs jobs cannot take one now (Slurm's controller unreachable): 503, naming why."""

    status_code = 503
