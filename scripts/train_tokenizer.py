"""Rebuild the shipped tokenizer: byte-level BPE, vocab 2048, trained on the shipped KJV corpus.

    python scripts/train_tokenizer.py shardwise/data/assets/tokenizer.json
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from shardwise.data.tokenizer import ASSETS, train_bpe

if __name__ == "__main__":
    with gzip.open(ASSETS / "kjv.jsonl.gz", "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    train_bpe(texts, 2048, Path(sys.argv[1]))
    print(f"trained on {len(texts)} documents -> {sys.argv[1]}")
