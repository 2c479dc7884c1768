"""What runs a job's processes: the service's own host (``local``) or a Slurm cluster
(``slurm``), chosen when the service starts (``DLRM_VRGD_BACKEND``).

Each backend implements :class:`~service.jobs.backends.base.Backend`, whose verbs follow
TorchX's scheduler interface (schedule, describe, log_iter, cancel, list) plus recover, so that
another scheduler (Kubernetes, Ray) is one more module here and no change to the runner.
"""

from __future__ import annotations

from service.jobs.backends.base import Backend, BackendUnavailable
from service.settings import Settings

BACKENDS = ("local", "slurm")


def make_backend(settings: Settings) -> Backend:
    """The backend ``settings.backend`` names."""
    if settings.backend == "slurm":
        from service.jobs.backends.slurm import SlurmBackend

        return SlurmBackend(settings)
    from service.jobs.backends.local import LocalBackend

    return LocalBackend(settings)


__all__ = ["BACKENDS", "Backend", "BackendUnavailable", "make_backend"]
