"""Test support: Medusa heads for a tiny test Llama, random or fitted in seconds, saved in
FasterDecoding format (config.json + medusa_lm_head.safetensors) with a specplug section.

`medusa_heads_dir(model_dir, out_dir, fit_steps=...)`: with fit_steps > 0 the heads are
trained on the model's own greedy continuations of random prompts (a random peaky Llama
falls into short loops, so heads learn them quickly), which gives acceptance well above
zero; fit_steps=0 leaves them random (acceptance near zero). Seeded: same inputs, same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def fit_prompts(vocab: int, num_prompts: int = 48, prompt_len: int = 8, seed: int = 0) -> torch.Tensor:
    """[num_prompts, prompt_len]: the random prompts whose greedy continuations the heads are fitted on."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (num_prompts, prompt_len), generator=g)


def _greedy_corpus(model, vocab: int, num_prompts: int, prompt_len: int, new_tokens: int, seed: int):
    """[num_prompts, prompt_len + new_tokens] token ids: random prompts + greedy continuations."""
    prompts = fit_prompts(vocab, num_prompts, prompt_len, seed)
    return model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


def _fit(heads, model, ids: torch.Tensor, steps: int, seed: int) -> list[list[float]]:
    """Train head k to predict ids[t + k + 2] from the final hidden state at t; return
    per-head top-1..topk accuracies on the corpus ([heads, 4])."""
    torch.manual_seed(seed)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]  # [B, T, H] after norm
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    k_heads = heads.num_heads
    for _ in range(steps):
        logits = heads(hidden[:, : -(k_heads + 1)])  # [K, B, T', V]
        loss = sum(torch.nn.functional.cross_entropy(
            logits[k].flatten(0, 1), ids[:, k + 2: ids.shape[1] - k_heads + k + 1].flatten()) for k in range(k_heads))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        logits = heads(hidden[:, : -(k_heads + 1)])
        top = logits.topk(4, dim=-1).indices  # [K, B, T', 4]
        acc = []
        for k in range(k_heads):
            target = ids[:, k + 2: ids.shape[1] - k_heads + k + 1]
            hit = top[k] == target[..., None]
            acc.append([float(hit[..., r].float().mean()) for r in range(4)])
    return acc


def medusa_heads_dir(model_dir, out_dir, *, num_heads: int = 3, fit_steps: int = 150, seed: int = 0,
                     verification: str = "lossless") -> Path:
    """Write Medusa heads for the Llama in model_dir to out_dir (built once; reused)."""
    from transformers import AutoModelForCausalLM

    from specplug.common import formats
    from specplug.common.heads.medusa import MedusaConfig, MedusaHeads

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    torch.manual_seed(seed)
    config = MedusaConfig(medusa_num_heads=num_heads, medusa_num_layers=1, hidden_size=cfg.hidden_size,
                          vocab_size=cfg.vocab_size, base_model_name_or_path=str(model_dir))
    heads = MedusaHeads(config).float()
    accuracies = None
    if fit_steps > 0:
        ids = _greedy_corpus(model, cfg.vocab_size, 48, 8, 40, seed)
        accuracies = _fit(heads, model, ids, fit_steps, seed)
    section = {"version": 1, "method": "medusa", "tree": {"depth": num_heads, "topk": 2, "budget": 7},
               "verification": verification}
    if accuracies is not None:
        section["head_accuracies"] = accuracies
    config = MedusaConfig(medusa_num_heads=num_heads, medusa_num_layers=1, hidden_size=cfg.hidden_size,
                          vocab_size=cfg.vocab_size, base_model_name_or_path=str(model_dir), specplug=section)
    heads.config = config
    formats.save_head((config.to_dict(), {k: v.detach().contiguous() for k, v in heads.state_dict().items()}),
                      out, "medusa")
    (out / "fit.json").write_text(json.dumps({"fit_steps": fit_steps, "head_accuracies": accuracies}))
    return out


def vllm_medusa_heads_dir(model_dir, *, specplug: dict | None, fit_steps: int = 60, seed: int = 0) -> Path:
    """The fitted heads of `medusa_heads_dir` converted to vLLM's MedusaModel format
    ("vllm-medusa"), with `specplug` as their specplug section (None: no section, vLLM's
    own Medusa path). Cached under $SPECPLUG_CACHE/tiny."""
    from specplug.common import formats
    from tests.support.tiny_llama import cached_dir

    spec = {"target": str(model_dir), "specplug": specplug, "fit_steps": fit_steps, "seed": seed}

    def write(tmp: Path):
        fitted = medusa_heads_dir(model_dir, tmp / "fasterdecoding", fit_steps=fit_steps, seed=seed)
        formats.convert(fitted, tmp / "vllm", "vllm-medusa")
        config = json.loads((tmp / "vllm" / "config.json").read_text())
        fitted_section = json.loads((fitted / "config.json").read_text())["specplug"]
        config.pop("specplug", None)
        if specplug is not None:
            config["specplug"] = {"head_accuracies": fitted_section.get("head_accuracies"), **specplug}
        (tmp / "vllm" / "config.json").write_text(json.dumps(config, indent=2))

    return cached_dir("vllm-medusa", spec, write) / "vllm"
