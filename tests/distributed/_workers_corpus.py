"""Worker for tests/distributed/test_corpus_once.py: what every rank of a training launch does first
(load_corpus -> prepare_corpus) on a cache folder nobody has prepared yet."""

from __future__ import annotations

import hashlib
import os

import torch.distributed as dist

from muonlab import data

NUM_BYTES = data.MIN_BYTES
"""The smallest corpus data.py builds: the race is in publishing it, not in its size."""


def first_use() -> dict:
    """Prepare the corpus in ``$MUONLAB_DATA`` with every rank released at once (a barrier, so the
    ranks' start-up times do not serialise them); returns whether this rank built it, what it read
    and the inode of the file it was handed (one build publishes one file)."""
    builds = []
    files = data._stdlib_files

    def counted():  # called once per build, by the process that builds
        builds.append(1)
        return files()

    data._stdlib_files = counted
    dist.barrier()
    try:
        path = data.prepare_corpus(max_bytes=NUM_BYTES)
        body = path.read_bytes()
    except Exception as e:  # noqa: BLE001 (the old race's crash is a result to report, not a failure to raise)
        return dict(ok=False, error=f"{type(e).__name__}: {e}", built=len(builds), pid=os.getpid())
    return dict(ok=True, built=len(builds), sha=hashlib.sha256(body).hexdigest(), size=len(body),
                inode=os.stat(path).st_ino, pid=os.getpid())
