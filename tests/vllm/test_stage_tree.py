"""Stage "tree": vLLM verifies the whole draft tree in one target pass.

Greedy output must be token-identical to vLLM without speculation; sampled output must
be reproducible per seed and keep the target's distribution; wrong masks or positions
must change the output (so the test would see them).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

import torch

from tests.vllm.conftest import PROMPTS, drafter_of
from tests.vllm.test_stage_chain import check_seeded_sampling, params, run, token_ids
from tests.support.tiny_eagle3 import AGREE_TOKEN, agreeing_head_dir, tiny_head_dir, two_token_head_dir

pytestmark = pytest.mark.vllm

TREE = {"depth": 3, "topk": 2, "budget": 6}
SPECPLUG_TREE_SECTION = {"version": 1, "method": "eagle3", "tree": TREE, "verification": "lossless", "stage": "tree"}
BUDGET = TREE["budget"]


@pytest.fixture(scope="session")
def tree_head(target):
    return tiny_head_dir(target, specplug=SPECPLUG_TREE_SECTION)


@pytest.fixture(scope="session")
def tree_engine(engine, target, tree_head):
    return engine(target, tree_head, num_spec_tokens=BUDGET)


@pytest.fixture(scope="session")
def verifier(tree_engine):
    return drafter_of(tree_engine).tree_verifier


def test_tree_stage_is_active(tree_engine, specplug_log):
    drafter = drafter_of(tree_engine)
    assert drafter.specplug.stage == "tree" and drafter.tree_verifier is not None
    assert any("stage tree" in m for m in specplug_log.messages)
    impl = type(tree_engine.llm_engine.model_executor.driver_worker.worker.model_runner
                .compilation_config.static_forward_context["model.layers.0.self_attn.attn"].impl)
    assert impl.__name__ == "TreeCPUAttentionImpl"


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_greedy_matches_no_speculation(engine, target, tree_engine, batch):
    prompts = PROMPTS[:batch] if batch > 1 else [PROMPTS[2]]
    sampling = params(max_tokens=24, temperature=0.0)
    spec, stats = run(tree_engine, prompts, sampling)
    assert stats.num_steps > 0 and stats.num_draft_tokens == stats.num_steps * BUDGET
    assert spec == token_ids(engine(target).generate(prompts, sampling, use_tqdm=False))


def _trees_seen(llm, prompts, sampling):
    """Run recording every step's tree plan: (outputs, non-chain trees verified, moved KV)."""
    verifier = drafter_of(llm).tree_verifier
    seen = {"trees": 0, "moves": 0}
    accept = verifier.accept

    def recording(accepted_nodes, num_accepted):
        if verifier.step is not None:
            seen["trees"] += len(verifier.step.trees)
            for tree in verifier.step.trees:
                a = int(num_accepted[tree.batch_row])
                seen["moves"] += int((accepted_nodes[tree.batch_row, 1:a + 1] != torch.arange(1, a + 1)).sum())
        return accept(accepted_nodes, num_accepted)

    verifier.accept = recording
    try:
        return token_ids(llm.generate(prompts, sampling, use_tqdm=False)), seen
    finally:
        del verifier.accept


def test_trees_are_verified_and_paths_compacted(engine, target, tree_engine):
    """Non-chain trees reach the target and some accepted paths leave the first branch
    (KV moved), while greedy output still equals no speculation."""
    sampling = params(max_tokens=32, temperature=0.0)
    spec, seen = _trees_seen(tree_engine, PROMPTS[:8], sampling)
    assert seen["trees"] > 20
    assert spec == token_ids(engine(target).generate(PROMPTS[:8], sampling, use_tqdm=False))


def test_agreeing_draft_is_accepted_at_every_position(engine, constant_target):
    """A draft vocabulary of one token: the tree is a chain of `depth` nodes, all accepted."""
    head = agreeing_head_dir(constant_target, specplug=SPECPLUG_TREE_SECTION)
    out, stats = run(engine(constant_target, head, num_spec_tokens=BUDGET), PROMPTS[:4],
                     params(max_tokens=17, temperature=0.0))
    depth = TREE["depth"]
    assert all(ids == [AGREE_TOKEN] * 17 for ids in out)
    assert stats.num_steps > 0
    assert stats.accepted_per_pos[:depth] == [stats.num_steps] * depth
    assert stats.tau == depth + 1


