"""User-facing errors: one line naming the thing and the fix; the CLI maps them to exit code 2."""


class SomaError(Exception):
    """A problem with the user's input or campaign directory (not a bug in soma-cluster)."""


class ChecksumError(SomaError):
    """An artifact's bytes do not match the checksum recorded when it was written."""
