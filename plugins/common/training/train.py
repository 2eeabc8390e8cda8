"""`specplug train`: EAGLE-3 and Medusa heads for a Hugging Face causal LM.

The head trains on the frozen target's states: written once before the loop into a
memory-mapped cache (`states`, the default) or recomputed by a live forward on
every batch (`--no-states-cache`, `target_pass`). The method-specific parts (head
construction, loss, saving) live in `eagle3` and `medusa`, the loop (LR
schedule, checkpoints, stopping, progress, throughput) in `loop`; this module owns
the settings (`TrainConfig`, the ONE place for defaults), the up-front checks that fail
before any long work, the data (chat conversations -> token ids + a mask of assistant
tokens), the target and the command line.

Layout of an output folder:
  OUT/config.json + weights     the head in its method's default (or --format) format
  OUT/training.json             settings, losses, accuracies, tokens/s per epoch
  OUT/checkpoint/               training state: head.safetensors (fp32 trainable
                                tensors + fixed buffers), optimizer.pt, rng.pt, state.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import os
import random
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

logger = logging.getLogger(__name__)

METHODS = ("eagle3", "medusa")
CHECKPOINT = "checkpoint"


@dataclass(frozen=True)
class TrainConfig:
    """All training settings and their defaults (the CLI reads its defaults from here).

    steps / epochs: the length of the run and of its LR schedule, in optimizer steps
    (epochs are converted: ceil(epochs * samples / batch_size) target passes x reuse);
    1000 steps when neither is given. minutes: a budget per SITTING, not the schedule:
    the run checkpoints and stops, and `--resume` continues it (same data order, same LR).
    max_length: tokens per sample (longer conversations are cut).
    ttt_steps: EAGLE-3 training-time-test steps unrolled per batch (step j drafts the
    token j+1 places past the first draft). step_decay: loss weight of step / head j
    is step_decay**j. draft_vocab_size: EAGLE-3 draft vocabulary (most frequent
    assistant tokens of the training data). num_heads: Medusa; num_layers: EAGLE-3 decoder
    layers or Medusa residual blocks per head.
    save_dtype: dtype of the written head. checkpoint_every: steps between checkpoints.
    reuse: optimizer steps per target pass (>1 trades data diversity for speed where the
    frozen target's forward dominates, e.g. a busy CPU); steps count optimizer steps.
    heldout_samples: conversations kept out of training (Medusa's rank accuracies).
    eval_prompts / eval_tokens: the final greedy tau check in the reference loop on that
    many held-out MT-bench prompts (0 = skip).
    regenerate: before training, the frozen target writes its own reply to each used
    conversation's first prompt (self-distillation); regen_temperature 0 = greedy;
    regen_batch_size: prompts generated at once (default batch_size; generation holds no
    gradients, so it can be several times larger).
    Cached under $SPECPLUG_CACHE/regenerated (see `regenerate`).
    states_cache: train from the target's states written once (`states`) instead of
    a live target forward per batch; states_cache_dir: its folder (default
    $SPECPLUG_CACHE/states/KEY). threads: torch.set_num_threads (None = torch's default).
    log_file: progress lines (step, loss, accuracy, tokens/s, ETA) every log_every steps
    and at least once a minute, plus the run's log, for runs in the background.
    """

    method: str
    target: str
    out: str
    data: str = "sharegpt"
    steps: int | None = None
    epochs: float | None = None
    minutes: float | None = None
    max_samples: int | None = None
    max_length: int = 512
    batch_size: int = 2
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 100
    reuse: int = 1
    heldout_samples: int = 32
    eval_prompts: int = 4
    eval_tokens: int = 64
    ttt_steps: int = 3
    step_decay: float = 0.8
    draft_vocab_size: int = 8192
    aux_layer_ids: tuple[int, ...] | None = None
    num_heads: int = 4
    num_layers: int = 1
    topk: int = 10
    format: str | None = None
    save_dtype: str = "bfloat16"
    resume: bool = False
    overwrite: bool = False
    init: str | None = None
    revocab: bool = False
    device: str = "cpu"
    regenerate: bool = False
    regen_temperature: float = 0.0
    regen_batch_size: int | None = None
    states_cache: bool = True
    states_cache_dir: str | None = None
    threads: int | None = None
    log_file: str | None = None
    log_every: int = 10

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        for name in ("max_length", "batch_size", "ttt_steps", "draft_vocab_size", "num_heads",
                     "checkpoint_every", "topk", "reuse", "regen_batch", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_length < 8:
            raise ValueError(f"max_length must be >= 8 tokens, got {self.max_length}")
        if self.regen_temperature < 0:
            raise ValueError(f"regen_temperature must be >= 0 (0 = greedy), got {self.regen_temperature}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.epochs is not None and (self.epochs <= 0 or self.steps is not None):
            raise ValueError(f"epochs must be > 0 and exclude --steps (both set the schedule's length), "
                             f"got epochs={self.epochs}, steps={self.steps}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.states_cache_dir and not self.states_cache:
            raise ValueError("--states-cache PATH and --no-states-cache exclude each other")
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite exclude each other: resume keeps the checkpoint, "
                             "overwrite deletes it")
        if self.init and self.resume:
            raise ValueError("--init and --resume exclude each other: --init starts a new run from a trained "
                             "head, --resume continues this run's checkpoint (which already holds --init's start)")
        if self.method == "eagle3" and self.num_layers < 1:
            raise ValueError("--num-layers must be >= 1 for an EAGLE-3 head (its decoder layers), "
                             f"got {self.num_layers}")
        if self.revocab and not (self.init and self.method == "eagle3"):
            raise ValueError("--revocab rebuilds an EAGLE-3 head's draft vocabulary from this run's data when it "
                             "starts from a trained head: pass it with `specplug train eagle3 --init HEAD` (a new "
                             "head takes its vocabulary from the data anyway)")

    @property
    def regen_batch(self) -> int:
        return self.regen_batch_size or self.batch_size

    def schedule_steps(self, num_samples: int) -> int:
        """Optimizer steps of the whole run (the LR schedule's length; where it ends)."""
        if self.steps is not None:
            return self.steps
        if self.epochs is not None:
            return math.ceil(self.epochs * num_samples / self.batch_size) * self.reuse
        return 1000


# ---------------------------------------------------------------------------------------
# Up-front checks: every one runs before the target's weights are loaded
# ---------------------------------------------------------------------------------------
def check_target(target: str | os.PathLike):
    """The target's transformers config; ValueError unless it is a causal LM folder."""
    from transformers import AutoConfig

    path = Path(target)
    if not (path / "config.json").is_file():
        raise ValueError(f"--target {target}: no config.json there; expected a Hugging Face model folder "
                         "(e.g. the output of `specplug testbed`)")
    config = AutoConfig.from_pretrained(path)
    archs = getattr(config, "architectures", None) or []
    if not any(a.endswith("ForCausalLM") for a in archs):
        raise ValueError(f"--target {target}: architectures {archs} is not a causal LM "
                         "(expected a *ForCausalLM model): pass the model that generates, not a head or encoder")
    return config


def check_output(cfg: TrainConfig) -> Path:
    """The output folder, after refusing to overwrite a trained head or checkpoint by accident."""
    out = Path(cfg.out)
    ckpt = out / CHECKPOINT
    held = out.is_dir() and (ckpt.is_dir() or (out / "config.json").is_file())
    if cfg.resume and not (ckpt / "state.json").is_file():
        raise ValueError(f"--resume: {ckpt} holds no checkpoint (state.json); drop --resume to start anew")
    if held and not (cfg.resume or cfg.overwrite):
        raise ValueError(f"--out {out} already holds a head or checkpoint: pass --resume to continue it, "
                         "--overwrite to replace it, or choose another folder")
    return out


def check_init(cfg: TrainConfig, target_config) -> dict | None:
    """The --init head's lineage (folder, steps and CPU minutes behind it), after refusing a
    folder that is not a head of cfg.method for this target; None without --init."""
    if not cfg.init:
        return None
    from specplug.common import formats
    from specplug.common.training import medusa

    method = "medusa" if medusa.is_compact(cfg.init) else formats.load_head(cfg.init, target_config).method
    if method != cfg.method:
        raise ValueError(f"--init {cfg.init} holds a {method} head; `specplug train {cfg.method}` needs a "
                         f"{cfg.method} head (or drop --init to start from scratch)")
    return init_lineage(Path(cfg.init))


def init_lineage(head_dir: Path) -> dict:
    """Steps, minutes and sample tokens of training behind a head folder, read from its
    training.json (its own total when it was itself started with --init); zeros when it
    has none."""
    record = head_dir / "training.json"
    prior = json.loads(record.read_text()) if record.is_file() else {}
    tokens = sum(e["tokens"] for e in prior.get("throughput", {}).get("epochs", []))
    total = prior.get("total") or {"steps": prior.get("steps", 0), "minutes": prior.get("minutes", 0.0),
                                   "tokens": tokens}
    return {"head": str(head_dir), "steps": total["steps"], "minutes": total["minutes"], "tokens": total["tokens"]}


def check_memory(cfg: TrainConfig, target_config, available: int | None = None) -> int:
    """Estimated peak bytes; ValueError when it exceeds the memory available now."""
    vocab, hidden = target_config.vocab_size, target_config.hidden_size
    layers = target_config.num_hidden_layers
    params = 12 * layers * hidden * hidden + 2 * vocab * hidden  # rough Llama count
    tokens = cfg.batch_size * cfg.max_length
    per_token_vocab = {"eagle3": 3 + 4 * cfg.ttt_steps, "medusa": 2 + 4 * cfg.num_heads}[cfg.method]
    need = 4 * params + 4 * tokens * (vocab * per_token_vocab + hidden * (layers + 1 + 20 * cfg.ttt_steps))
    available = _available_memory() if available is None else available
    if available is not None and need > 0.9 * available:
        raise ValueError(
            f"training needs about {need / 2**30:.1f} GiB but {available / 2**30:.1f} GiB is available: "
            f"lower --batch-size ({cfg.batch_size}) or --max-length ({cfg.max_length})")
    return need


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ---------------------------------------------------------------------------------------
# Data: conversations -> (input_ids, loss_mask) samples
# ---------------------------------------------------------------------------------------
class Sample(NamedTuple):
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token belongs to an assistant turn (incl. its end token)


def load_conversations(data: str) -> list[list[dict]]:
    """Conversations for `--data`: a prompt-set name (sharegpt) or a ShareGPT-style .json/.jsonl file."""
    from specplug.common.training import data as datasets

    path = Path(data)
    if data == "sharegpt":
        convs = datasets.conversations("sharegpt")
    elif path.is_file():
        try:
            convs = datasets.conversations("sharegpt", path)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"--data {data}: not ShareGPT-style JSON/JSONL ({exc}); expected records "
                             '{"conversations": [{"from": "human"|"gpt", "value": ...}, ...]}') from exc
    else:
        raise ValueError(f"--data {data!r}: expected 'sharegpt' or a path to a ShareGPT-style .json/.jsonl file")
    convs = [c for c in convs if any(m["role"] == "assistant" and m["content"].strip() for m in c)]
    if not convs:
        raise ValueError(f"--data {data}: no conversation with an assistant turn; nothing to train on")
    return convs


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int) -> Sample | None:
    """Token ids of the chat-templated conversation and a mask of its assistant tokens.

    Assistant spans are found as character ranges: the template text up to the turn
    (with the generation prompt) and up to its end; tokens starting inside a span are
    masked in. None when no assistant token survives the cut to max_length.
    """
    from specplug.common.training.data import format_chat

    while messages and messages[0]["role"] == "assistant":
        messages = messages[1:]
    if not messages:
        return None
    text = format_chat(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(format_chat(tokenizer, messages[:i], add_generation_prompt=True)) if i else 0
            spans.append((start, len(format_chat(tokenizer, messages[: i + 1], add_generation_prompt=False))))
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False, truncation=True,
                    max_length=max_length)
    mask = [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"]]
    if sum(mask) == 0:
        return None
    return Sample(list(enc["input_ids"]), mask)


def build_samples(tokenizer, conversations: list[list[dict]], cfg: TrainConfig,
                  rewrite=None) -> tuple[list[Sample], list[Sample]]:
    """(train, held-out): shuffled (seeded) tokenized samples; held-out ones are taken from
    the END of the shuffled order, training ones (at most cfg.max_samples) from its start.

    rewrite (e.g. `regenerate`'s): list of conversations -> list of the same length; when
    given, exactly the first heldout_samples / max_samples conversations of each order are
    rewritten (in one call) and then tokenized."""
    order = list(range(len(conversations)))
    random.Random(cfg.seed).shuffle(order)
    taken = len(conversations) - cfg.heldout_samples if len(conversations) > 2 * cfg.heldout_samples else None
    heldout_order, train_order = order[::-1], order[:taken]
    if rewrite is not None:
        heldout_order, train_order = heldout_order[: cfg.heldout_samples], train_order[: cfg.max_samples]
        chosen = sorted(set(heldout_order) | set(train_order))
        conversations = dict(zip(chosen, rewrite([conversations[i] for i in chosen])))
    heldout = _tokenize_some(tokenizer, conversations, heldout_order, cfg.heldout_samples, cfg.max_length)
    samples = _tokenize_some(tokenizer, conversations, train_order, cfg.max_samples, cfg.max_length)
    if not samples:
        raise ValueError("no usable training sample: every conversation lost its assistant tokens "
                         f"within --max-length {cfg.max_length}; raise it")
    return samples, heldout


def _tokenize_some(tokenizer, conversations, order, limit, max_length) -> list[Sample]:
    out: list[Sample] = []
    for idx in order:
        if limit is not None and len(out) >= limit:
            break
        sample = tokenize_conversation(tokenizer, conversations[idx], max_length)
        if sample is not None:
            out.append(sample)
    return out


# ---------------------------------------------------------------------------------------
# --regenerate: the target writes the replies (self-distillation), cached on disk
# ---------------------------------------------------------------------------------------
def first_prompt(messages: list[dict]) -> list[dict]:
    """The messages before the conversation's first assistant turn (system + first user turn).

    Leading assistant turns are skipped first, as `tokenize_conversation` does; a
    conversation with nothing else has an empty first prompt."""
    while messages and messages[0]["role"] == "assistant":
        messages = messages[1:]
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            return messages[:i]
    return list(messages)


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


class Batch(NamedTuple):
    input_ids: torch.Tensor  # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T] 1 = real token
    loss_mask: torch.Tensor  # [B, T] 1 = assistant token (a label worth learning)


def collate(samples: list[Sample], pad_id: int) -> Batch:
    """Right-pad samples to the longest one."""
    width = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    loss = torch.zeros((len(samples), width), dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s.input_ids)
        ids[row, :n] = torch.tensor(s.input_ids)
        attn[row, :n] = 1
        loss[row, :n] = torch.tensor(s.loss_mask)
    return Batch(ids, attn, loss)


def batch_indices(step: int, batch_size: int, num_samples: int, seed: int | None = None) -> list[int]:
    """Sample indices of the step-th batch of an endless pass (a pure function: resume is
    exact). seed None: the samples in order, wrapping around; an int: every epoch visits
    each sample once, in an order shuffled by (seed, epoch)."""
    out = []
    for k in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(k, num_samples)
        out.append(pos if seed is None else _epoch_order(num_samples, seed, epoch)[pos])
    return out


@functools.lru_cache(maxsize=4)
def _epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """A permutation of range(num_samples) fixed by (seed, epoch)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def batch_at(samples: list[Sample], step: int, batch_size: int, pad_id: int) -> Batch:
    """The step-th batch of an endless pass over samples (`batch_indices`, collated)."""
    return collate([samples[i] for i in batch_indices(step, batch_size, len(samples))], pad_id)


def shift_left(x: torch.Tensor, n: int, fill: float | int = 0) -> torch.Tensor:
    """x[:, t] <- x[:, t + n] along dim 1, padded with `fill` at the end."""
    if n == 0:
        return x
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


# ---------------------------------------------------------------------------------------
# The frozen target
# ---------------------------------------------------------------------------------------
class TargetOutput(NamedTuple):
    """The frozen target's states for a batch: from a live pass (`target_pass`, logits
    given) or from cached states (`states`: logits None, top1 and lm_head given).
    Losses read scores through `scores` / `argmax`, which agree on both: the cached view
    computes only the vocab columns asked for, from the cached last hidden state."""

    last_hidden: torch.Tensor  # [B, T, H] after the final norm (what the lm_head reads)
    logits: torch.Tensor | None  # [B, T, V] float32: position t scores token t + 1
    aux: torch.Tensor | None  # [B, T, 3H] concatenated aux hidden states (EAGLE-3), else None
    top1: torch.Tensor | None = None  # [B, T] the target's full-vocab argmax (cached states)
    lm_head: torch.nn.Module | None = None  # the target's output layer (cached states)

    def scores(self, columns: torch.Tensor | None = None) -> torch.Tensor:
        """float32 target logits [B, T, V], or [B, T, len(columns)] for those vocab ids only."""
        if self.logits is not None:
            return self.logits if columns is None else self.logits[..., columns]
        weight, bias = self.lm_head.weight, getattr(self.lm_head, "bias", None)
        if columns is not None:
            weight, bias = weight[columns], (bias[columns] if bias is not None else None)
        return torch.nn.functional.linear(self.last_hidden.to(weight.dtype), weight, bias).float()

    def argmax(self) -> torch.Tensor:
        """The target's top-1 token id at each position over its full vocab: [B, T]."""
        return self.top1 if self.top1 is not None else self.logits.argmax(-1)


@torch.no_grad()
def target_pass(target, batch: Batch, aux_layer_ids: tuple[int, ...] | None = None) -> TargetOutput:
    """One frozen forward of the target. Aux id i is `hidden_states[i]` (input of layer i)."""
    out = target.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                            output_hidden_states=aux_layer_ids is not None, use_cache=False)
    last = out.last_hidden_state
    logits = target.get_output_embeddings()(last).float()
    aux = torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
    return TargetOutput(last, logits, aux)


def load_target(path: str, device: str = "cpu"):
    """The target in fp32 (CPU) or bf16 (GPU), frozen, in eval mode, with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    target.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"--target {path}: its tokenizer has no chat_template; training formats "
                         "conversations with it: use an instruct/chat model or add a template")
    return target, tokenizer


# ---------------------------------------------------------------------------------------
# A run: set up, loop (`loop`), output
# ---------------------------------------------------------------------------------------
def method_module(method: str):
    """The module implementing one method's head, loss and output."""
    if method == "eagle3":
        from specplug.common.training import eagle3 as module
    else:
        from specplug.common.training import medusa as module
    return module


class OutputContext(NamedTuple):
    """What a method's save_output may need beyond the head: the target, held-out samples."""

    target: Any
    heldout: list  # list[Sample], never trained on
    pad_id: int


@dataclass
class TrainResult:
    out: str
    steps: int
    seconds: float
    first_loss: float
    last_loss: float
    accuracy: list[float]  # per step position (EAGLE-3) or head (Medusa), top-1, last window
    files: list[str]
    eval: dict | None = None  # evaluate.evaluate's report (greedy, MT-bench), when run
    schedule_steps: int = 0  # steps of the whole run (steps < schedule_steps: stopped early)
    stopped: str | None = None  # None = finished; "minutes" / "SIGINT" / "SIGTERM": --resume continues


def train(cfg: TrainConfig) -> TrainResult:
    """Train a head as `cfg` says; returns what was written and the loss curve's ends.

    A sitting stopped early (--minutes, SIGINT, SIGTERM) writes its checkpoint and
    training.json; after --minutes also the head so far; the final eval runs only at the
    schedule's end."""
    from specplug.common.training import loop as train_loop

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = check_output(cfg)
    target_config = check_target(cfg.target)
    check_memory(cfg, target_config)
    method = method_module(cfg.method)
    method.preflight(cfg, target_config)
    lineage = check_init(cfg, target_config)
    convs = load_conversations(cfg.data)
    with train_loop.log_to_file(cfg.log_file):
        target, tokenizer = load_target(cfg.target, cfg.device)
        rewrite = (lambda chosen: regenerate(target, tokenizer, chosen, cfg)) if cfg.regenerate else None
        samples, heldout = build_samples(tokenizer, convs, cfg, rewrite)
        logger.info("%d training samples, %d tokens, %d assistant tokens", len(samples),
                    sum(len(s.input_ids) for s in samples), sum(sum(s.loss_mask) for s in samples))
        run, state = _start(cfg, method, target, tokenizer, samples, out)
        if lineage is not None:
            state["init"] = lineage
        stopped = train_loop.run_loop(run, state)
        return _finish(run, state, tokenizer, heldout, stopped)


def _start(cfg: TrainConfig, method, target, tokenizer, samples: list[Sample], out: Path):
    """(train_loop.Run, state) of this sitting: a new head, or the checkpoint's head,
    optimizer and RNG states (--resume); the cached target states opened (written if new)."""
    from specplug.common.training import loop as train_loop

    if cfg.overwrite and (out / CHECKPOINT).is_dir():
        import shutil
        shutil.rmtree(out / CHECKPOINT)
    torch.manual_seed(cfg.seed)
    if cfg.resume:
        head, state = method.load_checkpoint(out / CHECKPOINT, target, cfg)
    elif cfg.init:
        head = method.init_head(Path(cfg.init), target, cfg, samples)
        state = {"step": 0, "losses": [], "seconds": 0.0}
    else:
        head, state = method.build_head(target, samples, cfg), {"step": 0, "losses": [], "seconds": 0.0}
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    schedule = cfg.schedule_steps(len(samples))
    train_loop.note_schedule(state, schedule, cfg)
    states = _states_cache(cfg, method, head, target, samples, pad_id, state)
    if cfg.resume:
        optimizer.load_state_dict(torch.load(out / CHECKPOINT / "optimizer.pt", weights_only=True))
        train_loop.restore_rng(out / CHECKPOINT)
    return train_loop.Run(cfg, method, head, target, samples, optimizer, out, pad_id, schedule, states), state


def _states_cache(cfg: TrainConfig, method, head, target, samples: list[Sample], pad_id: int, state: dict):
    """The reader of the cached target states (written now when missing); None with
    --no-states-cache. state["states_cache"] records the sitting that wrote them."""
    if not cfg.states_cache:
        return None
    from specplug.common.training import states as train_cache

    reader, info = train_cache.open_states(cfg, target, samples, method.aux_ids(head, target), pad_id)
    if info["written"] or "states_cache" not in state:
        state["states_cache"] = info
    return reader


def _finish(run, state: dict, tokenizer, heldout: list[Sample], stopped: str | None) -> TrainResult:
    """Write the head (not after a signal), run the final eval (only when finished) and
    training.json; the result."""
    from specplug.common.training import loop as train_loop

    files: list[str] = []
    if stopped in (None, "minutes"):
        context = OutputContext(run.target, heldout, run.pad_id)
        files = run.method.save_output(run.head, run.out, run.cfg, state, context)
    state["eval"] = final_eval(run.out, run.target, tokenizer, run.cfg) if stopped is None else None
    train_loop.write_training_record(run, state, stopped)
    losses = state["losses"]
    return TrainResult(str(run.out), state["step"], state["seconds"], losses[0] if losses else float("nan"),
                       losses[-1] if losses else float("nan"), state.get("accuracy", []), files, state["eval"],
                       run.schedule, stopped)


def final_eval(out: Path, target, tokenizer, cfg: TrainConfig) -> dict | None:
    """Greedy tau of the written head on cfg.eval_prompts MT-bench prompts (None if 0)."""
    if cfg.eval_prompts < 1:
        return None
    from specplug.common.training.evaluate import EvalConfig, evaluate, load_drafter

    eval_cfg = EvalConfig("mtbench", cfg.eval_prompts, cfg.eval_tokens)
    report = evaluate(target, tokenizer, load_drafter(out, target), eval_cfg)
    logger.info("reference loop, %d MT-bench prompts x %d tokens, greedy: tau %.2f, acceptance by position %s",
                cfg.eval_prompts, cfg.eval_tokens, report["tau"], report["acceptance_per_position"])
    return report


def read_checkpoint_state(ckpt: Path) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(state.json, head tensors, head_config.json) of a checkpoint folder."""
    from safetensors.torch import load_file

    state = json.loads((ckpt / "state.json").read_text())
    return state, load_file(str(ckpt / "head.safetensors")), json.loads((ckpt / "head_config.json").read_text())


def specplug_section(method: str, **extra: Any) -> dict:
    """The `specplug` config section of a head made here (tree defaults from TreeConfig)."""
    from specplug.common.tree import TreeConfig

    section = {"version": 1, "method": method, "tree": TreeConfig().to_dict(), "verification": "lossless"}
    section.update(extra)
    return section


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    parser.add_argument("method", choices=METHODS, help="head type to train")
    parser.add_argument("--target", required=True, help="Hugging Face causal-LM folder (frozen)")
    parser.add_argument("--out", required=True, help="output folder for the head and its checkpoint")
    parser.add_argument("--data", default=d["data"], help="'sharegpt' or a ShareGPT-style .json/.jsonl file")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps of the whole run = the LR schedule's length (default: 1000, "
                             "or --epochs)")
    parser.add_argument("--epochs", type=float, default=None,
                        help="passes over the training samples, converted to --steps (excludes --steps)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="wall-clock budget of THIS sitting: checkpoint and stop, then rerun with --resume "
                             "(the LR schedule follows --steps / --epochs only)")
    parser.add_argument("--max-samples", type=int, default=None, help="use at most this many conversations")
    for name, kind in (("max_length", int), ("batch_size", int), ("lr", float), ("warmup_steps", int),
                       ("seed", int), ("checkpoint_every", int), ("reuse", int), ("heldout_samples", int),
                       ("ttt_steps", int), ("step_decay", float), ("eval_prompts", int), ("eval_tokens", int),
                       ("draft_vocab_size", int), ("num_layers", int), ("topk", int)):
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=d[name], help=_HELP.get(name, name))
    parser.add_argument("--heads", type=int, default=d["num_heads"], help="Medusa heads")
    parser.add_argument("--aux-layers", default=None, help="EAGLE-3 aux layer ids, e.g. 2,15,27 (default 2,L//2,L-3)")
    parser.add_argument("--format", default=None,
                        help="output format: eagle3 (default) or speculators; medusa (default) or vllm-medusa")
    parser.add_argument("--save-dtype", default=d["save_dtype"], choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--device", default=d["device"], help="torch device (cpu, cuda)")
    parser.add_argument("--regenerate", action="store_true",
                        help="self-distillation: the target first writes its own replies to the training "
                             "prompts (cached under $SPECPLUG_CACHE/regenerated) and the head trains on those")
    parser.add_argument("--regen-temperature", type=float, default=d["regen_temperature"],
                        help="--regenerate sampling temperature (0 = greedy)")
    parser.add_argument("--regen-batch-size", type=int, default=None,
                        help="--regenerate: prompts generated at once (default --batch-size)")
    parser.add_argument("--states-cache", default=None, metavar="PATH",
                        help="folder of the cached target states (default $SPECPLUG_CACHE/states/KEY, "
                             "KEY hashing target, samples and aux layers)")
    parser.add_argument("--no-states-cache", action="store_true",
                        help="no cached target states: a live target forward on every batch")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (torch.set_num_threads; default: torch's)")
    parser.add_argument("--log-file", default=None, metavar="PATH",
                        help="append progress lines (step, loss, accuracy, tokens/s, ETA) and the log to PATH, "
                             "for runs in the background")
    parser.add_argument("--log-every", type=int, default=d["log_every"],
                        help="--log-file: a progress line every N steps (and at least once a minute)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from OUT/checkpoint (same data order, same LR schedule)")
    parser.add_argument("--init", default=None, metavar="HEAD",
                        help="start from a trained head folder of the same method (e.g. the committed test-bed "
                             "head) instead of from scratch: a new LR schedule over this run's data; its "
                             "draft vocabulary and shape come from HEAD; training.json adds HEAD's steps and "
                             "minutes to this run's in `total`")
    parser.add_argument("--revocab", action="store_true",
                        help="EAGLE-3 with --init: rebuild the draft vocabulary from this run's data (its "
                             "--draft-vocab-size most frequent reply tokens); tokens HEAD already drafts keep "
                             "their trained lm_head rows, new ones start from the target's. For a head whose "
                             "vocabulary misses tokens the target often writes (the log prints both coverages)")
    parser.add_argument("--overwrite", action="store_true", help="replace a head or checkpoint in OUT")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


_HELP = {
    "max_length": "tokens per training sample", "batch_size": "samples per step", "lr": "peak learning rate",
    "ttt_steps": "EAGLE-3 training-time-test steps unrolled", "step_decay": "loss weight decay per step/head",
    "draft_vocab_size": "EAGLE-3 draft vocabulary size",
    "num_layers": "EAGLE-3: decoder layers of the head; Medusa: residual blocks per head (with --init: more "
                  "than HEAD has appends identity layers / blocks)",
    "topk": "Medusa: ranks whose accuracy is recorded",
    "reuse": "optimizer steps per target pass",
    "heldout_samples": "conversations kept out of training (Medusa rank accuracies)",
    "eval_prompts": "final greedy tau check: MT-bench prompts in the reference loop (0 = skip)",
    "eval_tokens": "final tau check: new tokens per prompt", "checkpoint_every": "steps between checkpoints",
}


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    aux = tuple(int(x) for x in args.aux_layers.split(",")) if args.aux_layers else None
    return TrainConfig(
        method=args.method, target=args.target, out=args.out, data=args.data, steps=args.steps,
        minutes=args.minutes, max_samples=args.max_samples, max_length=args.max_length,
        batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps, seed=args.seed,
        checkpoint_every=args.checkpoint_every, reuse=args.reuse, heldout_samples=args.heldout_samples,
        ttt_steps=args.ttt_steps, step_decay=args.step_decay, eval_prompts=args.eval_prompts,
        eval_tokens=args.eval_tokens,
        draft_vocab_size=args.draft_vocab_size, aux_layer_ids=aux, num_heads=args.heads,
        num_layers=args.num_layers, topk=args.topk, format=args.format, save_dtype=args.save_dtype,
        resume=args.resume, overwrite=args.overwrite, init=args.init, revocab=args.revocab, device=args.device,
        regenerate=args.regenerate,
        regen_temperature=args.regen_temperature, regen_batch_size=args.regen_batch_size, epochs=args.epochs,
        states_cache=not args.no_states_cache, states_cache_dir=args.states_cache, threads=args.threads,
        log_file=args.log_file, log_every=args.log_every)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="specplug train: %(message)s")
    try:
        result = train(config_from_args(args))
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    if args.json:
        print(json.dumps(dataclasses.asdict(result), indent=2))
    elif result.stopped:
        print(f"stopped ({result.stopped}) at step {result.steps} of {result.schedule_steps}: checkpoint in "
              f"{result.out}/{CHECKPOINT}; rerun the same command with --resume to continue")
    else:
        print(f"wrote {result.out} after {result.steps} steps ({result.seconds / 60:.1f} min): "
              f"loss {result.first_loss:.3f} -> {result.last_loss:.3f}, "
              f"top-1 accuracy by position {result.accuracy}")
        if result.eval:
            print(f"reference loop on {result.eval['eval']['prompts']} MT-bench prompts (greedy): "
                  f"tau {result.eval['tau']}, acceptance by position {result.eval['acceptance_per_position']}")
    return 128 + int(getattr(signal, result.stopped)) if result.stopped in ("SIGINT", "SIGTERM") else 0
