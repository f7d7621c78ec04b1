"""The corpus's first use by the ranks of one launch (muonlab/data.py): one process builds it, every
rank reads the same complete bytes, and nothing is left behind in the cache folder."""

from __future__ import annotations

import hashlib
import json

import pytest

from muonlab.launcher import launch
from tests.distributed import _workers_corpus as workers

pytestmark = pytest.mark.cold_launch  # a fresh cache read by fresh processes

NUM_RANKS = 4


@pytest.mark.timeout(240)
def test_ranks_sharing_a_fresh_cache_folder_build_the_corpus_once(tmp_path, monkeypatch):
    cache = tmp_path / "cache"  # not there yet: the ranks make it
    monkeypatch.setenv("MUONLAB_DATA", str(cache))  # inherited by the workers
    results = launch(workers.first_use, NUM_RANKS, timeout_s=120, progress=False)
    assert sorted(results) == list(range(NUM_RANKS))
    failed = {rank: r["error"] for rank, r in results.items() if not r["ok"]}
    assert not failed, f"ranks crashed preparing the corpus: {failed}"
    assert sum(r["built"] for r in results.values()) == 1, {rank: r["built"] for rank, r in results.items()}
    body = (cache / "corpus.bin").read_bytes()
    meta = json.loads((cache / "corpus.meta.json").read_text())
    assert len(body) == meta["num_bytes"] == workers.NUM_BYTES
    assert meta["sha256"] == hashlib.sha256(body).hexdigest()
    assert {r["sha"] for r in results.values()} == {meta["sha256"]}
    assert len({r["inode"] for r in results.values()}) == 1  # one file published, never replaced
    assert not list(cache.glob("*.tmp")), sorted(p.name for p in cache.iterdir())
