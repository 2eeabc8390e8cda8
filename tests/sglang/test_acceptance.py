"""Acceptance regression in SGLang: the committed test-bed heads on the real target
(SmolLM2-135M-Instruct), fixed prompts, greedy, so tau (tokens per verify step) is a fixed
number; each method keeps it within TOLERANCE of EXPECTED_TAU. A change that quietly
lowers acceptance fails; one that raises it by more than the tolerance fails too, asking
for EXPECTED_TAU to be measured again (say so in the commit).

Engines are started and shut down inside each test, one at a time (shutting an SGLang
engine down kills every scheduler of the process, see test_eagle3_own_engines.py)."""

from __future__ import annotations

import pytest

from tests.sglang.conftest import sglang_engine

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(900)]

NUM_PROMPTS, MAX_NEW_TOKENS = 4, 64
# method -> tau on 4 MT-bench prompts x 64 greedy tokens, batch 4, with the committed heads
EXPECTED_TAU = {"SPECPLUG_EAGLE3": 1.790, "MEDUSA": 1.446}
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def testbed_prompts():
    """(target folder, 4 MT-bench prompts as token ids with the chat template)."""
    from transformers import AutoTokenizer

    from specplug.common.testbed import target_dir
    from specplug.common.training.data import prompts

    target = target_dir()
    tokenizer = AutoTokenizer.from_pretrained(target)
    texts = [p.text for p in prompts("mtbench", tokenizer, limit=NUM_PROMPTS)]
    return target, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _head(method: str) -> str:
    from specplug.common import testbed

    return str(testbed.head_dir("smollm2-eagle3" if method == "SPECPLUG_EAGLE3" else "smollm2-medusa"))


def measured_tau(target, prompts, method: str) -> float:
    """Generated tokens / verify steps over the prompts, in one engine with the committed head."""
    params = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
    with sglang_engine(target, speculative_algorithm=method, speculative_draft_model_path=_head(method),
                       max_total_tokens=8192) as engine:
        metas = [o["meta_info"] for o in engine.generate(input_ids=prompts, sampling_params=[params] * len(prompts))]
    steps = sum(m["spec_verify_ct"] for m in metas)
    assert steps > 0, f"{method} never verified a draft"
    return sum(m["completion_tokens"] for m in metas) / steps


@pytest.mark.parametrize("method", list(EXPECTED_TAU))
def test_committed_head_keeps_its_tau(testbed_prompts, method):
    tau = measured_tau(*testbed_prompts, method)
    expected = EXPECTED_TAU[method]
    assert expected is not None, f"record EXPECTED_TAU[{method!r}] = {tau:.3f}"
    assert abs(tau - expected) <= TOLERANCE * expected, (
        f"{method} tau {tau:.3f} is more than {TOLERANCE:.0%} from the recorded {expected:.3f}: "
        "if acceptance rose on purpose, record the new value in EXPECTED_TAU")
