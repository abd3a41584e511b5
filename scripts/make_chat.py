"""Build the shipped chat set from the shipped public-domain corpus (the King James Bible).

Each conversation asks for verses and gets them back, so a fine-tuning run has prompts to leave out
of the loss and answers to learn:

- quote: "Quote Genesis 1:3." -> the verse;
- continue: "Continue this verse: And God said, Let there be light:" -> the rest of it;
- follow-up: a quote, then "And the next verse?" -> the verse after it (two assistant turns).

Deterministic (one seeded generator). Usage::

    python scripts/make_chat.py shardwise/data/assets/kjv_chat.jsonl.gz
"""

from __future__ import annotations

import gzip
import json
import random
import sys
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[1] / "shardwise" / "data" / "assets" / "kjv.jsonl.gz"


def verses(chapter: str) -> tuple[str, list[str]]:
    """("Genesis 1", [verse texts]) of one chapter document."""
    title, *lines = chapter.split("\n")
    return title, [line.split(" ", 1)[1] for line in lines if " " in line]


def conversation(rng: random.Random, title: str, texts: list[str]) -> list[dict[str, str]]:
    i = rng.randrange(len(texts))
    kind = rng.choice(["quote", "continue", "follow-up"] if i + 1 < len(texts) else ["quote", "continue"])
    if kind == "continue" and len(texts[i].split()) >= 6:
        words = texts[i].split()
        cut = rng.randrange(3, len(words) - 2)
        return [{"role": "user", "content": f"Continue this verse: {' '.join(words[:cut])}"},
                {"role": "assistant", "content": " ".join(words[cut:])}]
    chat = [{"role": "user", "content": f"Quote {title}:{i + 1}."},
            {"role": "assistant", "content": texts[i]}]
    if kind == "follow-up":
        chat += [{"role": "user", "content": "And the next verse?"},
                 {"role": "assistant", "content": texts[i + 1]}]
    return chat


def main(out: str, per_chapter: int = 3) -> None:
    rng = random.Random(1611)
    rows = []
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        for line in f:
            title, texts = verses(json.loads(line)["text"])
            rows += [{"messages": conversation(rng, title, texts)} for _ in range(per_chapter)]
    with gzip.open(out, "wt", encoding="utf-8", compresslevel=9) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{len(rows)} conversations -> {out}")


if __name__ == "__main__":
    main(sys.argv[1])
