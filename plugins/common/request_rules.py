"""What a request asks of the target's logits before temperature: penalties, banned
words, allowed ids, logit bias, min-tokens — applied once per tree node, along that
node's own path.

Invariant: the row after node i of a draft tree is processed exactly as the engine
would process the logits after the sequence committed + path(root -> i) without
speculation, so verifying a tree (or chain) with processed rows emits what plain
decoding would (greedy), or samples its distribution (T > 0). The root token is the
last committed token; it is already part of `output_tokens` and not counted again.

Order and arithmetic follow the engine's own sampler without speculation
(`RequestRules.engine`): "vllm" (vllm/v1/sample/sampler.py): allowed ids, bad words,
logit bias, min-tokens, then repetition (prompt or output seen; x * 1/p above 0) and
frequency / presence penalties. "sglang" (sglang/srt/sampling/penaltylib): min-new-tokens
and frequency / presence as one additive row, then repetition (output seen only; x / p
above 0), then logit bias; SGLang has no allowed ids or bad words.
Temperature, min-p, top-k and top-p follow in specplug.common.target_probs.process_logits.
Rows are flattened request-major: request b owns num_nodes[b] consecutive rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specplug.common.tree import ancestor_mask, tree_depths

ENGINES = ("vllm", "sglang")


@dataclass(frozen=True)
class RequestRules:
    """Per-request rules for a batch of B requests; None / empty means nobody uses it.

    output_tokens: committed output tokens of each request (penalties, bad words).
    prompt_mask: Bool [B, V], tokens present in the prompt (repetition penalty only).
    presence, frequency, repetition: Float [B] (0, 0, 1 = off).
    allowed: Bool [B, V], True = the token may be emitted.
    bad_words: request index -> token sequences that must not be completed.
    logit_bias: request index -> {token: bias}.
    min_tokens: request index -> (tokens still to emit before a stop token may come,
        stop token ids).
    engine: whose sampler's order and arithmetic to follow, "vllm" or "sglang".
    """

    output_tokens: list[list[int]] = field(default_factory=list)
    prompt_mask: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    allowed: torch.Tensor | None = None
    bad_words: dict[int, list[list[int]]] = field(default_factory=dict)
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)
    min_tokens: dict[int, tuple[int, set[int]]] = field(default_factory=dict)
    engine: str = "vllm"

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"RequestRules.engine must be one of {ENGINES}, got {self.engine!r}")

    @property
    def has_penalties(self) -> bool:
        return any(t is not None for t in (self.presence, self.frequency, self.repetition))

    @property
    def empty(self) -> bool:
        return not (self.has_penalties or self.allowed is not None or self.bad_words
                    or self.logit_bias or self.min_tokens)


def apply_rules(logits: torch.Tensor, rules: RequestRules, candidates: torch.Tensor,
                parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """Flat rows logits Float [sum(num_nodes), V] -> processed rows (a new tensor).

    candidates, parents: Long [B, N] trees (node 0 = root, padding parents -1);
    num_nodes: Long [B]. A chain is the tree whose node i has parent i - 1."""
    if rules.empty:
        return logits
    x = logits.float().clone()
    request = torch.repeat_interleave(torch.arange(len(num_nodes)), num_nodes.cpu())  # [R]
    if rules.allowed is not None:
        x.masked_fill_(~rules.allowed[request].to(x.device), float("-inf"))
    paths = _row_paths(candidates, parents, num_nodes) if _needs_paths(rules) else None
    if rules.engine == "sglang":
        return _sglang_order(x, rules, request, paths, parents, num_nodes)
    _ban_bad_words(x, rules, request, paths)
    _add_bias(x, rules, request)
    _hold_stop_tokens(x, rules, request, parents, num_nodes)
    if rules.has_penalties:
        x = _penalize(x, rules, request, paths)
    return x


def _needs_paths(rules: RequestRules) -> bool:
    return rules.has_penalties or bool(rules.bad_words)


def _row_paths(candidates, parents, num_nodes) -> list[list[int]]:
    """Drafted tokens on the path root -> node of every real row (root excluded)."""
    anc = ancestor_mask(parents.cpu())  # [B, N, N]
    cands = candidates.cpu().tolist()
    out = []
    for b, n in enumerate(num_nodes.tolist()):
        for i in range(n):
            nodes = anc[b, i, 1:i + 1].nonzero().flatten().add(1).tolist()  # ancestors come first by id
            out.append([cands[b][j] for j in nodes])
    return out


def _ban_bad_words(x, rules, request, paths) -> None:
    """A bad word [w1..wn] bans wn where the history ends with w1..w(n-1) (n = 1: always)."""
    if not rules.bad_words:
        return
    for r, b in enumerate(request.tolist()):
        words = rules.bad_words.get(b)
        if not words:
            continue
        history = rules.output_tokens[b] + paths[r]
        for word in words:
            prefix = word[:-1]
            if len(prefix) <= len(history) and (not prefix or history[-len(prefix):] == prefix):
                x[r, word[-1]] = float("-inf")


def _add_bias(x, rules, request) -> None:
    if not rules.logit_bias:
        return
    for r, b in enumerate(request.tolist()):
        for token, bias in rules.logit_bias.get(b, {}).items():
            x[r, token] += bias


def _hold_stop_tokens(x, rules, request, parents, num_nodes) -> None:
    """min_tokens: stop tokens banned at rows whose path is shorter than what the request
    still needs (unless that would ban every token of the row)."""
    if not rules.min_tokens:
        return
    depth = _flat_depths(parents, num_nodes)  # [R]
    for r, b in enumerate(request.tolist()):
        if b not in rules.min_tokens:
            continue
        needed, stops = rules.min_tokens[b]
        if int(depth[r]) < needed and stops:
            ids = torch.tensor(sorted(stops), device=x.device)
            kept = x[r].clone()
            x[r, ids] = float("-inf")
            if bool(torch.isneginf(x[r]).all()):
                x[r] = kept


def _flat_depths(parents, num_nodes) -> torch.Tensor:
    depth = tree_depths(parents.cpu())  # [B, N]
    real = torch.arange(parents.shape[1])[None] < num_nodes.cpu()[:, None]
    return depth[real]


def _sglang_order(x, rules, request, paths, parents, num_nodes) -> torch.Tensor:
    """SGLang's sampler: additive penalties (min-new-tokens, frequency, presence), then
    repetition scaling, then logit bias."""
    _hold_stop_tokens(x, rules, request, parents, num_nodes)
    if rules.has_penalties:
        counts = _counts(x, rules, request, paths)
        seen = counts > 0
        req = request.to(x.device)
        additive = torch.zeros_like(x)
        if rules.frequency is not None:
            additive = additive - rules.frequency.to(x.device)[req, None] * counts
        if rules.presence is not None:
            additive = additive - rules.presence.to(x.device)[req, None] * seen
        x = x + additive
        if rules.repetition is not None:
            penalty = torch.where(seen, rules.repetition.to(x.device)[req, None], 1.0)
            x = torch.where(x < 0, x * penalty, x / penalty)
    _add_bias(x, rules, request)
    return x


def _counts(x, rules, request, paths) -> torch.Tensor:
    """Float [R, V]: each row's token counts over committed output + its drafted path."""
    counts = torch.zeros_like(x)
    for r, b in enumerate(request.tolist()):
        seen = rules.output_tokens[b] + paths[r]
        if seen:
            counts[r].index_add_(0, torch.tensor(seen, device=x.device),
                                 torch.ones(len(seen), device=x.device))
    return counts


