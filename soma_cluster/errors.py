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
