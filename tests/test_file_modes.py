"""Files a campaign writes follow the umask (a teammate on a shared disk reads them), as open() would make them:
not mkstemp's 0600. Each case runs in a child process with its own umask."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, os, stat, sys
from soma_cluster.storage import Store, put_file
os.umask(int(sys.argv[2], 8))
store = Store(sys.argv[1])
store.write_bytes("status.json", b"{}")                       # written whole: temp name, fsync, rename
store.write_bytes("eval/report.md", b"# report")
store.write_if("driver-lease.json", b"{}", None)               # compare-and-swap
store.append("events.jsonl", {"event": "x"})                  # the append-only log
with store.stage_file("shards/expert-0000/train-00000.arrow") as staged:   # staged, then published
    open(staged.path, "wb").write(b"rows")
    staged.publish()
local = os.path.join(sys.argv[1], "..", "made-elsewhere.bin")
open(local, "wb").write(b"x")
put_file(store, local, "experts/expert-0000/weights.safetensors")  # moved into place
modes = {}
for root, dirs, files in os.walk(sys.argv[1]):
    for name in files:
        if not name.startswith("."):
            path = os.path.join(root, name)
            modes[os.path.relpath(path, sys.argv[1])] = stat.S_IMODE(os.stat(path).st_mode)
print(json.dumps(modes))
"""


@pytest.mark.parametrize("umask,want", [("022", 0o644), ("002", 0o664), ("077", 0o600)])
def test_files_written_whole_follow_the_umask(tmp_path, umask, want):
    camp = tmp_path / "c"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(camp), umask], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    modes = json.loads(proc.stdout)
    assert {
        "status.json",
        "eval/report.md",
        "driver-lease.json",
        "shards/expert-0000/train-00000.arrow",
    } <= modes.keys()
    assert "experts/expert-0000/weights.safetensors" in modes, modes
    assert {k: oct(v) for k, v in modes.items()} == {k: oct(want) for k in modes}
