"""Freeze the built-in corpus: the files soma_cluster/data/builtin-corpus.tar.xz holds, and its manifest.

Run once by a maintainer on a Debian machine (bookworm) with Python 3.11, never by the suite or a user:

    .venv/bin/python scripts/freeze_builtin_corpus.py soma_cluster/data

It takes the machine's sources with a licence that allows shipping their files verbatim (docs in
soma_cluster/data/BUILTIN-CORPUS.md): Python's reference topics and standard library (PSF-2.0), license texts,
the Linux man-pages project's pages (Debian's manpages and manpages-dev) and GNU manuals under the GNU Free
Documentation License. They are mixed by bytes as soma_cluster.textsources.mix mixes them, up to --bytes, and
every file a document came from is stored whole and decompressed, notices included. Then paste the sha256 it
prints into soma_cluster/textsources.py (BUILTIN_SHA256).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

from soma_cluster import textsources as ts

GFDL_NOTICE = b"GNU Free Documentation License"
MANPAGES_PACKAGES = ("manpages", "manpages-dev")


def _dpkg_owned(packages: tuple[str, ...]) -> set[str]:
    out = subprocess.run(["dpkg", "-L", *packages], capture_output=True, text=True, check=True).stdout
    return {line for line in out.splitlines() if line.endswith(".gz")}


def _owner(path: str) -> str:
    """'package version' of the Debian package that installed `path`."""
    pkg = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True).stdout.split(":", 1)[0]
    if not pkg:
        return "unknown"
    ver = subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True).stdout
    return f"{pkg} {ver}"


def sources() -> dict[str, object]:
    files = ts.machine_files()
    man_ok = _dpkg_owned(MANPAGES_PACKAGES)
    man = (f for f in files["man-pages"] if f"/usr/share/man/{f.name}.gz" in man_ok)
    info = (f for f in files["info-pages"] if GFDL_NOTICE in f.raw[:20000])
    return {
        "pydoc-topics": files["pydoc-topics"],
        "python-stdlib": files["python-stdlib"],
        "licenses": files["licenses"],
        "common-licenses": files["common-licenses"],
        "man-pages": man,
        "info-pages": info,
    }


def origin(f: ts.RawFile) -> str:
    py = f"Python {sys.version.split()[0]} (PSF-2.0)"
    if f.source in ("pydoc-topics", "python-stdlib"):
        return py
    if f.source == "licenses":
        return f"the {f.name.split('/', 1)[0]} wheel's license file"
    if f.source == "common-licenses":
        return _owner(f"/usr/share/common-licenses/{f.name}")
    if f.source == "man-pages":
        return _owner(f"/usr/share/man/{f.name}.gz")
    return _owner(f"/usr/share/info/{f.name}.gz")


def _copy_licences(to: Path, origins: set[str]) -> None:
    """Python's licence and the Debian copyright file of every package a frozen file came from."""
    to.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (to / "Python-LICENSE.txt").write_bytes((stdlib / "LICENSE.txt").read_bytes())
    for package in sorted({o.split()[0] for o in origins if not o.startswith(("Python", "the "))}):
        (to / f"{package}.copyright").write_bytes(Path(f"/usr/share/doc/{package}/copyright").read_bytes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--bytes", type=int, default=8_000_000, help="document bytes to freeze (after cleaning)")
    args = ap.parse_args()
    taken = [raw for raw, _ in ts.mix(sources(), args.bytes)]
    order = {name: i for i, name in enumerate(dict.fromkeys(f.source for f in taken))}
    taken.sort(key=lambda f: order[f.source])  # grouped by source, each in its stable order (sort is stable)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for f in taken:
            info = tarfile.TarInfo(f"{f.source}/{f.name}")
            info.size, info.mode, info.mtime = len(f.raw), 0o644, 0
            tar.addfile(info, io.BytesIO(f.raw))
    blob = lzma.compress(buf.getvalue(), format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "builtin-corpus.tar.xz").write_bytes(blob)
    manifest = {
        "archive": "builtin-corpus.tar.xz",
        "sha256": hashlib.sha256(blob).hexdigest(),
        "files": [
            {
                "name": f"{f.source}/{f.name}",
                "bytes": len(f.raw),
                "sha256": hashlib.sha256(f.raw).hexdigest(),
                "origin": origin(f),
            }
            for f in taken
        ],
    }
    (args.out / "builtin-corpus.json").write_text(json.dumps(manifest, indent=1) + "\n")
    _copy_licences(args.out / "licenses", {f["origin"] for f in manifest["files"]})
    print(f"{len(taken)} files, {sum(len(f.raw) for f in taken):_} raw bytes, {len(blob):_} compressed")
    print(f"sha256 {manifest['sha256']}")


if __name__ == "__main__":
    main()
