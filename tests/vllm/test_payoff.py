"""Payoff control in vLLM (on by default): each step drafts the depth that has delivered
the most tokens per second at its batch size (stage "chain"), or the whole tree or none
(stage "tree", Medusa heads). Greedy output equals vLLM without speculation whatever it
runs; "payoff": false and SPECPLUG_PAYOFF=0 turn
it off. (The suite's other engine tests pin the depth: conftest sets SPECPLUG_PAYOFF=0.)"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from tests.support.tiny_eagle3 import tiny_head_dir  # noqa: E402
from tests.support.tiny_medusa import vllm_medusa_heads_dir  # noqa: E402
from tests.vllm.conftest import PROMPTS, SPECPLUG_CHAIN, drafter_of  # noqa: E402
from tests.vllm.test_medusa import NODES, TREE  # noqa: E402
from tests.vllm.test_stage_chain import params, run, token_ids  # noqa: E402
from tests.vllm.test_stage_tree import BUDGET, SPECPLUG_TREE_SECTION  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def payoff_engine(engine, target):
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("SPECPLUG_PAYOFF", raising=False)  # the user's default: on
        return engine(target, tiny_head_dir(target, specplug={**SPECPLUG_CHAIN, "tree": {"topk": 2}, "payoff": True}))


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_equals_no_speculation_whatever_depths_run(engine, target, payoff_engine, batch):
    sampling = params(max_tokens=48, temperature=0.0)
    prompts = PROMPTS[:batch]
    spec, stats = run(payoff_engine, prompts, sampling)
    assert spec == token_ids(engine(target).generate(prompts, sampling, use_tqdm=False))
    control = drafter_of(payoff_engine).policy.payoff.control
    # over the engine's life (batch 1, then 4) it timed plain steps and drafting ones; at
    # batch 4 it may run plain steps only (a depth that lost at batch 1 is not explored)
    assert control is not None and len(control.choice_counts) >= 2
    assert control.cost(batch, 0) is not None and (batch > 1 or stats.num_steps > 0)


@pytest.fixture(scope="module")
def payoff_tree_engines(engine, target):
    """Stage "tree" with the EAGLE-3 head, and Medusa heads in stage "tree", payoff control on."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("SPECPLUG_PAYOFF", raising=False)
        eagle = engine(target, tiny_head_dir(target, specplug={**SPECPLUG_TREE_SECTION, "payoff": True}),
                       num_spec_tokens=BUDGET)
        medusa = engine(target, vllm_medusa_heads_dir(target, specplug={**TREE, "payoff": True}), NODES,
                        method="medusa")
        return {"eagle3-tree": eagle, "medusa-tree": medusa}


@pytest.mark.parametrize("method", ["eagle3-tree", "medusa-tree"])
@pytest.mark.parametrize("batch", [1, 4])
def test_trees_or_none_keep_greedy_output(engine, target, payoff_tree_engines, method, batch):
    llm = payoff_tree_engines[method]
    sampling = params(max_tokens=48, temperature=0.0)
    prompts = PROMPTS[:batch]
    spec, stats = run(llm, prompts, sampling)
    assert spec == token_ids(engine(target).generate(prompts, sampling, use_tqdm=False))
    control = drafter_of(llm).policy.payoff.control
    assert control.arms == (0, control.max_depth)
    assert set(control.choice_counts) == {0, control.max_depth}  # plain steps and trees (batch 1 first)
    assert batch > 1 or stats.num_steps > 0


def test_payoff_false_or_the_environment_turns_it_off(target, monkeypatch):
    from specplug.vllm_eagle3.settings import adapter_settings

    assert adapter_settings({}, environ={}).payoff
    assert not adapter_settings({"payoff": False}, environ={}).payoff
    assert not adapter_settings({}, environ={"SPECPLUG_PAYOFF": "0"}).payoff
    assert adapter_settings({"payoff": False}, environ={"SPECPLUG_PAYOFF": "1"}).payoff
