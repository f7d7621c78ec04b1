"""The corpus: the Python standard library's own source, byte-level, with a fixed split.

No download at run time: every Python installation ships these files. ``prepare_corpus`` sorts them
by relative path, concatenates them (each preceded by a header line naming the file), keeps the
first ``max_bytes``, and caches the result with a manifest. The last ``val_fraction`` is validation.

Every rank of a launch calls ``prepare_corpus`` on the same cache folder at start-up, so the first
build is made by one process under a file lock and published whole (``os.replace``); the others wait
for it and read the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

import torch

from ._base import check_whole
from .files import file_lock, write_atomic

DEFAULT_MAX_BYTES = 4 << 20
MIN_BYTES = 100_000
"""The smallest corpus worth training on (both splits need room for many windows)."""
VAL_FRACTION = 0.1


def default_cache_dir() -> Path:
    """$MUONLAB_DATA, else data/cache in a source checkout, else ~/.cache/muonlab."""
    env = os.environ.get("MUONLAB_DATA")
    if env:
        return Path(env)
    checkout = Path(__file__).resolve().parent.parent / "data"
    if (checkout / "prepare.py").exists():
        return checkout / "cache"
    return Path.home() / ".cache" / "muonlab"


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).parts
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _is_ready(out: Path, meta_path: Path, max_bytes: int) -> bool:
    """Whether ``out`` is a complete corpus of ``max_bytes``: the manifest is written last, so its
    presence (with a matching size) means the byte file it describes was already in place."""
    try:
        meta = json.loads(meta_path.read_text())
        return meta.get("max_bytes") == max_bytes and out.stat().st_size == meta.get("num_bytes")
    except (OSError, ValueError):  # not there yet, or not readable as a manifest: build it
        return False


def prepare_corpus(cache_dir: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Build (or reuse) the cached corpus; returns the path of the byte file.

    Safe to call from many processes at once on one cache folder (the ranks of a launch): one of
    them builds it under an exclusive lock on ``corpus.bin.lock`` (``fcntl.flock``; no lock where the
    platform has none), the others wait and reuse what it wrote."""
    check_whole("max_bytes", max_bytes, MIN_BYTES)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    out, meta_path = cache / "corpus.bin", cache / "corpus.meta.json"
    if _is_ready(out, meta_path, max_bytes):
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with file_lock(out):
        if _is_ready(out, meta_path, max_bytes):  # another process built it while this one waited
            return out
        root = Path(sysconfig.get_paths()["stdlib"])
        chunks, total, num_files = [], 0, 0
        for path in _stdlib_files():
            body = f"# file: {path.relative_to(root).as_posix()}\n".encode() + path.read_bytes()
            chunks.append(body)
            total += len(body)
            num_files += 1
            if total >= max_bytes:
                break
        data = b"".join(chunks)[:max_bytes]
        if len(data) < MIN_BYTES:
            raise RuntimeError(f"the standard library at {root} gave only {len(data)} bytes of source")
        # a manifest left from another max_bytes must not vouch for the new bytes while they land
        meta_path.unlink(missing_ok=True)
        write_atomic(out, data)
        meta = dict(num_bytes=len(data), num_files=num_files, max_bytes=max_bytes, stdlib=str(root),
                    sha256=hashlib.sha256(data).hexdigest(), val_fraction=VAL_FRACTION)
        write_atomic(meta_path, json.dumps(meta, indent=1).encode())
    return out


def load_corpus(split: str = "train", cache_dir: str | Path | None = None) -> torch.Tensor:
    """The split as a 1-D uint8 tensor of bytes (prepared on first use)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    path = prepare_corpus(cache_dir)
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    cut = int(len(data) * (1 - VAL_FRACTION))
    return data[:cut] if split == "train" else data[cut:]


def get_batch(data: torch.Tensor, batch_size: int, context: int, generator: torch.Generator | None = None):
    """Random windows: inputs (batch, context) and next-byte targets, as int64. A window of
    context + 1 bytes starts anywhere it fits, so every byte but the first is some window's target."""
    check_whole("batch_size", batch_size, 1)
    check_whole("context", context, 1)
    if len(data) < context + 1:
        raise ValueError(f"corpus of {len(data)} bytes is too short for context {context} (needs {context + 1})")
    starts = torch.randint(0, len(data) - context, (batch_size,), generator=generator)
    x = torch.stack([data[s : s + context] for s in starts.tolist()]).long()
    y = torch.stack([data[s + 1 : s + 1 + context] for s in starts.tolist()]).long()
    return x, y