# --- an oracle tree: the target's own greedy tokens on the SECOND branch ----------------
# Every step drafts the same topology, parents [-1, 0, 0, 2, 2, 4, 4]: node 1 (and 3, 5) is
# a wrong token, node 2 (then 4, 6) the token vLLM without speculation emits there. So
# every accepted path is 2 -> 4 -> 6 (all depth-3 nodes accepted at every step), each
# accepted node's KV must move (slot ctx+2 -> ctx+1, ...), its position is ctx + depth, not
# its chain slot, and its attention must skip the wrong siblings. Greedy output must equal
# no speculation; breaking the mask, the positions or the KV move must change it.
ORACLE_PARENTS = torch.tensor([-1, 0, 0, 2, 2, 4, 4])
ORACLE_TOKENS = 1 + 4 * 6  # the prefill's token, then 6 steps of 3 accepted + bonus


def _oracle(drafter, expected: dict):
    """Replace the drafter's tree drafting by the oracle tree (expected: prompt token ids
    -> prompt + greedy output of vLLM without speculation)."""
    vocab = drafter.state.runner.model_config.get_vocab_size()

    def draft_trees(roots, req_ids):
        drafts = []
        for root, req_id in zip(roots, req_ids):
            full = expected[tuple(drafter.state.runner.requests[req_id].prompt_token_ids)]
            # the root is the token after its position; its descendants follow in `full`
            right = [full[i] if i < len(full) else 0 for i in range(root.position + 2, root.position + 5)]
            tokens = torch.tensor([root.token] + [t for r in right for t in ((r + 1) % vocab, r)])
            drafter.tree_verifier.record(req_id, tokens, ORACLE_PARENTS)
            drafts.append(tokens[1:])
        return torch.stack(drafts)

    drafter._draft_trees = draft_trees


@pytest.fixture(scope="session")
def oracle_engine(engine, target, tree_head):
    """A stage-B engine without prefix caching (a broken control run must not leave
    cached blocks behind) whose drafter drafts the oracle tree."""
    prompts = PROMPTS[:8]
    sampling = params(max_tokens=ORACLE_TOKENS, temperature=0.0)
    plain = engine(target).generate(prompts, sampling, use_tqdm=False)
    expected = {tuple(o.prompt_token_ids): list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in plain}
    llm = engine(target, tree_head, num_spec_tokens=BUDGET, enable_prefix_caching=False)
    _oracle(drafter_of(llm), expected)
    return llm, prompts, sampling, token_ids(plain)


def test_oracle_tree_accepts_the_second_branch_at_every_position(oracle_engine):
    llm, prompts, sampling, plain = oracle_engine
    spec, stats = run(llm, prompts, sampling)
    assert spec == plain
    assert stats.num_steps == len(prompts) * 6
    assert stats.accepted_per_pos == [stats.num_steps] * 3  # no step accepts a 4th node
    assert stats.tau == 4.0


def _chain_positions(verifier):
    """Control: tree rows keep their chain positions (ctx + node id)."""
    tree_rows = verifier._tree_rows

    def wrong(batch_row, root_row, parents):
        chain = verifier.state.positions[root_row:root_row + len(parents)].clone()
        out = tree_rows(batch_row, root_row, parents)
        verifier.state.positions[root_row:root_row + len(parents)] = chain
        return out
    return "_tree_rows", wrong


def _no_mask(verifier):
    """Control: tree rows attend like a chain (vLLM's causal kernel only)."""
    tree_rows = verifier._tree_rows

    def wrong(batch_row, root_row, parents):
        return replace(tree_rows(batch_row, root_row, parents), rows=torch.zeros(0, dtype=torch.long))
    return "_tree_rows", wrong


def _no_kv_move(verifier):
    """Control: accepted nodes' KV stays at the tree's slots."""
    return "_copy_kv", lambda *args: None


@pytest.mark.parametrize("breakage", [_chain_positions, _no_mask, _no_kv_move])
def test_broken_tree_verification_changes_greedy_output(oracle_engine, breakage):
    llm, prompts, sampling, plain = oracle_engine
    verifier = drafter_of(llm).tree_verifier
    name, wrong = breakage(verifier)
    setattr(verifier, name, wrong)
    try:
        spec, _ = run(llm, prompts, sampling)
    finally:
        delattr(verifier, name)
    assert spec != plain


