"""Test support: tiny random Llama models with a locally trained tokenizer, built offline.

`build_tiny_llama(out_dir, ...)` writes a Hugging Face model folder (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a ChatML template) that
transformers, vLLM and SGLang all load. Everything is seeded, so the same arguments
give the same bytes. `tiny_llama_dir(...)` caches builds under $SPECPLUG_CACHE/tiny.

The weights are random but "peaky" (large lm_head init), so greedy decoding has
clear top-1 margins and engines with different attention kernels agree on it.
head_dim defaults to 32: vLLM's CPU attention supports head sizes 32, 64, 80, 96,
112, 128, 160, 192, 224, 256 and 512 only.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
import shutil
from pathlib import Path

_WORDS = (
    "the a an of to in on for with from by at as is was are were be been this that these "
    "those it its he she they we you i my your our their model token tree draft target head "
    "verify accept reject sample bonus cache layer hidden state attention query key value "
    "fast slow small large quick lazy red green blue cat dog bird fish tree river mountain "
    "city road house book paper code python function return import class def if else while "
    "loop list dict set int float string print open read write file line number one two three "
    "four five six seven eight nine ten hundred thousand time day night year people world "
    "work play run walk talk think know see look make take give find tell ask use want need"
).split()

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def synthetic_corpus(num_lines: int = 2000, seed: int = 0) -> list[str]:
    """Deterministic English-like lines drawn from a fixed word list."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) + "." for _ in range(num_lines)]


def train_tokenizer(vocab_size: int = 512, seed: int = 0):
    """A byte-level BPE tokenizer trained on the synthetic corpus (PreTrainedTokenizerFast)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(seed=seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
        pad_token="<|endoftext|>", unk_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
    )


def build_tiny_llama(
    out_dir: str | os.PathLike,
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    lm_head_std: float = 1.0,
    seed: int = 0,
) -> Path:
    """Write a tiny random LlamaForCausalLM + tokenizer to out_dir and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size, seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="float32",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, lm_head_std)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def cached_dir(kind: str, spec: dict, write) -> Path:
    """$SPECPLUG_CACHE/tiny/KIND-HASH(spec), made once by write(tmp_folder) and renamed
    into place whole, so concurrent test processes never see a half-written folder."""
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("SPECPLUG_CACHE", Path.home() / ".cache" / "specplug")) / "tiny"
    out = cache / f"{kind}-{key}"
    if (out / ".complete").exists():
        return out
    tmp = cache / f".tmp-{kind}-{key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    (tmp / ".complete").touch()
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def tiny_llama_dir(**kwargs) -> Path:
    """Cached build_tiny_llama: the same settings return the same folder, built once."""
    params = inspect.signature(build_tiny_llama).bind("", **kwargs)
    params.apply_defaults()
    settings = {k: v for k, v in params.arguments.items() if k != "out_dir"}
    return cached_dir("llama", settings, lambda tmp: build_tiny_llama(tmp, **kwargs))
