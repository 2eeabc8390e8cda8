"""Block verification (specplug.common.block_verify) is lossless and accepts at least as
much as token-wise rejection sampling.

Set-up: a toy target P and drafter Q over a small vocabulary whose next-token
distributions depend on the WHOLE prefix after the root (one random row per prefix, so
every draft position sees a different pair (p, q)). Each request drafts a chain of gamma
tokens from Q and verify_block judges it against P.

* Exact: enumerating every chain of drafts, the probability of every length and final
  token (from the module's own weights, h and residuals), followed by the target's own
  sampling, gives exactly the target's joint distribution of the first gamma + 1 tokens
  (max error < 1e-5); the two wrong rules of the negative controls below do not (> 1e-3).
* Statistical: SAMPLES = 200,000 requests in one batched call; the first token, and the
  first gamma + 1 tokens jointly (the emitted ones, then the target's own draws for the
  positions after them, as the next steps would give), against P by chi-square (cells
  with expected count < 5 merged), failing at p < ALPHA = 1e-5. 4 configurations x 2
  checks on a correct sampler fail somewhere with chance < 1e-4. Negative controls (the
  same checks must fail): the final token drawn from the target's row without the
  residual correction, and h_i = weight_i (the residual mass left out of the stop
  probability). The mean accepted length of the sample must lie within 5 standard errors
  of the exact expectation (chance of a false failure < 1e-6).
* Acceptance: on 40 random instances (vocab 2-6, gamma 1-4, sharp and flat q), the exact
  expected number of accepted drafts (enumeration) is above token-wise rejection's
  (Leviathan, sum_i prod_{j <= i} min(1, P_j / Q_j)) by more than 1e-4 for gamma >= 2,
  and equal for gamma = 1, where the two rules coincide.
"""

import itertools

import pytest
import torch

from specplug.common import block_verify as BV
from specplug.common.block_verify import stop_probabilities, verify_block
from tests.common.test_sampling_lossless import ALPHA, chi_square_pvalue

pytestmark = pytest.mark.usefixtures("one_thread")

SAMPLES = 200_000
CONFIGS = [(4, 3, 1.0), (5, 2, 0.6), (6, 2, 1.5), (3, 4, 1.0)]  # (vocab, gamma, sharpness of the logits)


