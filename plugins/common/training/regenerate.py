"""`specplug train --regenerate`: the frozen target writes its own replies to the training
prompts (self-distillation), cached on disk.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from specplug.common.training.config import TrainConfig
from specplug.common.training.samples import first_prompt

logger = logging.getLogger(__name__)


def regenerate_cache_path(cfg: TrainConfig) -> Path:
    """$SPECPLUG_CACHE/regenerated/KEY.json, KEY hashing everything the replies depend on:
    target, data set (for a file also its size and mtime), which conversations (max-samples,
    held-out count, seed), max-length and the generation settings."""
    import hashlib

    from specplug.common.testbed import cache_root

    data = cfg.data
    if cfg.data != "sharegpt":  # a file: its path, size and modification time
        stat = Path(cfg.data).stat()
        data = [str(Path(cfg.data).resolve()), stat.st_size, stat.st_mtime_ns]
    key = {"target": str(Path(cfg.target).resolve()), "data": data, "max_samples": cfg.max_samples,
           "heldout_samples": cfg.heldout_samples, "seed": cfg.seed, "max_length": cfg.max_length,
           "temperature": cfg.regen_temperature, "version": 2}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "regenerated" / f"{digest}.json"


def regenerate(target, tokenizer, conversations: list[list[dict]], cfg: TrainConfig) -> list[list[dict]]:
    """Each conversation's first prompt + the frozen target's own reply to it (greedy when
    cfg.regen_temperature is 0), replies up to max_length minus the prompt's tokens.

    Batched (cfg.regen_batch prompts, left-padded) with an explicit attention mask that is 1
    on every prompt token: transformers would otherwise infer it from the pad id and mask
    real end-of-turn tokens inside ChatML prompts when pad == eos. Cached at
    `regenerate_cache_path(cfg)`: a second call (a rerun, --resume) reads the file and
    generates nothing. Invariant: the result has one conversation per input, in order; one
    without a prompt before its first reply, or whose prompt is over max_length/2 tokens,
    comes back empty (tokenizing drops it). Prompts are generated shortest first.
    """
    from tqdm.auto import tqdm

    from specplug.common.training.data import format_chat

    cache = regenerate_cache_path(cfg)
    if cache.is_file():
        logger.info("regenerated replies from %s", cache)
        return json.loads(cache.read_text())
    prompts = [first_prompt(c) for c in conversations]
    texts = {i: format_chat(tokenizer, p, add_generation_prompt=True) for i, p in enumerate(prompts) if p}
    lengths = {i: len(tokenizer(t, add_special_tokens=False)["input_ids"]) for i, t in texts.items()}
    # shortest first, so a batch's prompts (and its padding) are alike; a prompt over half
    # of max_length would leave its reply cut to less than half the sample: dropped
    answerable = sorted((i for i in texts if lengths[i] <= cfg.max_length // 2), key=lambda i: (lengths[i], i))
    torch.manual_seed(cfg.seed)  # sampled replies (regen_temperature > 0) are reproducible too
    replies: dict[int, str] = {}
    size = cfg.regen_batch
    for start in tqdm(range(0, len(answerable), size), desc="regenerate", unit="batch", dynamic_ncols=True):
        chunk = answerable[start:start + size]
        replies.update(zip(chunk, _generate_replies(target, tokenizer, [texts[i] for i in chunk], cfg)))
    logger.info("regenerate: %d of %d conversations answered (the rest have no prompt, or one over "
                "max_length/2 = %d tokens)", len(replies), len(prompts), cfg.max_length // 2)
    regenerated = [prompts[i] + [{"role": "assistant", "content": replies[i]}] if i in replies else []
                   for i in range(len(prompts))]
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(regenerated))
    tmp.rename(cache)  # atomic: a half-written cache is never read
    logger.info("regenerated %d replies into %s", len(regenerated), cache)
    return regenerated


def _generate_replies(target, tokenizer, texts: list[str], cfg: TrainConfig) -> list[str]:
    """The target's replies to chat-templated prompt texts, up to max_length tokens in all
    for the batch's shortest prompt, decoded without special tokens."""
    from specplug.common.training.distill import generate_replies

    shortest = min(len(tokenizer(t, add_special_tokens=False)["input_ids"][-(cfg.max_length - 1):]) for t in texts)
    return generate_replies(target, tokenizer, texts, max_new_tokens=max(1, cfg.max_length - shortest),
                            temperature=cfg.regen_temperature, max_prompt_tokens=cfg.max_length - 1,
                            device=cfg.device)
