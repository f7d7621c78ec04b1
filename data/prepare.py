"""Build the byte-level corpus from this Python's standard library (cached under data/cache)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from muonlab.data import prepare_corpus  # noqa: E402

if __name__ == "__main__":
    path = prepare_corpus()
    meta = json.loads(path.with_name("corpus.meta.json").read_text())
    print(f"corpus: {meta['num_bytes']:,} bytes from {meta['num_files']} files -> {path}")
