"""vLLM's SamplingMetadata -> specplug.common.request_rules.RequestRules (translation only).

vLLM keeps a step's per-request rules in `SamplingMetadata` and its built-in logits
processors, by batch row; with speculation configured it builds only the min-tokens
processor, so min-p and logit bias are read from each request's SamplingParams. What
vLLM can do that specplug does not model is named by `undraftable_reason`.
"""

from __future__ import annotations

import torch

from specplug.common.request_rules import RequestRules

_BUILTIN_PROCESSORS = ("MinPLogitsProcessor", "LogitBiasLogitsProcessor", "MinTokensLogitsProcessor")
_RAW_LOGPROBS_MODES = ("raw_logprobs", "raw_logits")


def _builtin(sampling_metadata, name: str):
    for proc in sampling_metadata.logitsprocs.all:
        if type(proc).__name__ == name:
            return proc
    return None


def undraftable_reason(sampling_metadata, logprobs_mode: str) -> str | None:
    """Why specplug cannot verify this step's drafts, or None when it can."""
    for proc in sampling_metadata.logitsprocs.all:
        if type(proc).__name__ not in _BUILTIN_PROCESSORS:
            return f"the logits processor {type(proc).__name__}"
    holder = sampling_metadata.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        return "a thinking-token budget"
    if sampling_metadata.logprob_token_ids:
        return "logprobs of chosen token ids"
    if sampling_metadata.max_num_logprobs is not None and (
            sampling_metadata.max_num_logprobs < 0 or logprobs_mode not in _RAW_LOGPROBS_MODES):
        return f"logprobs mode {logprobs_mode!r}"
    return None


def min_p_of(params: list) -> torch.Tensor | float:
    """min-p per request, Float [B] (0 = off), or 0.0 when nobody uses it; params: the
    batch's SamplingParams (None for a request without)."""
    values = [float(getattr(p, "min_p", 0.0) or 0.0) for p in params]
    return torch.tensor(values) if any(values) else 0.0


def rules_of(sampling_metadata, params: list, vocab: int) -> RequestRules:
    """The step's rules for its B requests (params: their SamplingParams, vocab V = the
    logits' width)."""
    batch = len(params)
    penalties = {}
    if not sampling_metadata.no_penalties:
        penalties = dict(
            prompt_mask=_prompt_mask(sampling_metadata.prompt_token_ids, vocab),
            presence=sampling_metadata.presence_penalties[:batch].float().cpu(),
            frequency=sampling_metadata.frequency_penalties[:batch].float().cpu(),
            repetition=sampling_metadata.repetition_penalties[:batch].float().cpu(),
        )
    allowed = sampling_metadata.allowed_token_ids_mask
    return RequestRules(
        output_tokens=[list(t) for t in sampling_metadata.output_token_ids[:batch]],
        allowed=None if allowed is None else ~allowed[:batch, :vocab].cpu(),  # vLLM's mask marks banned ids
        bad_words=dict(sampling_metadata.bad_words_token_ids or {}),
        logit_bias=logit_bias_of(params),
        min_tokens=_min_tokens(sampling_metadata),
        **penalties,
    )


def _prompt_mask(prompt_token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """prompt ids Long [B, P] padded with `vocab` -> Bool [B, V]."""
    ids = prompt_token_ids.long().cpu()
    mask = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool)
    mask.scatter_(1, ids.clamp(max=vocab), True)
    return mask[:, :vocab]


def logit_bias_of(params: list) -> dict[int, dict[int, float]]:
    """request row -> {token id: bias} of the requests that set one (params as in min_p_of)."""
    return {b: {int(t): float(v) for t, v in p.logit_bias.items()}
            for b, p in enumerate(params) if p is not None and p.logit_bias}


def _min_tokens(sampling_metadata) -> dict[int, tuple[int, set[int]]]:
    """request -> (tokens it must still emit before a stop token, stop ids)."""
    proc = _builtin(sampling_metadata, "MinTokensLogitsProcessor")
    if proc is None:
        return {}
    return {b: (minimum - len(output), set(stops)) for b, (minimum, output, stops, *_) in proc.min_toks.items()}
