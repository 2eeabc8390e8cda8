"""One verification step for a batch of requests: the core's one place that chooses each
request's verification rule, so that no engine adapter does.

An adapter hands over the target's logits of every tree node (after the request's own
rules, specplug.common.request_rules), the trees, each request's sampling settings as a
:class:`RequestSampling` and, where drafts were drawn from a distribution q, that q.
:func:`verify_step` turns the logits into the target's p (target_probs.process_logits, in the
engine's filter order), chooses the rule of every request and runs it through
sampling.verify (and its CUDA dispatch) or, when every tree is a chain,
chains.verify_chains (the same result in a few vectorised ops); the "block" rule runs
block_verify.verify_block (torch only, no CUDA kernel).

The rule, per request (:func:`choose_rule`):

=====================================  ============  ====================================
request                                rule          randomness
=====================================  ============  ====================================
temperature 0                          "greedy"      none: the argmax (first maximal index)
T > 0, ``typical=True``                "typical"     LOSSY Medusa-2 typical acceptance
T > 0, seed                            "coupled"     position_uniforms(seed, position);
                                                     q unused
T > 0, no seed, drafts from q, chain   "block"       ``generator``; block verification
                                                     (Sun et al. 2024) with q
T > 0, no seed, drafts from q, tree    "rejection"   ``generator``; SpecInfer with q
T > 0, no seed, no q                   "coupled"     ``generator``
=====================================  ============  ====================================

A request's tree is a chain when every real node j's parent is j - 1 (a lone root
included). Block verification accepts at least as many drafts in expectation as
token-wise rejection with q (Leviathan) on the same chain, and is lossless too.

Invariant: request b's result is exactly ``sampling.verify(method=rule_b)`` on request b
alone (``block_verify.verify_block`` for "block"), with b's row of uniforms
(tests/common/test_verify_step.py). A seeded request's row is a function of (seed,
position) only, so its tokens depend neither on its batch
companions nor on what was drafted: the coupled rule emits the target's own inverse-CDF
draw at every position and only compares the drafts with it. That is also why a seeded
request whose drafts were drawn from q is verified "coupled" rather than with q: still
lossless (the drafts never change which token is emitted), and reproducible, where
block or rejection verification with q would make its text depend on the draft draws; it
accepts p(x) of a draft x where rejection with q accepts min(1, p(x) / q(x)).

Batching: the greedy rows of a batch with sampled requests ride in the coupled pass with
a one-hot p (process_logits gives temperature-0 rows the one-hot of the first maximal
logit), which is exactly argmax verification; so a step runs one verify call per rule
group present (coupled, block, rejection, typical), at most four, and only an all-greedy
step skips process_logits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from specplug.common.block_verify import verify_block
from specplug.common.chains import verify_chains
from specplug.common.cuda.dispatch import kernel_ready
from specplug.common.randomness import position_uniforms
from specplug.common.sampling import TYPICAL_DELTA, TYPICAL_EPSILON, verify
from specplug.common.target_probs import ORDERS, SamplingConfig, process_logits
from specplug.common.verify_result import VerifyResult

__all__ = ["RULES", "RequestSampling", "chain_rows", "choose_rule", "step_uniforms", "verify_step"]

RULES = ("greedy", "coupled", "block", "rejection", "typical")
_INT64 = 1 << 64


@dataclass(frozen=True)
class RequestSampling(SamplingConfig):
    """One request's sampling settings for a verify step: SamplingConfig's temperature
    (0 = greedy), top_k, top_p and seed (None = unseeded; a seed fixes the request's
    draws by (seed, position), not through a torch.Generator), plus

    min_p: 0 = off. order: whose filter order process_logits follows ("vllm" | "sglang").
    position: the sequence position of the first token this step emits, i.e. the tokens
        the request holds before the step (prompt + committed output, the root included);
        a seeded request's draw for the token d places past its root is fixed by
        (seed, position + d)."""

    min_p: float = 0.0
    order: str = "vllm"
    position: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must lie in [0, 1] (0 = off), got {self.min_p!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS} (whose sampler's filter order to follow), "
                             f"got {self.order!r}")
        if not isinstance(self.position, int) or self.position < 0:
            raise ValueError(f"position must be an int >= 0 (tokens the request holds before this step), "
                             f"got {self.position!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def method(self) -> str:
        """This request's rule when its drafts were not drawn from q (see choose_rule)."""
        return choose_rule(self)


