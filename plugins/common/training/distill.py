"""Self-distilled training data (the core of `specplug distill`): the target's own replies to a prompt set.

A head drafts what the TARGET would say, so it learns best from the target's own
replies (self-distillation, as the EAGLE and Medusa recipes do). This command answers
each conversation's first prompt with the frozen target and writes ShareGPT-style JSONL
that `specplug train --data FILE` reads:

    {"id": "<index in --data>", "conversations": [{"from": "human", "value": ...},
                                                  {"from": "gpt", "value": <reply>}]}

The engine that writes the replies is the caller's (specplug.distill: `vllm`, batched,
several times faster on a CPU, or `hf`, transformers' generate). Invariants:
  * the prompts and their order are a pure function of (--data, --seed): a larger
    --max-prompts extends a smaller one's list, never reorders it;
  * the file is appended batch by batch, and a rerun with the same settings answers only
    the prompts not in it yet (resumable; settings live in FILE.meta.json and a rerun
    with other settings is refused, naming them);
  * replies are greedy unless --temperature > 0.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ROLE_TO_SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt"}


@dataclass(frozen=True)
class DistillConfig:
    """Settings of one distilled file (all but max_prompts / batch_size / engine must match
    on resume). max_prompt_tokens: longer first prompts are skipped (their replies would
    crowd the training window)."""

    target: str
    data: str = "sharegpt"
    max_prompts: int | None = None
    max_prompt_tokens: int = 128
    max_new_tokens: int = 384
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self):
        for name in ("max_prompt_tokens", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"--max-prompts must be >= 1, got {self.max_prompts}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")

    def identity(self) -> dict:
        """The settings a file's replies depend on (max_prompts only sets how many)."""
        d = asdict(self)
        d.pop("max_prompts")
        d["target"] = str(Path(self.target).resolve())
        return d


@dataclass(frozen=True)
class PromptItem:
    id: str  # index of the conversation in --data
    messages: list  # the first prompt: system / user messages before the first reply
    text: str  # chat-templated, with the generation prompt


def select_prompts(tokenizer, conversations: list[list[dict]], cfg: DistillConfig) -> list[PromptItem]:
    """First prompts in a seeded order, duplicates and over-long ones skipped, at most
    cfg.max_prompts."""
    from specplug.common.training.data import format_chat
    from specplug.common.training.samples import first_prompt

    order = list(range(len(conversations)))
    random.Random(cfg.seed).shuffle(order)
    items, seen = [], set()
    for i in order:
        if cfg.max_prompts is not None and len(items) >= cfg.max_prompts:
            break
        messages = first_prompt(conversations[i])
        if not messages or messages[-1]["role"] != "user" or not messages[-1]["content"].strip():
            continue
        text = format_chat(tokenizer, messages, add_generation_prompt=True)
        if text in seen or len(tokenizer(text, add_special_tokens=False)["input_ids"]) > cfg.max_prompt_tokens:
            continue
        seen.add(text)
        items.append(PromptItem(str(i), messages, text))
    return items


def record(item: PromptItem, reply: str) -> dict:
    """One JSONL record: the prompt's messages and the reply in ShareGPT form."""
    turns = [{"from": ROLE_TO_SHAREGPT[m["role"]], "value": m["content"]} for m in item.messages]
    return {"id": item.id, "conversations": turns + [{"from": "gpt", "value": reply}]}


def meta_path(out: Path) -> Path:
    return out.with_name(out.name + ".meta.json")


def check_resume(out: Path, cfg: DistillConfig) -> set[str]:
    """Ids already answered in `out` (empty for a new file); ValueError naming every
    setting that differs from the file's."""
    meta = meta_path(out)
    if not out.exists():
        return set()
    if not meta.is_file():
        raise ValueError(f"--out {out} exists but has no {meta.name}: not written by specplug distill; "
                         "choose another --out or delete the file")
    saved = json.loads(meta.read_text())
    differ = {k: (saved.get(k), v) for k, v in cfg.identity().items() if saved.get(k) != v}
    if differ:
        named = ", ".join(f"{k} (file: {a!r}, now: {b!r})" for k, (a, b) in differ.items())
        raise ValueError(f"--out {out} was distilled with other settings: {named}; "
                         "rerun with the file's settings to extend it, or choose another --out")
    return _answered_ids(out)


