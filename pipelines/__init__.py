"""Driver flows and the `soma` command line (pipelines/cli.py).

A `soma` process runs this file before any other of soma's: the console script imports pipelines.cli, and
`python -m pipelines.cli` imports this package while it locates the module. So the CLI takes SIGINT and SIGTERM
here: a signal while it still imports (seconds on a loaded host) ends it with one line, exit 128 + n. In cli.py
the same would have to run above its imports, each of them then exempt from E402."""

from __future__ import annotations

import os
import sys

from pipelines.stopping import STOP


def _is_cli() -> bool:
    """This process is the `soma` command, not a test, a notebook or a Ray worker importing soma."""
    if os.path.basename(sys.argv[0]) == "soma":  # the console script
        return True
    orig = sys.orig_argv  # python [options] -m pipelines.cli ...: argv[0] is "-m" until the module is located
    return sys.argv[0] == "-m" and "-m" in orig and orig[orig.index("-m") + 1 :][:1] == ["pipelines.cli"]


CLI_PROCESS = _is_cli()
if CLI_PROCESS:
    STOP.install(early=True)
