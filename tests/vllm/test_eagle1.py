"""EAGLE-1 heads in vLLM (method "eagle"): the same specplug proposer and drafting core
as EAGLE-3, with the head run through DenseEagle1Head on the layers vLLM loaded
(EagleLlamaForCausalLM, the target's final hidden state, the target's lm_head).

Greedy output equals vLLM without speculation in both stages; on the constant target
the echo head (tests/support/tiny_eagle1.py) drafts the target's own prediction, so every
draft is accepted, which shows the feature and the lm_head are the right ones."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from specplug.vllm_eagle3.bench_runner import stats_from_outputs  # noqa: E402
from specplug.vllm_eagle3.settings import check_head_matches_target, specplug_section  # noqa: E402
from tests.support.tiny_eagle1 import eagle1_head_dir  # noqa: E402
from tests.support.tiny_eagle3 import AGREE_TOKEN  # noqa: E402
from tests.vllm.conftest import PROMPTS, drafter_of  # noqa: E402

pytestmark = pytest.mark.vllm

CHAIN = {"version": 1, "method": "eagle1", "tree": {"topk": 2}}
TREE = {"version": 1, "method": "eagle1", "stage": "tree", "tree": {"depth": 3, "topk": 2, "budget": 6}}


def greedy(max_tokens=24):
    from vllm import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(llm, prompts, sampling):
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], stats_from_outputs(outputs)


@pytest.mark.parametrize("section, num_spec_tokens", [(CHAIN, 3), (TREE, 6)], ids=["chain", "tree"])
def test_greedy_matches_no_speculation(engine, target, specplug_log, section, num_spec_tokens):
    head = eagle1_head_dir(target, echo=True, specplug=section)
    llm = engine(target, head, num_spec_tokens, method="eagle")
    prompts = PROMPTS[:8]
    spec, stats = run(llm, prompts, greedy())
    assert type(drafter_of(llm).session.drafting.runner).__name__ == "DenseEagle1Head"
    assert spec == run(engine(target), prompts, greedy())[0]
    assert stats.num_steps > 0 and stats.num_accepted > 0
    assert any("specplug EAGLE-1 proposer active" in m for m in specplug_log.messages)


def test_echo_head_on_the_constant_target_accepts_every_draft(engine, constant_target):
    head = eagle1_head_dir(constant_target, echo=True, specplug=CHAIN)
    ids, stats = run(engine(constant_target, head, 3, method="eagle"), PROMPTS[:4], greedy(32))
    assert all(set(out) == {AGREE_TOKEN} for out in ids)
    assert stats.acceptance_per_pos == [1.0, 1.0, 1.0]


def test_head_and_method_must_agree(target, specplug_head):
    eagle1 = eagle1_head_dir(target, specplug=CHAIN)
    with pytest.raises(ValueError, match="asked for method 'eagle3'.*\"method\": \"eagle\""):
        specplug_section({"specplug": CHAIN}, "eagle3")
    with pytest.raises(ValueError, match="holds eagle3 heads.*\"method\": \"eagle3\""):
        check_head_matches_target(str(specplug_head), str(target), "eagle")
    check_head_matches_target(str(eagle1), str(target), "eagle")


def test_fc_bias_is_refused_with_the_fix(target, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    head = tmp_path / "biased"
    shutil.copytree(eagle1_head_dir(target, specplug=CHAIN), head)
    tensors = load_file(str(head / "model.safetensors"))
    tensors["fc.bias"] = tensors["fc.weight"].new_zeros(tensors["fc.weight"].shape[0])
    save_file(tensors, str(head / "model.safetensors"))
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "bias": True}))
    with pytest.raises(ValueError, match="fc bias.*SPECPLUG_EAGLE3"):
        check_head_matches_target(str(head), str(target), "eagle")
