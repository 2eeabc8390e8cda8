""""head_weights": the EAGLE-3 head's linears run with int8 or int4 weights inside vLLM
(specplug.common.quantization.int8 / int4 through quantized_layers.use_quantized_weights).

Greedy output equals vLLM without speculation; the swap happens only for the head's own
weights (another head's weights of the same shapes are refused, nothing changed) and
never for a layer the target also runs."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from specplug.common import formats  # noqa: E402
from specplug.common.quantization import int4, int8# noqa: E402
from specplug.vllm_eagle3.quantized_layers import _QuantMethod, eagle3_linears, use_quantized_weights  # noqa: E402
from tests.vllm.conftest import PROMPTS, SPECPLUG_CHAIN, drafter_of  # noqa: E402
from tests.vllm.test_stage_chain import params, run, token_ids  # noqa: E402
from tests.support.tiny_eagle3 import tiny_head_dir  # noqa: E402

pytestmark = pytest.mark.vllm

SECTIONS = {  # int8 through the older switch, int4 through "head_weights"
    "int8": {**SPECPLUG_CHAIN, "tree": {"topk": 2}, "head_int8": True},
    "int4": {**SPECPLUG_CHAIN, "tree": {"topk": 2}, "head_weights": "int4"},
}
WEIGHT_TYPES = {"int8": int8.Int8Weight, "int4": int4.Int4Weight}


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_greedy_matches_no_speculation_with_quantized_weights(engine, target, fmt):
    llm = engine(target, tiny_head_dir(target, specplug=SECTIONS[fmt]))
    modules = eagle3_linears(drafter_of(llm).model)
    assert all(isinstance(m.quant_method, _QuantMethod) for m in modules.values())
    assert all(isinstance(m.quant_method.weight, WEIGHT_TYPES[fmt]) for m in modules.values())
    sampling = params(max_tokens=24, temperature=0.0)
    spec, stats = run(llm, PROMPTS[:4], sampling)
    assert stats.num_steps > 0
    assert spec == token_ids(engine(target).generate(PROMPTS[:4], sampling, use_tqdm=False))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_another_heads_weights_are_refused(engine, target, fmt):
    """Same shapes, other values: the check on random rows refuses them and leaves
    every layer as vLLM loaded it."""
    llm = engine(target, tiny_head_dir(target, specplug=SPECPLUG_CHAIN))
    model = drafter_of(llm).model
    before = {role: m.quant_method for role, m in eagle3_linears(model).items()}
    other = formats.load_head(tiny_head_dir(target, seed=7)).state_dict
    reason = use_quantized_weights(model, other, fmt)
    assert reason is not None and "not the same weights" in reason
    assert {role: m.quant_method for role, m in eagle3_linears(model).items()} == before


def test_a_layer_the_target_shares_is_never_swapped(engine, target):
    """vLLM gives a head without its own lm_head the target's: swapping it would change
    the target's logits, so use_quantized_weights refuses (here: a 'target' holding the
    head's lm_head), and a state dict without an lm_head is refused, not an error."""
    import torch

    llm = engine(target, tiny_head_dir(target, specplug=SPECPLUG_CHAIN))
    model = drafter_of(llm).model
    before = {role: m.quant_method for role, m in eagle3_linears(model).items()}
    state = formats.load_head(tiny_head_dir(target, specplug=SPECPLUG_CHAIN)).state_dict
    reason = use_quantized_weights(model, state, target_model=torch.nn.ModuleList([model.lm_head]))
    assert reason is not None and "shares ['lm_head'] with the target" in reason
    assert "lm_head.weight" in use_quantized_weights(model, {k: v for k, v in state.items() if k != "lm_head.weight"})
    assert {role: m.quant_method for role, m in eagle3_linears(model).items()} == before


def test_head_weights_setting():
    from specplug.vllm_eagle3.settings import adapter_settings

    assert adapter_settings({}).head_weights == "float"
    assert adapter_settings({"head_int8": True}).head_weights == "int8"
    assert adapter_settings({"head_weights": "int4"}).head_weights == "int4"
    assert adapter_settings({"head_int8": True}, {"SPECPLUG_HEAD_INT8": "0"}).head_weights == "float"
    assert adapter_settings({"head_int8": True}, {"SPECPLUG_HEAD_WEIGHTS": "int4"}).head_weights == "int4"
    with pytest.raises(TypeError, match="head_int8"):
        adapter_settings({"head_int8": "yes"})
    with pytest.raises(ValueError, match="head_weights"):
        adapter_settings({"head_weights": "int2"})
