"""Draft models as drafters (specplug.common.draft_model): the layer-skip view shares the
target's weights and leaves it intact; a cut checkpoint computes what the view computes;
greedy output through the reference loop equals target.generate for top-k and sampled
trees; a view with every layer drafts exactly the target (tau = depth + 1, which only
holds when tree masks and positions are right); seeded sampled drafting reproduces."""

import pytest
import torch

from specplug.common.draft_model import DraftModelDrafter, cut_draft_model, layer_skip_view, parse_layers
from specplug.common.drafters import Eagle3Drafter
from specplug.common.reference import generate
from specplug.common.target_probs import SamplingConfig
from specplug.common.tree import TreeConfig
from tests.common.test_drafters import random_eagle3_head, target  # noqa: F401
from tests.common.test_reference import PROMPT, hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 24
CHAIN, TREE = TreeConfig(depth=3, topk=1, budget=3), TreeConfig(depth=3, topk=3, budget=8)


@pytest.fixture(scope="module")
def expected(target):
    return hf_greedy(target, PROMPT, NEW)


def test_parse_layers():
    assert parse_layers("0-2,5", 8) == (0, 1, 2, 5)
    assert parse_layers([3, 0, 3], 8) == (0, 3)
    for bad in ("1-3", "0-8", "", "0-x"):
        with pytest.raises(ValueError, match="layer"):
            parse_layers(bad, 8)


def test_view_shares_weights_and_leaves_target_intact(target):
    n = len(target.model.layers)
    view = layer_skip_view(target, [0, n - 1])
    assert len(view.model.layers) == 2 and len(target.model.layers) == n
    assert view.model.layers[1] is target.model.layers[n - 1]
    assert view.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert view.model.embed_tokens is target.model.embed_tokens


def test_cut_checkpoint_computes_what_the_view_computes(target, tiny_llama_path, tmp_path):
    from transformers import AutoModelForCausalLM
    out = cut_draft_model(tiny_llama_path, "0", tmp_path / "draft")
    cut = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert cut.config.num_hidden_layers == 1 and (out / "tokenizer.json").is_file()
    with torch.no_grad():
        want = layer_skip_view(target, [0])(PROMPT[None]).logits
        got = cut(PROMPT[None]).logits
    torch.testing.assert_close(got, want)
    with pytest.raises(FileExistsError, match="overwrite"):
        cut_draft_model(tiny_llama_path, "0", out)


@pytest.mark.parametrize("tree", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("temperature", [None, 1.0], ids=["topk", "sampled"])
def test_greedy_equals_hf_generate(target, expected, tree, temperature):
    drafter = DraftModelDrafter.self_speculative(target, [0], temperature=temperature, seed=0)
    result = generate(target, drafter, PROMPT, NEW, tree=tree)
    assert result.tokens == expected


def test_full_view_drafts_the_target_exactly(target, expected):
    """Every layer kept: the draft IS the target, so every greedy top-1 path is accepted."""
    drafter = DraftModelDrafter.self_speculative(target, range(len(target.model.layers)))
    result = generate(target, drafter, PROMPT, NEW, tree=TREE)
    assert result.tokens == expected
    assert all(a == TREE.depth for a in result.num_accepted[:-1])


def test_seeded_sampled_drafts_reproduce_at_t1(target):
    def run():
        drafter = DraftModelDrafter.self_speculative(target, [0], temperature=1.0, seed=5)
        return generate(target, drafter, PROMPT, NEW, tree=TREE, sampling=SamplingConfig(temperature=1.0, seed=9))
    a, b = run(), run()
    assert a.tokens == b.tokens and a.num_accepted == b.num_accepted


def test_sampled_eagle3_drafts_keep_greedy_output_and_reproduce(target, expected):
    drafter = Eagle3Drafter(random_eagle3_head(target), temperature=0.8, seed=1)
    assert generate(target, drafter, PROMPT, NEW, tree=TREE).tokens == expected
    sampling = SamplingConfig(temperature=0.8, seed=2)
    a = generate(target, drafter, PROMPT, NEW, tree=TREE, sampling=sampling)
    b = generate(target, drafter, PROMPT, NEW, tree=TREE, sampling=sampling)
    assert a.tokens == b.tokens


def test_bad_temperature_is_refused(target):
    with pytest.raises(ValueError, match="temperature"):
        DraftModelDrafter.self_speculative(target, [0], temperature=0)


def test_cli_cut_and_layers(tiny_llama_path, tmp_path, capsys):
    from specplug.cli import main
    from specplug.common.draft_model_cli import AgreementProbe, best_chain, search
    assert main(["draft-model", "cut", "--target", str(tiny_llama_path), "--layers", "0", "--out",
                 str(tmp_path / "d")]) == 0
    assert (tmp_path / "d" / "config.json").is_file()
    # the layer search on a fixed sequence: the full set agrees exactly; every subset is costed
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    probe = AgreementProbe(target, [(PROMPT, 4)])
    assert probe.alpha(range(len(target.model.layers))) == 1.0
    found = search(probe, len(target.model.layers), rounds=1, max_depth=3)
    assert all(0 < c.cost < 1 and 1 <= c.depth <= 3 for c in found)
    assert best_chain(1.0, 0.0, 4) == (4, 5.0) and best_chain(0.0, 0.5, 4)[0] == 1


def test_token_drafter_follows_the_engine_and_drafts_what_the_drafter_does(tiny_llama_path, tmp_path):
    """"draft_model" from the registry: its draft cache is brought to the committed tokens
    at each draft (extend, rollback to a shorter prefix, a request freed) and it drafts
    the same tree as the reference-loop drafter fed those tokens from scratch."""
    from transformers import AutoModelForCausalLM

    from specplug.common import drafter_registry
    from specplug.common.tree import TreeConfig

    path = cut_draft_model(tiny_llama_path, "0-1", tmp_path / "draft")
    choice = drafter_registry.DrafterChoice("draft_model", {"model": str(path), "budget": 6, "max_depth": 3, "topk": 2})
    drafter = drafter_registry.build(choice, vocab_size=512)
    fresh = DraftModelDrafter(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))

    def same_as_fresh(tokens):
        fresh.prefill(["r"], [torch.tensor(tokens[:-1])], None, torch.tensor(tokens[-1:]))
        want = fresh.draft(["r"], TreeConfig(depth=3, topk=2, budget=6))
        got = drafter.draft(["a"])
        assert torch.equal(got.candidates, want.candidates) and torch.equal(got.parents, want.parents)
        # cached and fresh forwards sum in different orders: ~1e-5 relative on AVX-512 kernels
        torch.testing.assert_close(got.scores, want.scores, rtol=1e-5, atol=1e-5)

    drafter.prefill("a", [3, 17, 99, 4])
    same_as_fresh([3, 17, 99, 4])
    drafter.extend("a", [250, 7])
    same_as_fresh([3, 17, 99, 4, 250, 7])
    drafter.rollback("a", 3)  # the engine discarded tokens (e.g. preemption)
    drafter.extend("a", [11])
    same_as_fresh([3, 17, 99, 11])
    drafter.free("a")
    assert "a" not in drafter.drafter.states and "a" not in drafter.valid


