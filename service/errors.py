"""Typed domain errors of the job layer; one exception handler (``service.main``) maps them to
HTTP answers: not found -> 404, illegal transition or a damaged artifact -> 409, invalid input
-> 422, the service's storage full or not writable -> 507."""

from __future__ import annotations

import errno
import os


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


class SubmissionConflict(ServiceError):
    """A ``submission_id`` already used by a job whose request differed: 409 naming the id (a
    retried POST must repeat its body; another job needs another id)."""

    status_code = 409


class ArtifactDamaged(ServiceError):
    """A file the job left is not what it claims (a model that fails its manifest, a link
    where a file should be): 409, and nothing of it is served."""

    status_code = 409


class InvalidInput(ServiceError):
    """Input that passed the schema but not a semantic check; names the offending field."""

    status_code = 422

    def __init__(
        self,
        field: str,
        message: str,
        loc: tuple[str | int, ...] = (),
        also: tuple[str, ...] = (),
    ) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.loc = loc or tuple(field.split("."))
        self.detail = message
        #: Further fields the same message is about (one issue each in the answer).
        self.also = also


class StorageError(ServiceError):
    """The service could not write what the request needs (disk full, read-only, permission);
    nothing of the request was kept."""

    status_code = 507

    @classmethod
    def from_os_error(cls, what: str, err: OSError) -> StorageError:
        name = errno.errorcode.get(err.errno or 0, "error")
        reason = os.strerror(err.errno) if err.errno else str(err)
        return cls(f"cannot store {what} on the service host: {reason} ({name}); nothing was kept")


class Unavailable(ServiceError):
    """What runs jobs cannot take one now (Slurm's controller unreachable): 503, naming why."""

    status_code = 503