def _penalize(x, rules, request, paths) -> torch.Tensor:
    """vLLM: repetition (prompt or output seen), then frequency and presence (output
    seen), the output being committed tokens + the row's drafted path."""
    vocab = x.shape[-1]
    counts = _counts(x, rules, request, paths)
    output_mask = counts > 0
    req = request.to(x.device)
    if rules.repetition is not None:
        prompt_mask = rules.prompt_mask[req] if rules.prompt_mask is not None else torch.zeros_like(output_mask)
        penalty = torch.where(prompt_mask[:, :vocab] | output_mask, rules.repetition.to(x.device)[req, None], 1.0)
        x = x * torch.where(x > 0, 1.0 / penalty, penalty)
    if rules.frequency is not None:
        x = x - rules.frequency.to(x.device)[req, None] * counts
    if rules.presence is not None:
        x = x - rules.presence.to(x.device)[req, None] * output_mask
    return x


STRUCTURED_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")  # SGLang's structured-output fields


def structured_output_key(sampling_params) -> str | None:
    """The structured-output field (STRUCTURED_KEYS) a request's sampling params (dict or
    list of dicts) set, else None: specplug's tree verification applies no grammar."""
    for params in sampling_params if isinstance(sampling_params, list) else [sampling_params]:
        for key in STRUCTURED_KEYS:
            if isinstance(params, dict) and params.get(key) is not None:
                return key
    return None