class PrefixModel:
    """Target P and drafter Q: Float [rows, V], one row per prefix of length 0..gamma
    (row of prefix x_1..x_L: offset(L) + the prefix read as a base-V number)."""

    def __init__(self, vocab: int, gamma: int, sharpness: float, seed: int):
        g = torch.Generator().manual_seed(seed)
        rows = sum(vocab ** n for n in range(gamma + 1))
        logits = sharpness * 2 * torch.randn(rows, vocab, generator=g)
        self.P = torch.softmax(logits, -1)
        self.Q = torch.softmax(0.6 * logits + sharpness * 1.5 * torch.randn(rows, vocab, generator=g), -1)
        self.vocab, self.gamma = vocab, gamma

    def row(self, prefix: torch.Tensor) -> torch.Tensor:
        """prefix Long [B, L] -> Long [B]: the table row of each prefix."""
        length = prefix.shape[1]
        offset = sum(self.vocab ** n for n in range(length))
        digits = self.vocab ** torch.arange(length - 1, -1, -1)
        return offset + (prefix * digits).sum(1)

    def chain_rows(self, drafts: torch.Tensor):
        """p, q Float [B, gamma + 1, V]: the rows after the root and after each draft."""
        rows = torch.stack([self.row(drafts[:, :i]) for i in range(drafts.shape[1] + 1)], 1)
        return self.P[rows], self.Q[rows]

    def draft(self, bsz: int, gen: torch.Generator) -> torch.Tensor:
        drafts = torch.zeros(bsz, 0, dtype=torch.long)
        for _ in range(self.gamma):
            nxt = torch.multinomial(self.Q[self.row(drafts)], 1, generator=gen)
            drafts = torch.cat([drafts, nxt], 1)
        return drafts

    def complete(self, tokens: torch.Tensor, known: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Positions past known[b] of tokens [B, gamma + 1] drawn from P, left to right."""
        tokens = tokens.clone()
        for t in range(tokens.shape[1]):
            todo = known <= t
            if bool(todo.any()):
                tokens[todo, t] = torch.multinomial(self.P[self.row(tokens[todo, :t])], 1, generator=gen)[:, 0]
        return tokens

    def joint(self) -> torch.Tensor:
        """Float64 [V] * (gamma + 1): the target's distribution of the first gamma + 1 tokens."""
        seqs = torch.tensor(list(itertools.product(range(self.vocab), repeat=self.gamma + 1)))
        prob = torch.ones(seqs.shape[0], dtype=torch.float64)
        for t in range(self.gamma + 1):
            prob *= self.P[self.row(seqs[:, :t]), seqs[:, t]].double()
        return prob.view([self.vocab] * (self.gamma + 1))


def _all_chains(model: PrefixModel) -> torch.Tensor:
    return torch.tensor(list(itertools.product(range(model.vocab), repeat=model.gamma))).view(-1, model.gamma)


def _chain_view(model, drafts):
    p, q = model.chain_rows(drafts)
    num_drafts, width = torch.full((drafts.shape[0],), drafts.shape[1]), drafts.shape[1] + 1
    return num_drafts, BV._ChainRows(p, num_drafts, width), BV._ChainRows(q, num_drafts, width)


def _length_probabilities(h: torch.Tensor) -> torch.Tensor:
    """Float [B, K+1]: P(tau = i) = h_i * prod_{j > i} (1 - h_j) (the backward scan)."""
    later = torch.flip(torch.cumprod(torch.flip(1 - h, [1]), 1), [1])  # [B, K+1]: prod_{j >= i}
    return h * torch.cat([later[:, 1:], torch.ones_like(h[:, :1])], 1)


def exact_output(model: PrefixModel) -> torch.Tensor:
    """Float64 [V] * (gamma + 1): the first gamma + 1 tokens of one block step followed by
    the target's sampling, by enumeration of every chain of drafts."""
    drafts = _all_chains(model)  # [C, gamma]
    chance = model.Q[torch.stack([model.row(drafts[:, :i]) for i in range(model.gamma)], 1),
                     drafts].prod(1).double()  # [C]
    num_drafts, p, q = _chain_view(model, drafts)
    weight, h = stop_probabilities(drafts, num_drafts, p, q)
    length = _length_probabilities(h).double()  # [C, gamma + 1]
    joint, out = model.joint(), torch.zeros([model.vocab] * (model.gamma + 1), dtype=torch.float64)
    for i in range(model.gamma + 1):
        dist = BV._final_distribution(torch.full_like(num_drafts, i), num_drafts, weight, p, q).double()
        mass = (chance * length[:, i])[:, None] * dist / dist.sum(-1, keepdim=True)  # [C, V]
        prefix = torch.zeros([model.vocab] * (i + 1), dtype=torch.float64)  # emitted x_1..x_i, y
        index = [drafts[:, t, None].expand(-1, model.vocab) for t in range(i)]
        prefix.index_put_((*index, torch.arange(model.vocab).expand(len(drafts), -1)), mass, accumulate=True)
        marginal = joint.sum(tuple(range(i + 1, model.gamma + 1))) if i < model.gamma else joint
        assert float(prefix[marginal == 0].abs().sum()) < 1e-9  # never a prefix the target cannot emit
        ratio = torch.where(marginal > 0, prefix / marginal.clamp(min=1e-300), 0.0)
        out += ratio.view(ratio.shape + (1,) * (model.gamma - i)) * joint
    return out


# --------------------------------------------------------------------------- exact


def _target_row(accepted, num_drafts, weight, p_rows, q_rows):
    return p_rows.at(accepted)  # wrong: the final token from the target's row, no residual


def _weight_as_stop(weight, p_next, q_next):
    return weight  # wrong: h_i = weight_i, the residual mass left out


WRONG_RULES = [("_final_distribution", _target_row), ("_stop_probability", _weight_as_stop)]




@pytest.mark.parametrize("vocab, gamma, sharpness", CONFIGS)
def test_exact_output_is_the_target(vocab, gamma, sharpness):
    model = PrefixModel(vocab, gamma, sharpness, seed=vocab * 10 + gamma)
    assert float((exact_output(model) - model.joint()).abs().max()) < 1e-5


@pytest.mark.parametrize("patch", WRONG_RULES)
def test_exact_negative_control_wrong_block_rules(monkeypatch, patch):
    model = PrefixModel(4, 3, 1.0, seed=11)
    monkeypatch.setattr(BV, *patch)
    assert float((exact_output(model) - model.joint()).abs().max()) > 1e-3


# --------------------------------------------------------------------------- statistical


def block_tokens(model: PrefixModel, seed: int):
    """(Long [SAMPLES, gamma + 1] the first gamma + 1 tokens, Long [SAMPLES] accepted)."""
    gen = torch.Generator().manual_seed(seed)
    drafts = model.draft(SAMPLES, gen)
    p, q = model.chain_rows(drafts)
    num_drafts = torch.full((SAMPLES,), model.gamma)
    result = verify_block(drafts, num_drafts, p, q, torch.rand(SAMPLES, model.gamma + 2, generator=gen))
    emitted = torch.cat([drafts, torch.zeros(SAMPLES, 1, dtype=torch.long)], 1)
    emitted[torch.arange(SAMPLES), result.num_accepted] = result.bonus_token
    return model.complete(emitted, result.num_accepted + 1, gen), result.num_accepted


def block_pvalues(model: PrefixModel, seed: int):
    tokens, _ = block_tokens(model, seed)
    joint = model.joint()
    code = (tokens * model.vocab ** torch.arange(model.gamma, -1, -1)).sum(1)
    return chi_square_pvalue(tokens[:, 0], model.P[0]), chi_square_pvalue(code, joint.flatten())


@pytest.mark.parametrize("vocab, gamma, sharpness", CONFIGS)
def test_first_tokens_follow_the_target(vocab, gamma, sharpness):
    model = PrefixModel(vocab, gamma, sharpness, seed=vocab * 10 + gamma)
    p_first, p_joint = block_pvalues(model, seed=vocab + gamma)
    assert p_first >= ALPHA, f"first token: chi-square p = {p_first:.3g} < {ALPHA}"
    assert p_joint >= ALPHA, f"first {gamma + 1} tokens: chi-square p = {p_joint:.3g} < {ALPHA}"


@pytest.mark.parametrize("patch", WRONG_RULES)
def test_negative_control_wrong_block_rules_fail(monkeypatch, patch):
    model = PrefixModel(4, 3, 1.0, seed=11)
    assert min(block_pvalues(model, seed=5)) >= ALPHA  # the correct rule passes
    monkeypatch.setattr(BV, *patch)
    assert block_pvalues(model, seed=5)[1] < ALPHA


def test_mean_accepted_length_matches_the_enumeration():
    model = PrefixModel(5, 2, 0.6, seed=52)
    exact = expected_accepted(model)[0]
    _, accepted = block_tokens(model, seed=3)
    sd = float(accepted.double().std()) / SAMPLES ** 0.5
    assert abs(float(accepted.double().mean()) - exact) < 5 * sd


# --------------------------------------------------------------------------- acceptance


def expected_accepted(model: PrefixModel) -> tuple[float, float]:
    """(block, token-wise rejection): exact expected accepted drafts, by enumeration."""
    drafts = _all_chains(model)
    num_drafts, p, q = _chain_view(model, drafts)
    p_x = torch.stack([p(i).gather(1, drafts[:, i:i + 1])[:, 0] for i in range(model.gamma)], 1).double()
    q_x = torch.stack([q(i).gather(1, drafts[:, i:i + 1])[:, 0] for i in range(model.gamma)], 1).double()
    chance = q_x.prod(1)  # [C]
    _, h = stop_probabilities(drafts, num_drafts, p, q)
    block = (_length_probabilities(h).double() * torch.arange(model.gamma + 1)).sum(1)
    tokenwise = torch.cumprod((p_x / q_x).clamp(max=1), 1).sum(1)  # sum_i P(first i accepted)
    return float((chance * block).sum()), float((chance * tokenwise).sum())


def test_block_accepts_at_least_as_much_as_tokenwise_rejection():
    for seed in range(40):
        vocab, gamma, sharpness = 2 + seed % 5, 1 + seed % 4, (0.3, 1.0, 2.0)[seed % 3]
        block, tokenwise = expected_accepted(PrefixModel(vocab, gamma, sharpness, seed=1000 + seed))
        if gamma == 1:  # one draft: h_1 = min(1, P_1 / Q_1), the token-wise rule itself
            assert abs(block - tokenwise) < 1e-6, (vocab, sharpness, block, tokenwise)
        else:
            assert block > tokenwise + 1e-4, (vocab, gamma, sharpness, block, tokenwise)


# --------------------------------------------------------------------------- details


def test_identical_draft_and_target_accept_every_draft():
    model = PrefixModel(5, 3, 1.0, seed=1)
    model.Q = model.P
    tokens = model.draft(1000, torch.Generator().manual_seed(0))
    p, q = model.chain_rows(tokens)
    result = verify_block(tokens, torch.full((1000,), 3), p, q, torch.rand(1000, 5))
    assert bool((result.num_accepted == 3).all())


def test_flat_and_padded_rows_and_ragged_chains_agree():
    model = PrefixModel(5, 3, 1.0, seed=2)
    gen = torch.Generator().manual_seed(0)
    drafts = model.draft(64, gen)
    num_drafts = torch.randint(0, 4, (64,), generator=gen)
    p, q = model.chain_rows(drafts)
    node = torch.arange(4)[None] <= num_drafts[:, None]  # [B, K+1] real rows
    uniforms = torch.rand(64, 5, generator=gen)
    padded = verify_block(drafts, num_drafts, p.masked_fill(~node[..., None], 0.0), q, uniforms)
    flat = verify_block(drafts, num_drafts, p[node], q[node], uniforms)
    for a, b in zip(padded, flat):
        assert torch.equal(a, b)
    assert bool((padded.num_accepted <= num_drafts).all())
    k = num_drafts.tolist()
    alone = [verify_block(drafts[b:b + 1, :k[b]], num_drafts[b:b + 1], p[b:b + 1, :k[b] + 1], q[b:b + 1, :k[b] + 1],
                          uniforms[b:b + 1]) for b in range(64)]
    assert [int(r.num_accepted[0]) for r in alone] == padded.num_accepted.tolist()
    assert [int(r.bonus_token[0]) for r in alone] == padded.bonus_token.tolist()


@pytest.mark.parametrize("change, match", [("q_shape", "q must be"), ("token", "token ids"),
                                           ("uniform", "uniforms"), ("sum", "does not sum to 1"),
                                           ("num_drafts", "num_drafts")])
def test_bad_input_is_refused(change, match):
    model = PrefixModel(4, 2, 1.0, seed=3)
    drafts = model.draft(3, torch.Generator().manual_seed(0))
    p, q = model.chain_rows(drafts)
    num_drafts, uniforms = torch.full((3,), 2), torch.rand(3, 4)
    if change == "q_shape":
        q = q[:, :2]
    elif change == "token":
        drafts[1, 0] = 9
    elif change == "uniform":
        uniforms[0, 0] = 1.0
    elif change == "sum":
        q[2, 1] *= 2
    else:
        num_drafts[0] = 3
    with pytest.raises(ValueError, match=match):
        verify_block(drafts, num_drafts, p, q, uniforms)
