"""A head written by `specplug train eagle3` serves in vLLM as it is: a few training
steps on the tiny target, then vLLM loads the output folder through the specplug
adapter and greedy output equals vLLM without speculation."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from specplug.common.training import train as T
from specplug.common.training.config import TrainConfig
from tests.vllm.conftest import PROMPTS, drafter_of
from tests.support.tiny_eagle3 import TINY_AUX_LAYER_IDS

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def trained_head(target, tmp_path_factory):
    """`specplug train eagle3` for 6 steps on the tiny target (EAGLE/SpecForge format)."""
    root = tmp_path_factory.mktemp("trained")
    data = root / "chat.jsonl"
    rows = [{"conversations": [{"from": "human", "value": f"say {w}"},
                               {"from": "gpt", "value": f"{w} the cat and the dog {w}"}]}
            for w in ("one", "two", "three", "red", "tree", "night", "city", "river")]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = TrainConfig(method="eagle3", target=str(target), out=str(root / "head"), data=str(data), steps=6,
                      batch_size=2, max_length=48, warmup_steps=2, heldout_samples=2, draft_vocab_size=128,
                      aux_layer_ids=tuple(TINY_AUX_LAYER_IDS), eval_prompts=0)
    result = T.train(cfg)
    assert result.last_loss < result.first_loss
    return root / "head"


def test_trained_head_loads_in_vllm_and_keeps_greedy_output(engine, target, trained_head):
    from vllm import SamplingParams

    config = json.loads((trained_head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["specplug"]["method"] == "eagle3"
    llm = engine(target, str(trained_head))
    assert drafter_of(llm).specplug is not None  # the specplug section switched the adapter on
    prompts = PROMPTS[:4]
    sampling = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    spec = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sampling, use_tqdm=False)]
    plain = [list(o.outputs[0].token_ids) for o in engine(target).generate(prompts, sampling, use_tqdm=False)]
    assert spec == plain
