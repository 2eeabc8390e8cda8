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
from specplug.common.sampling import SamplingConfig
from specplug.common.tree import TreeConfig
from tests.common.test_drafters import one_thread, random_eagle3_head, target  # noqa: F401
from tests.common.test_reference import PROMPT, hf_greedy

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
