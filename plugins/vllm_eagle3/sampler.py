"""specplug's verification in place of vLLM's chain rejection sampler (specplug heads only).

vLLM hands the runner's `rejection_sampler` the target logits of every scheduled draft in
request-major order: request i owns num_draft_tokens[i] + 1 consecutive rows, the
distributions after the root and after each draft token (in stage "tree", after each tree
node: tree_verify.py). That is specplug.common.verify_step's flat layout, so no copy is
needed: this module applies each request's rules (specplug.common.request_rules) and hands
the batch, each request's sampling in the core's terms and the drafts drawn from q (the
DraftingSession's step record) to verify_step, which chooses each request's rule. Logprobs
of the emitted tokens are vLLM's raw logprobs at the rows the tokens came from.

A step with something specplug does not model (request_rules.undraftable_reason), or a
greedy step without a single draft or logit bias, runs without drafts: each request's root
row through vLLM's own non-speculative sampler, one token each, as without speculation.
"""

from __future__ import annotations

import logging

import torch

from specplug.common.drafting.session import GREEDY_BELOW
from specplug.common.request_rules import apply_rules
from specplug.common.tree import chain_batch, pad_parents
from specplug.common.verify_step import RequestSampling, verify_step
from specplug.vllm_eagle3.request_rules import logit_bias_of, min_p_of, rules_of, undraftable_reason

logger = logging.getLogger(__name__)


def install_verification(state, tree: bool, session=None, on_verify=None):
    """specplug's verification on the runner of `state` (runner_state.RunnerState): its
    rejection sampler becomes a SpecplugChainSampler; with `tree` (stage "tree", platform
    checked: tree_platform) a tree_verify.TreeVerifier hooks the runner first and is
    returned (else None). session, on_verify: as SpecplugChainSampler takes them."""
    verifier = None
    if tree:
        from specplug.vllm_eagle3.tree_verify import TreeVerifier
        verifier = TreeVerifier(state)
        verifier.install()
        logger.info("specplug stage tree: runner._prepare_inputs and _build_attention_metadata wrapped (tree "
                    "positions, ancestor mask via CPU_ATTN override, KV compaction after verification)")
    state.replace_rejection_sampler(lambda own: SpecplugChainSampler(own, state, verifier, session, on_verify))
    logger.info("specplug: runner.rejection_sampler replaced by SpecplugChainSampler (specplug.common.verify_step)")
    return verifier


def _values(t: torch.Tensor | None, batch: int, default) -> list:
    """A per-request setting of vLLM's SamplingMetadata as a list [B] (None: `default` each)."""
    return [default] * batch if t is None else t[:batch].tolist()


def _spread(t: torch.Tensor | None, width: int) -> torch.Tensor | None:
    """Rows [B, ...] -> [B * width, ...] with row b at b * width (zeros elsewhere)."""
    if t is None:  # an optional field of LogprobsTensors
        return None
    out = t.new_zeros((t.shape[0] * width, *t.shape[1:]))
    out[::width] = t
    return out