def test_the_draft_model_moves_to_the_engines_device_when_the_target_loads(tiny_llama_path, tmp_path):
    """bind_target (called by both adapters once the target has loaded): the draft model,
    loaded on the CPU, moves to the target's device ("meta" stands in for a GPU here)."""
    from specplug.common import drafter_registry
    from specplug.common.drafting.engine_layers import EngineTarget

    path = cut_draft_model(tiny_llama_path, "0", tmp_path / "draft")
    choice = drafter_registry.DrafterChoice("draft_model", {"model": str(path)})
    drafter = drafter_registry.build(choice, vocab_size=512)
    drafter_registry.bind_target(drafter, EngineTarget(torch.nn.Linear(2, 2, device="meta"), None, None))
    assert drafter.drafter.device == torch.device("meta")
    assert {p.device.type for p in drafter.drafter.model.parameters()} == {"meta"}


def test_sampled_token_drafter_returns_q(tiny_llama_path, tmp_path):
    from specplug.common import drafter_registry

    path = cut_draft_model(tiny_llama_path, "0", tmp_path / "draft")
    choice = drafter_registry.DrafterChoice("draft_model", {"model": str(path), "max_depth": 2, "topk": 3,
                                                          "temperature": 0.7, "seed": 1})
    trees = [drafter_registry.build(choice, vocab_size=512) for _ in range(2)]
    for d in trees:
        d.prefill("a", [3, 17, 99, 4])
    first, again = (d.draft(["a"]) for d in trees)
    assert first.draft_probs is not None and first.draft_probs.shape == (1, 7, 512)
    inner = torch.zeros(7, dtype=torch.bool)
    inner[first.parents[0, 1:]] = True  # nodes with children: their q rows are distributions, leaves' are 0
    torch.testing.assert_close(first.draft_probs[0].sum(-1), inner.float())
    assert torch.equal(first.candidates, again.candidates)  # seeded: the same draws


def test_token_drafter_settings_are_checked(tmp_path, tiny_llama_path):
    from specplug.common import drafter_registry

    with pytest.raises(ValueError, match="specplug draft-model cut"):
        drafter_registry.check_choice(drafter_registry.DrafterChoice("draft_model", {"model": str(tmp_path)}))
    path = cut_draft_model(tiny_llama_path, "0", tmp_path / "d")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        drafter_registry.check_choice(
            drafter_registry.DrafterChoice("draft_model", {"model": str(path), "temperature": 0}))
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        drafter_registry.build(drafter_registry.DrafterChoice("draft_model", {"model": str(path)}), vocab_size=1000)


def test_self_spec_settings_are_checked_and_it_waits_for_the_engine():
    from specplug.common import drafter_registry

    choice = drafter_registry.DrafterChoice
    for bad, field in (({"layers": "0-x"}, "is not an int or a range"), ({"layers": 0}, "count K >= 1"),
                       ({"layers": "1-3"}, "include layer 0"), ({"topk": 0}, "topk"),
                       ({"temperature": -1}, "temperature")):
        with pytest.raises(ValueError, match=field):
            drafter_registry.check_choice(choice("self_spec", bad))
    drafter = drafter_registry.build(choice("self_spec", {"layers": 2}), vocab_size=1000)
    with pytest.raises(RuntimeError, match="bind_target"):
        drafter.draft(["r"])


def test_self_spec_sums_a_row_parallel_output_only_where_the_engine_left_it_unreduced():
    """EngineLayerSkip under tensor parallelism: a row-parallel layer built with reduce_results
    False (SGLang reduces at its layer boundaries) is summed with the engine's all_reduce; one
    that reduces itself (vLLM), or a target without an all_reduce (one rank), is left alone."""
    from types import SimpleNamespace

    from specplug.common.drafting.engine_layers import EngineLayerSkip

    x = torch.ones(2, 3)
    summed = SimpleNamespace(all_reduce=lambda t: 2 * t)
    assert torch.equal(EngineLayerSkip._reduced(summed, SimpleNamespace(reduce_results=False), x), 2 * x)
    for layer in (SimpleNamespace(reduce_results=True), SimpleNamespace(), None):
        assert EngineLayerSkip._reduced(summed, layer, x) is x
    assert EngineLayerSkip._reduced(SimpleNamespace(all_reduce=None), SimpleNamespace(reduce_results=False), x) is x