# --- sampling (T > 0) ----------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_and_batch_independent(tree_engine):
    check_seeded_sampling(tree_engine)


def test_seeded_output_does_not_depend_on_the_drafts(engine, target, specplug_head, tree_engine):
    """A seeded request's draw for each position is fixed by (seed, position): stage chain,
    stage tree (other drafts, other accepted lengths) and a batch with other requests
    give it the same tokens."""
    seeded = [params(max_tokens=32, temperature=0.9, seed=s) for s in (11, 12)]
    chain = token_ids(engine(target, specplug_head).generate(PROMPTS[:2], seeded, use_tqdm=False))
    tree = token_ids(tree_engine.generate(PROMPTS[:2], seeded, use_tqdm=False))
    mates = [params(max_tokens=32, temperature=0.9, seed=s) for s in (1, 2, 3)]
    batch = token_ids(tree_engine.generate(PROMPTS[2:5] + PROMPTS[:2], mates + seeded, use_tqdm=False))[3:]
    assert chain == tree == batch


# The constant target draws i.i.d. tokens from a fixed p (CONSTANT_TARGET_LOGITS plus a
# negligible rest). The two-token head drafts trees over tokens 100 and 101 (topk 2:
# both children at every node, so siblings are tested in order against residuals).
# Sample: 48 requests x 24 tokens = 1152 tokens per engine; 4 bins (100, 101, 102, other).
# Test: chi-square homogeneity against vLLM without speculation, p-value threshold 1e-3:
# a correct sampler fails 0.1% of runs. Negative control: always-accepted drafts fail.
def test_sampled_tokens_keep_the_target_distribution(engine, constant_target):
    from tests.vllm.test_stage_chain import NUM_REQUESTS, NUM_TOKENS, _bins, _same_distribution
    head = two_token_head_dir(constant_target, specplug=SPECPLUG_TREE_SECTION)
    llm = engine(constant_target, head, num_spec_tokens=BUDGET)
    sampling = [params(max_tokens=NUM_TOKENS, temperature=0.8, seed=s) for s in range(NUM_REQUESTS)]
    prompts = [PROMPTS[s % 8] for s in range(NUM_REQUESTS)]
    spec, seen = _trees_seen(llm, prompts, sampling)
    plain = token_ids(engine(constant_target).generate(prompts, sampling, use_tqdm=False))
    assert seen["trees"] > 50 and seen["moves"] > 10  # real trees, second branches accepted
    assert _same_distribution(_bins(spec), _bins(plain))
    always_accepted = [[AGREE_TOKEN] * NUM_TOKENS for _ in range(NUM_REQUESTS)]  # negative control
    assert not _same_distribution(_bins(always_accepted), _bins(plain))


# --- request rules in trees; structured output drafted as chains ---------------------------
def test_penalties_are_applied_per_tree_node_and_stay_exact(engine, target, tree_engine):
    """A batch mixing penalised requests with plain ones, all drafted as trees: each
    node's row is penalised along its own path (specplug.common.request_rules)."""
    penalised = params(max_tokens=24, temperature=0.0, repetition_penalty=1.3)
    greedy = params(max_tokens=24, temperature=0.0)
    plain = engine(target)
    for sampling in ([penalised] * 4, [penalised, greedy] * 2):
        spec, seen = _trees_seen(tree_engine, PROMPTS[:4], sampling)
        assert seen["trees"] > 0
        assert spec == token_ids(plain.generate(PROMPTS[:4], sampling, use_tqdm=False))


def test_structured_output_is_drafted_as_a_chain(engine, target, tree_engine):
    from vllm.sampling_params import StructuredOutputsParams
    choice = params(max_tokens=8, temperature=0.0, ignore_eos=False,
                    structured_outputs=StructuredOutputsParams(choice=["red fox", "lazy dog", "the cat"]))
    spec = token_ids(tree_engine.generate(PROMPTS[:2], choice, use_tqdm=False))
    assert spec == token_ids(engine(target).generate(PROMPTS[:2], choice, use_tqdm=False))


