"""Build verdict_next.jsonl: a small multiple-choice task from "The Verdict" (Edith
Wharton, 1908, public domain; the story the book trains on). Each item gives two
consecutive sentences of the story and asks which of four sentences comes next: the real
next one, or one of three drawn from elsewhere in the story (seeded, so the file is
reproducible).

    python benchmarks/quality/lm_eval_task/make_items.py /work/shared/data/the-verdict.txt
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

ITEMS = 40
SEED = 25


def sentences(text: str) -> list[str]:
    flat = re.sub(r"\s+", " ", text).strip()
    # A sentence ends at . ! or ? (and a closing quote), but not after Mr. Mrs. or Dr.
    parts = re.split(r"(?<!\bMr\.)(?<!\bMrs\.)(?<!\bDr\.)(?<=[.!?])[\"”’]?\s+(?=[A-Z\"“])", flat)
    return [p.strip() for p in parts if p.strip()]


def main(source: str) -> None:
    story = sentences(Path(source).read_text(encoding="utf-8"))
    usable = [i for i in range(2, len(story)) if 25 <= len(story[i]) <= 140
              and all(20 <= len(story[j]) <= 200 for j in (i - 2, i - 1))]
    rng = random.Random(SEED)
    rows = []
    for i in sorted(rng.sample(usable, ITEMS)):
        pool = [j for j in usable if abs(j - i) > 5 and 25 <= len(story[j]) <= 140]
        choices = [story[i], *(story[j] for j in rng.sample(pool, 3))]
        rng.shuffle(choices)
        rows.append({"context": f"{story[i - 2]} {story[i - 1]}", "choices": choices,
                     "label": choices.index(story[i])})
    out = Path(__file__).with_name("verdict_next.jsonl")
    out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    print(f"{len(rows)} items -> {out}")


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        raise SystemExit(__doc__)
    main(sys.argv[1] if len(sys.argv) > 1 else "/work/shared/data/the-verdict.txt")
