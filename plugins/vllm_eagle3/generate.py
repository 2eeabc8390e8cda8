"""Batched generation in vLLM for `specplug distill` (no speculation): texts -> replies.

vLLM's continuous batching keeps up to `max_batch` requests in every step, which on a
CPU is several times the throughput of transformers' padded `generate`.
"""

from __future__ import annotations

import os


class VllmGenerator:
    """Callable: chat-templated prompt texts -> reply texts (special tokens skipped),
    in the order given. Greedy when temperature is 0."""

    def __init__(self, model: str, *, max_new_tokens: int, temperature: float, seed: int,
                 max_batch: int, max_model_len: int, kv_cache_bytes: int = 2 << 30):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM, SamplingParams

        # the KV cache is sized here, never through VLLM_CPU_KVCACHE_SPACE: that variable
        # would also size every later engine of the process
        self.llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=seed,
                       distributed_executor_backend="uni", max_num_seqs=max_batch,
                       max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_bytes)
        self.params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                                     skip_special_tokens=True)

    def __call__(self, texts: list[str]) -> list[str]:
        outputs = self.llm.generate(list(texts), self.params, use_tqdm=False)
        return [o.outputs[0].text.strip() for o in outputs]
