"""specplug distill --engine vllm: the replies vLLM writes are the target's greedy replies,
the same as transformers' (the fallback engine) on the tiny target."""

import json

import pytest

from specplug import distill as command
from specplug.common.training import distill as D
from tests.vllm.conftest import KV_CACHE_BYTES
from tests.support.tiny_eagle3 import tiny_target_dir


@pytest.mark.timeout(600)
def test_vllm_and_transformers_write_the_same_greedy_replies(tmp_path):
    target = tiny_target_dir()
    data = tmp_path / "prompts.jsonl"
    words = "one two three four five six".split()
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"count from {w}"},
                                                          {"from": "gpt", "value": "x"}]}) + "\n" for w in words))
    cfg = D.DistillConfig(str(target), str(data), max_new_tokens=12)
    replies = {}
    for engine in ("vllm", "hf"):
        out = tmp_path / f"{engine}.jsonl"
        summary = command.distill(cfg, out, engine=engine, batch_size=4, chunk=4, kv_cache_bytes=KV_CACHE_BYTES)
        assert summary["answered_now"] == len(words)
        # the tiny random target writes raw bytes; vLLM's detokenizer withholds a trailing
        # incomplete UTF-8 sequence that transformers decodes as U+FFFD
        replies[engine] = {r["id"]: r["conversations"][-1]["value"].rstrip("\ufffd")
                           for r in map(json.loads, out.read_text().splitlines())}
    assert replies["vllm"] == replies["hf"]