def _answered_ids(out: Path) -> set[str]:
    """Ids of the whole records in `out`; a last line cut off by an interrupted write is
    dropped from the file (its prompt is answered again)."""
    text = out.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        logger.info("%s: dropping a record cut off by an interrupted write", out)
        out.write_text("".join(lines[:-1]), encoding="utf-8")
        lines = lines[:-1]
    return {json.loads(line)["id"] for line in lines if line.strip()}


def hf_generator(target: str, cfg: DistillConfig):
    """texts -> replies with transformers' generate."""
    from specplug.common.training.target import load_target

    model, tokenizer = load_target(target)
    return lambda texts: generate_replies(model, tokenizer, texts, max_new_tokens=cfg.max_new_tokens,
                                          temperature=cfg.temperature)


@torch.no_grad()
def generate_replies(model, tokenizer, texts: list[str], *, max_new_tokens: int, temperature: float = 0.0,
                     max_prompt_tokens: int | None = None, device: str = "cpu") -> list[str]:
    """The model's replies to chat-templated prompt texts (at most max_new_tokens each),
    decoded without special tokens.

    Left-padded batch with an explicit attention mask that is 1 on every prompt token:
    transformers would otherwise infer it from the pad id and mask real end-of-turn tokens
    inside ChatML prompts when pad == eos. Prompts longer than max_prompt_tokens keep
    their last max_prompt_tokens tokens."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    if max_prompt_tokens is not None:
        encoded = [e[-max_prompt_tokens:] for e in encoded]
    width = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)  # [B, width]: 1 on every prompt token, 0 on the left padding
    for row, e in enumerate(encoded):
        ids[row, width - len(e):] = torch.tensor(e)
        mask[row, width - len(e):] = 1
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                         pad_token_id=pad_id, eos_token_id=tokenizer.eos_token_id, **sampling)
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in out[:, width:].tolist()]


def distill(cfg: DistillConfig, out: Path, make_generate: Callable[[], Callable[[list[str]], list[str]]], *,
            chunk: int = 256) -> dict:
    """Answer the prompts not yet in `out`, appending `chunk` records at a time; returns a
    summary (prompts, answered now, tokens/s). `make_generate()` builds the engine's
    generate(texts) -> replies, only when there is something to answer (specplug.distill
    chooses the engine: the core knows none)."""
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from specplug.common.training.data import conversations as load_conversations

    tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    done = check_resume(out, cfg)
    convs = load_conversations("sharegpt", None if cfg.data == "sharegpt" else cfg.data)
    items = select_prompts(tokenizer, convs, cfg)
    todo = [it for it in items if it.id not in done]
    logger.info("%d prompts, %d answered already, %d to go", len(items), len(items) - len(todo), len(todo))
    out.parent.mkdir(parents=True, exist_ok=True)
    meta_path(out).write_text(json.dumps(cfg.identity(), indent=2) + "\n")
    generate = make_generate() if todo else None
    tokens, start = 0, time.perf_counter()
    with tqdm(total=len(todo), desc="distill", unit="prompt", dynamic_ncols=True) as bar:
        for i in range(0, len(todo), chunk):
            part = todo[i:i + chunk]
            replies = generate([it.text for it in part])
            tokens += sum(len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in replies)
            with out.open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(record(it, r)) + "\n" for it, r in zip(part, replies))
            bar.update(len(part))
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.0f} tok/s", refresh=False)
    seconds = time.perf_counter() - start
    return {"out": str(out), "prompts": len(items), "answered_now": len(todo), "reply_tokens": tokens,
            "seconds": round(seconds, 1), "tokens_per_s": round(tokens / seconds, 1) if todo else None}
