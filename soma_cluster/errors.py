"""User-facing errors: one line naming the thing and the fix; the CLI maps them to exit code 2."""


class SomaError(Exception):
    """A problem with the user's input or campaign directory (not a bug in soma-cluster)."""


class ChecksumError(SomaError):
    """An artifact's bytes do not match the checksum recorded when it was written."""


class DeviceError(SomaError):
    """An actor that holds a GPU share finds no CUDA device (and resources.allow_cpu is not set)."""


class JobsFailed(Exception):
    """The campaign ran, but some jobs ended failed_permanently (retries spent): the CLI exits with 3, so a
    RayJob, a CI pipeline or a script sees it. Not bad input: the message names the jobs and their errors."""

    exit_code = 3


class StorageUnreachable(SomaError):
    """The campaign store did not answer within its retries (soma_cluster/storage.py `retrying`). A command
    reports it like any bad input; a worker that hits it mid-campaign is waited for (soma_cluster/failures.py)."""


class StoppedByEnvironment(Exception):
    """The driver stopped the campaign because the infrastructure (disk full, read-only, storage unreachable,
    nodes lost, out of memory) stayed broken past retry.infra_wait_s: the CLI exits with 4. Nothing is lost and
    no expert's retries were spent on it; fix the condition the message names, then `soma resume`."""

    exit_code = 4
