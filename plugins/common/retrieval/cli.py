"""The `specplug datastore` command: build a datastore from a corpus, or validate and summarise one."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from .config import RetrievalConfig
from .datastore import build_datastore, load_datastore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter
    build = actions.add_parser("build", formatter_class=fmt, help="tokenize a corpus and write a datastore",
                               description="Tokenize a corpus with the target's tokenizer and write a "
                                           "retrieval datastore (.npz, ~68 bytes per token at n = 1..8).")
    build.add_argument("--target", required=True, default=argparse.SUPPRESS,
                       help="target model folder (its tokenizer is used); required")
    build.add_argument("--data", required=True,
                       help="sharegpt | mtbench | humaneval (prompt + canonical solution; overlaps the "
                            "HumanEval benchmark) | a .json/.jsonl file of records with 'conversations' "
                            "(ShareGPT), 'messages' (chat) or 'text'; required", default=argparse.SUPPRESS)
    build.add_argument("--out", required=True, default=argparse.SUPPRESS, help="output datastore path (.npz); required")
    build.add_argument("--max-samples", type=int, default=2000, help="records used, first ones (0 = all)")
    build.add_argument("--max-length", type=int, default=4096, help="tokens kept per record")
    build.add_argument("--min-match", type=int, default=RetrievalConfig.min_match,
                       help="shortest n-gram indexed")
    build.add_argument("--max-match", type=int, default=RetrievalConfig.max_match,
                       help="longest n-gram indexed")
    build.add_argument("--json", action="store_true", help="print the summary as JSON")
    info = actions.add_parser("info", formatter_class=fmt, help="validate a datastore and print its summary",
                              description="Validate a retrieval datastore and print its summary.")
    info.add_argument("path", help="datastore path (.npz)")
    info.add_argument("--json", action="store_true", help="print the summary as JSON")


def _chat_text(tokenizer, messages: list[dict]) -> str:
    from specplug.common.training.data import format_chat

    if getattr(tokenizer, "chat_template", None):
        return format_chat(tokenizer, messages, add_generation_prompt=False)
    return "\n".join(m["content"] for m in messages)


def _file_texts(path: Path, tokenizer) -> list[str]:
    from specplug.common.training import data

    records = data.load_records(path)
    shared = data.conversations("sharegpt", path) if any("conversations" in r for r in records) else None
    texts = []
    for i, record in enumerate(records):
        if "text" in record:
            texts.append(str(record["text"]))
        elif "messages" in record:
            texts.append(_chat_text(tokenizer, list(record["messages"])))
        elif shared is not None and shared[i]:
            texts.append(_chat_text(tokenizer, shared[i]))
    if not texts:
        raise ValueError(f"--data {path}: no record with 'text', 'messages' or 'conversations': nothing to index")
    return texts


def corpus_texts(data_name: str, tokenizer, limit: int | None = None) -> list[str]:
    """Texts of a `--data` value (a packaged set or a .json/.jsonl file), the first ``limit``."""
    import gzip

    from specplug.common.training import data

    if data_name == "humaneval":
        with gzip.open(data.asset_path("humaneval"), "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [r["prompt"] + r["canonical_solution"] for r in rows[:limit]]
    if data_name in data.PROMPT_SETS:
        return [_chat_text(tokenizer, c) for c in [c for c in data.conversations(data_name) if c][:limit]]
    path = Path(data_name)
    if not path.is_file():
        raise ValueError(f"--data {data_name!r}: expected one of {data.PROMPT_SETS} or a .json/.jsonl file")
    return _file_texts(path, tokenizer)[:limit]


def _build(args: argparse.Namespace) -> dict:
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    texts = corpus_texts(args.data, tokenizer, args.max_samples if args.max_samples > 0 else None)
    sequences = [tokenizer(t, add_special_tokens=False, truncation=True, max_length=args.max_length)["input_ids"]
                 for t in tqdm(texts, desc="tokenizing", unit="record")]
    store = build_datastore(sequences, args.out, min_match=args.min_match, max_match=args.max_match,
                            vocab_size=len(tokenizer), source=f"{args.data} via {args.target}")
    return {"path": str(args.out), "bytes": Path(args.out).stat().st_size, **store.summary()}


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="specplug datastore: %(message)s")
    info = _build(args) if args.action == "build" else {"path": args.path, **load_datastore(args.path).summary()}
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print("\n".join(f"{k}: {v}" for k, v in info.items()))
    return 0