def choose_rule(params: SamplingConfig, drawn_from_q: bool = False, typical: bool = False,
                chain: bool = False) -> str:
    """The verification rule of one request (the module docstring's table); ``chain``:
    the request's tree is a chain."""
    if params.temperature == 0.0:
        return "greedy"
    if typical:
        return "typical"
    if drawn_from_q and params.seed is None:
        return "block" if chain else "rejection"
    return "coupled"


def step_uniforms(params: Sequence[RequestSampling], width: int, generator: torch.Generator | None = None
                  ) -> torch.Tensor:
    """Float [B, width], column d the draw for each request's token d places past its root:
    position_uniforms(seed, position) for seeded requests, fresh draws from ``generator``
    (None: torch's global generator) for the others."""
    u = torch.rand(len(params), width, generator=generator,
                   device=generator.device if generator is not None else None).cpu()
    seeded = [b for b, p in enumerate(params) if p.seed is not None]
    if seeded:
        seeds = torch.tensor([(params[b].seed + (1 << 63)) % _INT64 - (1 << 63) for b in seeded])  # as int64
        positions = torch.tensor([params[b].position for b in seeded])
        u[seeded] = position_uniforms(seeds, positions, width)
    return u


def verify_step(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: torch.Tensor | None,
    params: Sequence[RequestSampling],
    *,
    draft_probs: torch.Tensor | Mapping[int, torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
    typical: bool = False,
    typical_epsilon: float = TYPICAL_EPSILON,
    typical_delta: float = TYPICAL_DELTA,
    validate: bool = True,
) -> VerifyResult:
    """Verify one step of B requests, each by its own rule (module docstring).

    logits: the target's, after the request rules: flat Float [sum(num_nodes), V]
        (request-major, an engine's layout) or padded [B, N, V].
    candidates, parents: Long [B, N] (node 0 = the root; padding parents -1).
    num_nodes: Long [B] real nodes per request (None: N each).
    params: one RequestSampling per request.
    draft_probs: drafts drawn from q: None (deterministic drafting); a tensor in the
        logits' layout (every request's drafts drawn from it); or {request b: q Float
        [k, V]}, the rows of b's nodes 0..k-1 (missing rows past k, leaves, are zeros).
        Row j is the distribution node j's children were drawn from.
    generator: the randomness of unseeded requests (None: torch's global generator).
    typical: verify sampled requests by typical acceptance (LOSSY) instead.
    """
    bsz, width = candidates.shape
    if len(params) != bsz:
        raise ValueError(f"params must hold one RequestSampling per request ({bsz}), got {len(params)}")
    num_nodes = (torch.full((bsz,), width, dtype=torch.long) if num_nodes is None
                 else torch.as_tensor(num_nodes).long().cpu())
    flat = logits.dim() == 2
    drawn = _drawn_rows(draft_probs, bsz)
    chain = chain_rows(parents, num_nodes).tolist()
    rules = [choose_rule(p, b in drawn, typical, chain[b]) for b, p in enumerate(params)]
    chains = flat and all(chain)
    # greedy and coupled chains: the vectorised chain path, unless the CUDA kernel takes them
    # (through verify, without the value checks the chain path does not make either)
    chain_path = chains and not kernel_ready(logits)
    checked = validate and not chains
    if all(r == "greedy" for r in rules):
        if chain_path:
            return verify_chains(candidates[:, 1:], num_nodes - 1, logits, "greedy")
        return verify(candidates, parents, logits, method="greedy", num_nodes=num_nodes, validate=checked)
    p = _target_probs(logits, params, num_nodes, flat)
    step = _Step(candidates, parents, num_nodes, p, step_uniforms(params, width + 1, generator), flat)
    parts = []
    for method, members in (("coupled", ("greedy", "coupled")), ("block", ("block",)),
                            ("rejection", ("rejection",)), ("typical", ("typical",))):
        rows = [b for b, r in enumerate(rules) if r in members]
        if not rows:
            continue
        sub = step.rows(rows)
        q = _draft_rows(draft_probs, rows, step) if method in ("block", "rejection") else None
        if method == "block":
            result = verify_block(sub.candidates[:, 1:], sub.num_nodes - 1, sub.p, q, sub.uniforms, validate=validate)
        elif method == "coupled" and chain_path:
            result = verify_chains(sub.candidates[:, 1:], sub.num_nodes - 1, sub.p, "coupled", sub.uniforms)
        else:
            result = verify(sub.candidates, sub.parents, sub.p, q, method=method, num_nodes=sub.num_nodes,
                            uniforms=sub.uniforms, typical_epsilon=typical_epsilon, typical_delta=typical_delta,
                            validate=checked if method == "coupled" else validate)
        parts.append((rows, result))
    return parts[0][1] if len(parts) == 1 else _stitched(bsz, parts)


# --------------------------------------------------------------------------- helpers


class _Step:
    """A step's tensors, and the same for a subset of its requests."""

    def __init__(self, candidates, parents, num_nodes, p, uniforms, flat: bool):
        self.candidates, self.parents, self.num_nodes = candidates, parents, num_nodes
        self.p, self.uniforms, self.flat = p, uniforms, flat

    def rows(self, rows: list[int]) -> "_Step":
        if len(rows) == self.candidates.shape[0]:
            return self
        return _Step(self.candidates[rows], self.parents[rows], self.num_nodes[rows],
                     self.select(self.p, rows), self.uniforms[rows], self.flat)

    def select(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Requests `rows` of a tensor in the step's layout (flat: their consecutive rows)."""
        if not self.flat:
            return x[rows]
        starts = (torch.cumsum(self.num_nodes, 0) - self.num_nodes).tolist()
        return torch.cat([x[starts[b]:starts[b] + int(self.num_nodes[b])] for b in rows])


def _drawn_rows(draft_probs, bsz: int) -> set[int]:
    if draft_probs is None:
        return set()
    if isinstance(draft_probs, torch.Tensor):
        return set(range(bsz))
    bad = [b for b in draft_probs if not 0 <= b < bsz]
    if bad:
        raise ValueError(f"draft_probs has rows {bad[:4]} outside the batch [0, {bsz}): key it by request row")
    return set(draft_probs)


def _draft_rows(draft_probs, rows: list[int], step: _Step) -> torch.Tensor:
    """q of requests `rows` in the step's layout, on p's device."""
    if isinstance(draft_probs, torch.Tensor):
        return step.select(draft_probs, rows).to(step.p.device)
    width = step.candidates.shape[1]
    parts = []
    for b in rows:
        q = draft_probs[b].to(step.p.device)
        nodes = int(step.num_nodes[b]) if step.flat else width
        if q.dim() != 2 or q.shape[0] > nodes:
            raise ValueError(f"draft_probs[{b}] must be Float [k <= {nodes}, V] (rows of the request's nodes), "
                             f"got {tuple(q.shape)}")
        parts.append(torch.cat([q, q.new_zeros(nodes - q.shape[0], q.shape[1])]) if q.shape[0] < nodes else q)
    return torch.cat(parts) if step.flat else torch.stack(parts)


def chain_rows(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """Bool [B]: whether request b's real nodes form a chain (node j's parent is j - 1);
    parents Long [B, N], num_nodes Long [B]."""
    ids = torch.arange(parents.shape[1], device=parents.device)
    real = ids < num_nodes.to(parents.device)[:, None]  # [B, N]
    return ((parents == ids - 1) | ~real).all(1)


def _target_probs(logits: torch.Tensor, params: Sequence[RequestSampling], num_nodes: torch.Tensor,
                  flat: bool) -> torch.Tensor:
    """p for every node row: each request's temperature / top-k / top-p / min-p in its
    engine's filter order (temperature-0 rows: the one-hot of the first maximal logit)."""
    def per_row(values, dtype):
        t = torch.tensor(values, dtype=dtype)  # [B]
        return t.repeat_interleave(num_nodes) if flat else t

    settings = (per_row([p.temperature for p in params], torch.float32), per_row([p.top_k for p in params], torch.long),
                per_row([p.top_p for p in params], torch.float32), per_row([p.min_p for p in params], torch.float32))
    orders = [p.order for p in params]
    if len(set(orders)) == 1:
        return process_logits(logits, *settings, order=orders[0])
    order_of_row = per_row([ORDERS.index(o) for o in orders], torch.long)
    p = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for i, order in enumerate(ORDERS):
        mine = order_of_row == i
        if bool(mine.any()):
            rows = mine.to(logits.device)
            p[rows] = process_logits(logits[rows], *(s[mine] for s in settings), order=order)
    return p


def _stitched(batch: int, parts) -> VerifyResult:
    """One VerifyResult [batch] from the results of disjoint request sets [(rows, result)]."""
    device = parts[0][1].num_accepted.device
    width = max(r.accepted_nodes.shape[1] for _, r in parts)
    accepted = torch.full((batch, width), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    bonus = torch.zeros(batch, dtype=torch.long, device=device)
    for rows, r in parts:
        index = torch.tensor(rows, device=device)
        accepted[index, :r.accepted_nodes.shape[1]] = r.accepted_nodes.to(device)
        num_accepted[index] = r.num_accepted.to(device)
        bonus[index] = r.bonus_token.to(device)
    return VerifyResult(accepted, num_accepted, bonus)
