"""Rebuild the shipped default corpus from Debian's public-domain King James Bible text.

The KJV text (1611, copyright expired) ships in Debian's ``bible-kjv-text`` package and is read
with its ``bible`` program. One chapter becomes one document, so the packed dataset has real
document boundaries to mask. Usage (needs ``apt-get install bible-kjv``)::

    python scripts/make_corpus.py shardwise/data/assets/kjv.jsonl.gz
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys

HEADER = re.compile(r"^(\S.*) (\d+)$")  # "Genesis 1", "1 Kings 3"
VERSE = re.compile(r"^\s+(\d+) (.*)$")  # "  12 And God said ..."


def chapters(raw: str) -> list[str]:
    """Split the ``bible`` program's output into one text per chapter."""
    docs: list[str] = []
    title, verses = None, []
    for line in raw.splitlines():
        if not line.strip():
            continue
        if (m := HEADER.match(line)) and not line.startswith(" "):
            if title is not None:
                docs.append(title + "\n" + "\n".join(verses))
            title, verses = line.strip(), []
        elif m := VERSE.match(line):
            verses.append(f"{m.group(1)} {m.group(2).strip()}")
        else:  # continuation of the previous verse (the program wraps at 80 columns)
            verses[-1] += " " + line.strip()
    docs.append(title + "\n" + "\n".join(verses))
    return docs


def main(out: str) -> None:
    raw = subprocess.run(["bible", "-l100000", "Gen1:1-Rev22:21"], capture_output=True, text=True,
                         check=True).stdout
    docs = chapters(raw)
    with gzip.open(out, "wt", encoding="utf-8", compresslevel=9) as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    print(f"wrote {len(docs)} documents, {sum(map(len, docs)):,} characters to {out}")


if __name__ == "__main__":
    main(sys.argv[1])