class SpecplugChainSampler:
    """Callable like vLLM's RejectionSampler: (metadata, draft_probs, logits,
    sampling_metadata) -> SamplerOutput with sampled_token_ids [B, max_spec_len + 1].

    With `tree` (stage "tree": a tree_verify.TreeVerifier) the drafts of a step may be
    trees: their topology comes from `tree.parents_for`, the whole tree is verified, and
    `tree.accept` compacts the accepted path. Every request is verified here; a step
    with a rule specplug does not model (request_rules.undraftable_reason), or a plain
    greedy step without drafts (_plain_greedy), emits one token per request from vLLM's
    non-speculative sampler instead."""

    def __init__(self, vllm_sampler, state, tree=None, session=None, on_verify=None):
        self.vllm_sampler = vllm_sampler
        self.state = state  # runner_state.RunnerState: the requests of the batch being verified
        self.tree = tree
        # a DraftingSession whose step record holds the drafts drawn from q, or None
        self.session = session
        self.on_verify = on_verify  # (request ids, num_draft_tokens [B], num_accepted [B]) after each verify
        self._fallback_reasons: set[str] = set()

    def __getattr__(self, name):  # the runner also reads helpers off its sampler
        return getattr(self.vllm_sampler, name)

    def __call__(self, metadata, draft_probs, logits, sampling_metadata):
        from vllm.v1.outputs import SamplerOutput

        reason = undraftable_reason(sampling_metadata, self.vllm_sampler.sampler.logprobs_mode)
        if reason is not None or self._plain_greedy(metadata, sampling_metadata):
            return self._without_drafts(reason, metadata, logits, sampling_metadata)
        tree_parents = None if self.tree is None else self.tree.parents_for(metadata.num_draft_tokens)
        candidates, parents, num_nodes, *_ = chain_batch(metadata.num_draft_tokens, metadata.draft_token_ids)
        if tree_parents is not None:
            parents = pad_parents(tree_parents, parents.shape[1])
        raw = logits[: int(num_nodes.sum())]  # [R, V], R = sum(num_nodes)
        params = self.state.request_params(len(num_nodes))
        processed = apply_rules(raw, rules_of(sampling_metadata, params, raw.shape[-1]), candidates, parents, num_nodes)
        result = self._verify(candidates, parents, num_nodes, processed, sampling_metadata, params)
        if self.tree is not None:
            self.tree.accept(result.accepted_nodes, result.num_accepted)
        self._verified(metadata.num_draft_tokens, result.num_accepted)
        tokens = result.output_tokens(candidates, candidates.shape[1]).to(torch.int32)  # [B, max_spec_len + 1]
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._logprobs(raw, tokens, result, num_nodes, sampling_metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=tokens.to(logits.device), logprobs_tensors=logprobs)

    def _plain_greedy(self, metadata, sampling_metadata) -> bool:
        """A greedy step without a single draft and without logit bias (which vLLM's
        sampler skips when speculation is configured; min-p never moves an argmax):
        vLLM's own sampler emits exactly what it would without speculation."""
        if not sampling_metadata.all_greedy or any(metadata.num_draft_tokens):
            return False
        return not logit_bias_of(self.state.request_params(len(metadata.num_draft_tokens)))

    def _logprobs(self, raw, tokens, result, num_nodes, max_num_logprobs):
        """vLLM's raw logprobs of every emitted token, rows in the order of `tokens`
        flattened [B * W] (placeholder slots get row 0 / token 0; vLLM drops them)."""
        sampler = self.vllm_sampler.sampler
        starts = torch.cumsum(num_nodes, 0) - num_nodes  # [B]
        rows = result.node_rows(starts, tokens.shape[1]).clamp(min=0).flatten()  # [B * W]
        emitted = tokens.flatten().clamp(min=0).long()
        logprobs = raw[rows.to(raw.device)].float()
        if sampler.logprobs_mode == "raw_logprobs":
            logprobs = sampler.compute_logprobs(logprobs)
        return sampler.gather_logprobs(logprobs, max_num_logprobs, emitted.to(raw.device))

    def _without_drafts(self, reason, metadata, logits, sampling_metadata):
        """Every request emits one token from its root row through vLLM's own
        non-speculative sampler; drafts are not verified (none accepted)."""
        from vllm.v1.outputs import LogprobsTensors, SamplerOutput

        if reason is not None:
            self._log_once(reason)
        num_nodes = torch.tensor(metadata.num_draft_tokens) + 1
        batch, width = len(num_nodes), int(num_nodes.max())
        if width == 1:  # no drafts this step: the logits rows are the roots', in order
            roots = logits[:batch]
        else:
            roots = logits[(torch.cumsum(num_nodes, 0) - num_nodes).to(logits.device)]
        out = self.vllm_sampler.sampler(logits=roots, sampling_metadata=sampling_metadata)
        if self.tree is not None:
            self.tree.accept(torch.zeros(batch, 1, dtype=torch.long), torch.zeros(batch, dtype=torch.long))
        self._verified(metadata.num_draft_tokens, torch.zeros(batch, dtype=torch.long))
        if width == 1:
            return out
        tokens = out.sampled_token_ids.new_full((batch, width), -1)
        tokens[:, 0] = out.sampled_token_ids[:, 0]
        logprobs = out.logprobs_tensors
        if logprobs is not None:  # rows [B] -> [B * W], row b at b * W
            logprobs = LogprobsTensors(*(_spread(t, width) for t in logprobs))
        return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=logprobs)

    def _verified(self, num_draft_tokens, num_accepted: torch.Tensor) -> None:
        if self.on_verify is not None:
            self.on_verify(self.state.request_ids(len(num_draft_tokens)), list(num_draft_tokens), num_accepted)

    def _verify(self, candidates, parents, num_nodes, logits, sampling_metadata, params):
        """verify_step over flat logits [sum(num_nodes), vocab] (request-major); the core
        chooses each request's rule. Rows whose drafts were drawn from q (the session's
        step record) hand that q over."""
        drawn = {} if self.session is None else self.session.draft_q(
            self.state.request_ids(len(num_nodes)), candidates, num_nodes)
        settings = self._request_sampling(sampling_metadata, params)
        return verify_step(logits, candidates, parents, num_nodes, settings, draft_probs=drawn or None)

    def _request_sampling(self, sampling_metadata, params) -> list[RequestSampling]:
        """Each row's settings in the core's terms: temperature / top-k / top-p as vLLM's
        sampler holds them (below GREEDY_BELOW: greedy), min-p and seed from its
        SamplingParams, and the tokens it holds before this step."""
        batch = len(params)
        temperature = _values(sampling_metadata.temperature, batch, 0.0)
        top_k = _values(sampling_metadata.top_k, batch, 0)
        top_p = _values(sampling_metadata.top_p, batch, 1.0)
        min_p = min_p_of(params)
        min_p = min_p.tolist() if isinstance(min_p, torch.Tensor) else [min_p] * batch
        seeds = [getattr(sp, "seed", None) for sp in params]
        positions = self.state.tokens_before_step(batch).tolist()
        return [RequestSampling(temperature=0.0 if temperature[b] < GREEDY_BELOW else temperature[b],
                                top_k=int(top_k[b]), top_p=top_p[b], min_p=min_p[b], order="vllm", seed=seeds[b],
                                position=int(positions[b]))
                for b in range(batch)]

    def _log_once(self, reason: str) -> None:
        if reason not in self._fallback_reasons:
            self._fallback_reasons.add(reason)
            logger.info("specplug: a request uses %s, which specplug does not verify; steps with such "
                        "requests run without drafts (vLLM's non-speculative sampler, one token each)", reason)
