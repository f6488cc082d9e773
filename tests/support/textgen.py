"""A large topical corpus generated from a seed, for tests that need more text than the built-in corpus holds.

The built-in corpus (8 MB) is fixed bytes; a test at N = 256 needs tens of MB. This draws real lines of the
built-in documents into new documents: the documents are split into `topics` groups (by a hash of their id), and
each generated document takes its lines from one group's pool, in an order a seeded generator picks. Documents of
one topic share their words, as a real corpus's do, and no 1,024-byte sequence repeats. The same seed gives the
same bytes on every machine (never the machine's own files).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from soma_cluster.textsources import builtin_documents


def topical_documents(total_bytes: int, topics: int = 64, seed: int = 0, doc_bytes: int = 16_000) -> list[bytes]:
    pools: list[list[bytes]] = [[] for _ in range(topics)]
    for doc in builtin_documents(1 << 62):
        t = int.from_bytes(hashlib.sha1(doc.doc_id.encode("utf-8", "surrogateescape")).digest()[:4], "big") % topics
        pools[t].extend(line for line in doc.data.split(b"\n") if len(line.strip()) > 8)
    pools = [p for p in pools if p]
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < total_bytes:
        pool = pools[len(out) % len(pools)]
        picks = rng.integers(0, len(pool), size=doc_bytes // 40)
        data = b"\n".join(pool[i] for i in picks)[:doc_bytes]
        out.append(data)
        total += len(data)
    return out


def write_topical_corpus(root: Path, total_bytes: int, topics: int = 64, seed: int = 0) -> Path:
    """`topical_documents` as one .txt file per document under `root` (a user corpus directory)."""
    root.mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(topical_documents(total_bytes, topics, seed)):
        (root / f"t{i % topics:03d}" / f"doc-{i:06d}.txt").parent.mkdir(exist_ok=True)
        (root / f"t{i % topics:03d}" / f"doc-{i:06d}.txt").write_bytes(data)
    return root
