"""How often a request's own earlier text predicts its next tokens: for each position of a
reply, the longest earlier match (n = 1..8 tokens) of the text so far, its most recent
occurrence's continuation, and P(depth d accepted | depth d - 1 accepted), by match length
and by whether the match occurred once ("lone") or more. Fits RetrievalConfig's prior and
`lengthen` for own-sequence retrieval (docs/retrieval.md).

    python bench/own_continuations.py --data DISTILLED.jsonl --tokenizer MODEL [--rows 400]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

DEPTH = 6


def continuation_hits(seq: list[int], start: int, hits: dict) -> None:
    """Count, for positions start.. of seq, how deep the longest earlier match's most recent
    continuation agrees with what follows (hits[(n, kind)][d]: positions reaching depth d)."""
    last, counts = {}, defaultdict(int)

    def index(i: int) -> None:  # the n-grams ending just before i
        for n in range(1, 9):
            if i - n >= 0:
                gram = tuple(seq[i - n:i])
                last[gram], counts[gram] = i, counts[gram] + 1

    for i in range(1, start):
        index(i)
    for t in range(start, len(seq) - 1):
        found = next(((n, last[g], counts[g]) for n in range(8, 0, -1) if (g := tuple(seq[t - n:t])) in last), None)
        index(t)
        if found is None:
            continue
        n, end, count = found
        cont, actual = seq[end:end + DEPTH], seq[t:t + DEPTH]
        d = 0
        while d < min(len(cont), len(actual)) and cont[d] == actual[d]:
            d += 1
        row = hits.setdefault((min(n, 5), "lone" if count == 1 else "multi"), [0] * (DEPTH + 1))
        for j in range(d + 1):
            row[j] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="JSONL with ShareGPT-style conversations (human, gpt)")
    parser.add_argument("--tokenizer", required=True, help="the target model folder")
    parser.add_argument("--rows", type=int, default=400, help="conversations read")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    hits: dict = {}
    with open(args.data) as f:
        for line, _ in zip(f, range(args.rows)):
            turns = json.loads(line)["conversations"]
            prompt, reply = tok.encode(turns[0]["value"]), tok.encode(turns[1]["value"])
            continuation_hits(prompt + reply, len(prompt), hits)
    print("| match length | occurrences | positions | "
          + " | ".join(f"P(d{d} given d{d - 1})" for d in range(1, DEPTH + 1)) + " |")
    print("|---|---|---|" + "---|" * DEPTH)
    for (n, kind), row in sorted(hits.items()):
        cond = [row[d] / row[d - 1] if row[d - 1] else 0.0 for d in range(1, DEPTH + 1)]
        print(f"| {n if n < 5 else '5+'} | {kind} | {row[0]} | " + " | ".join(f"{c:.2f}" for c in cond) + " |")


if __name__ == "__main__":
    main()