# --- start-up checks -------------------------------------------------------------------------
def test_kv_layout_self_test_passes_here_and_catches_a_changed_layout(monkeypatch):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from specplug.vllm_eagle3 import paged_kv

    paged_kv.check_layout(_get_attn_isa(torch.float32, 128, 32))  # the ISA this machine's engines use
    paged_kv.check_layout("vec16")
    with pytest.raises(RuntimeError, match="'amx'.*SPECPLUG_STAGE=chain"):
        paged_kv.check_layout("amx")
    gather = paged_kv.gather  # negative control: a reader that assumes untransposed keys

    def untransposed(kv_cache, slots):
        blocks, heads, block_size, two_d = kv_cache.shape
        region = paged_kv._regions(kv_cache)[:, :, 0].view(blocks, heads, block_size, two_d // 2)
        return region[slots // block_size, :, slots % block_size], gather(kv_cache, slots)[1]
    monkeypatch.setattr(paged_kv, "gather", untransposed)
    with pytest.raises(RuntimeError, match="layout on ISA 'vec'"):
        paged_kv.check_layout("vec")


def test_stage_from_config_and_env():
    from specplug.vllm_eagle3.settings import adapter_settings, check_num_speculative_tokens

    assert adapter_settings(SPECPLUG_TREE_SECTION, environ={}).stage == "tree"
    assert adapter_settings(SPECPLUG_TREE_SECTION, environ={"SPECPLUG_STAGE": "chain"}).stage == "chain"
    assert adapter_settings({"tree": TREE}, environ={"SPECPLUG_STAGE": "tree"}).stage == "tree"
    with pytest.raises(ValueError, match="stage must be one of"):
        adapter_settings({}, environ={"SPECPLUG_STAGE": "forest"})
    settings = adapter_settings(SPECPLUG_TREE_SECTION, environ={})
    check_num_speculative_tokens(settings, BUDGET)
    with pytest.raises(ValueError, match='"num_speculative_tokens": 6'):
        check_num_speculative_tokens(settings, 3)


def test_budget_and_num_speculative_tokens_disagree_at_start(target, tree_head):
    from vllm import LLM

    with pytest.raises(Exception, match='set "num_speculative_tokens": 6'):
        LLM(model=str(target), dtype="float32", max_model_len=512, enforce_eager=True,
            distributed_executor_backend="uni", kv_cache_memory_bytes=64 << 20,
            speculative_config={"method": "eagle3", "model": str(tree_head), "num_speculative_tokens": 3})


def test_bench_runs_stage_tree_as_specplug_tree(target, tree_head, monkeypatch):
    import json
    from pathlib import Path

    from specplug.vllm_eagle3.bench_runner import VllmRunner

    # the runner sets VLLM_CPU_KVCACHE_SPACE if absent; the session's later engines must not inherit it
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")

    runner = VllmRunner(str(target), str(tree_head), max_new_tokens=8, temperature=0.0, seed=0, max_batch=1)
    assert runner.methods()[-13:] == ["specplug", "specplug-fixed", "specplug-tree", "specplug-tree-fixed",
                                      "specplug-adaptive",
                                      "specplug-hybrid", "specplug-hybrid-tree", "specplug-hybrid-skip",
                                      "specplug-hybrid-calibrated", "specplug-sampled", "specplug-hybrid-lengthen",
                                      "specplug-hybrid-gated", "specplug-float-head"]
    gated = json.loads((Path(runner.speculative_config("specplug-hybrid-gated")["model"]) / "config.json").read_text())
    assert gated["specplug"]["gate"] is True and gated["specplug"]["retrieval"]
    float_dir = Path(runner.speculative_config("specplug-float-head")["model"])
    float_head = json.loads((float_dir / "config.json").read_text())
    assert float_head["specplug"]["head_weights"] == "float" and float_head["specplug"]["stage"] == "chain"
    for method, stage, tokens, adaptive in (("specplug", "chain", TREE["depth"], False),
                                            ("specplug-tree", "tree", BUDGET, False),
                                            ("specplug-tree-fixed", "tree", BUDGET, False),
                                            ("specplug-adaptive", "chain", TREE["depth"], True)):
        config = runner.speculative_config(method)
        assert config["num_speculative_tokens"] == tokens
        section = json.loads((Path(config["model"]) / "config.json").read_text())["specplug"]
        assert section["stage"] == stage and section.get("adaptive", False) == adaptive
