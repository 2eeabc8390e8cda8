"""`specplug distill`: the command, and the engine that writes the replies.

The prompts, the file and its resume rules are the core's
(specplug.common.training.distill); this module only picks the generator: `vllm`
(specplug.vllm_eagle3.generate, batched) or `hf` (transformers' generate).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from specplug.common.training import distill as core
from specplug.common.training.distill import DistillConfig


def make_generator(engine: str, cfg: DistillConfig, batch_size: int, kv_cache_bytes: int = 2 << 30):
    """generate(texts) -> replies of `engine` ("vllm" or "hf") for the target of `cfg`."""
    if engine == "vllm":
        from specplug.vllm_eagle3.generate import VllmGenerator
        return VllmGenerator(cfg.target, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                             seed=cfg.seed, max_batch=batch_size,
                             max_model_len=cfg.max_prompt_tokens + cfg.max_new_tokens + 8,
                             kv_cache_bytes=kv_cache_bytes)
    return core.hf_generator(cfg.target, cfg)


def distill(cfg: DistillConfig, out: Path, *, engine: str = "vllm", batch_size: int = 64,
            chunk: int = 256, kv_cache_bytes: int = 2 << 30) -> dict:
    """core.distill with `engine`'s generator (built only when a prompt is left to answer)."""
    return core.distill(cfg, out, lambda: make_generator(engine, cfg, batch_size, kv_cache_bytes), chunk=chunk)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DistillConfig(target="")
    parser.add_argument("--target", required=True, help="Hugging Face causal-LM folder that writes the replies")
    parser.add_argument("--out", required=True, help="JSONL file to write (extended on rerun: resumable)")
    parser.add_argument("--data", default=d.data, help="'sharegpt' or a ShareGPT-style .json/.jsonl file")
    parser.add_argument("--max-prompts", type=int, default=None, help="answer at most this many prompts")
    parser.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                        help="skip first prompts longer than this (chat-templated tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="longest reply")
    parser.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy replies")
    parser.add_argument("--seed", type=int, default=d.seed, help="prompt order (and sampling when T > 0)")
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm",
                        help="vllm: batched in vLLM (pip install 'specplug[vllm]'); hf: transformers' generate")
    parser.add_argument("--batch-size", type=int, default=64, help="requests generated at once")
    parser.add_argument("--chunk", type=int, default=256, help="prompts per appended chunk (resume granularity)")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="--engine vllm: KV cache size")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cfg = DistillConfig(args.target, args.data, args.max_prompts, args.max_prompt_tokens,
                            args.max_new_tokens, args.temperature, args.seed)
        if not (Path(args.target) / "config.json").is_file():
            raise ValueError(f"--target {args.target}: no config.json there; pass a Hugging Face model folder")
        summary = distill(cfg, Path(args.out), engine=args.engine, batch_size=args.batch_size, chunk=args.chunk,
                          kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)))
    except ValueError as exc:
        print(f"specplug distill: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0
