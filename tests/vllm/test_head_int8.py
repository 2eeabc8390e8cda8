""""head_int8": the EAGLE-3 head's linears run with int8 weights inside vLLM
(specplug.common.drafting.int8 through dense_head.use_int8_weights).

Greedy output equals vLLM without speculation; the swap happens only for the head's own
weights (another head's weights of the same shapes are refused, nothing changed) and
never for a layer the target also runs."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from specplug.common import formats  # noqa: E402
from specplug.vllm_eagle3.dense_head import _Int8Method, eagle3_linears, use_int8_weights  # noqa: E402
from tests.vllm.conftest import PROMPTS, SPECPLUG_CHAIN, drafter_of  # noqa: E402
from tests.vllm.test_stage_a import params, run, token_ids  # noqa: E402
from tests.support.tiny_eagle3 import tiny_head_dir  # noqa: E402

pytestmark = pytest.mark.vllm

SECTION = {**SPECPLUG_CHAIN, "tree": {"topk": 2}, "head_int8": True}


@pytest.fixture(scope="module")
def int8_engine(engine, target):
    return engine(target, tiny_head_dir(target, specplug=SECTION))


def test_greedy_matches_no_speculation_with_int8_weights(engine, target, int8_engine):
    modules = eagle3_linears(drafter_of(int8_engine).model)
    assert all(isinstance(m.quant_method, _Int8Method) for m in modules.values())
    sampling = params(max_tokens=24, temperature=0.0)
    spec, stats = run(int8_engine, PROMPTS[:4], sampling)
    assert stats.num_drafts > 0
    assert spec == token_ids(engine(target).generate(PROMPTS[:4], sampling, use_tqdm=False))


def test_another_heads_weights_are_refused(engine, target):
    """Same shapes, other values: the check on random rows refuses them and leaves
    every layer as vLLM loaded it."""
    llm = engine(target, tiny_head_dir(target, specplug=SPECPLUG_CHAIN))
    model = drafter_of(llm).model
    before = {role: m.quant_method for role, m in eagle3_linears(model).items()}
    other = formats.load_head(tiny_head_dir(target, seed=7)).state_dict
    reason = use_int8_weights(model, other)
    assert reason is not None and "not the same weights" in reason
    assert {role: m.quant_method for role, m in eagle3_linears(model).items()} == before


def test_a_layer_the_target_shares_is_never_swapped(engine, target):
    """vLLM gives a head without its own lm_head the target's: swapping it would change
    the target's logits, so use_int8_weights refuses (here: a 'target' holding the
    head's lm_head), and a state dict without an lm_head is refused, not an error."""
    import torch

    llm = engine(target, tiny_head_dir(target, specplug=SPECPLUG_CHAIN))
    model = drafter_of(llm).model
    before = {role: m.quant_method for role, m in eagle3_linears(model).items()}
    state = formats.load_head(tiny_head_dir(target, specplug=SPECPLUG_CHAIN)).state_dict
    reason = use_int8_weights(model, state, target_model=torch.nn.ModuleList([model.lm_head]))
    assert reason is not None and "shares ['lm_head'] with the target" in reason
    assert "lm_head.weight" in use_int8_weights(model, {k: v for k, v in state.items() if k != "lm_head.weight"})
    assert {role: m.quant_method for role, m in eagle3_linears(model).items()} == before


def test_head_int8_flag():
    from specplug.vllm_eagle3.settings import adapter_settings

    assert not adapter_settings({}).head_int8
    assert adapter_settings({"head_int8": True}).head_int8
    assert not adapter_settings({"head_int8": True}, {"SPECPLUG_HEAD_INT8": "0"}).head_int8
    with pytest.raises(TypeError, match="head_int8"):
        adapter_settings({"head_int8": "yes"})
