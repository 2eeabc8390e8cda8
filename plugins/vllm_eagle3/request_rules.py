"""vLLM's SamplingMetadata -> specplug.common.request_rules.RequestRules (translation only).

vLLM keeps a step's per-request rules in `SamplingMetadata` (penalties, allowed ids, bad
words) and in its built-in logits processors (min-p, logit bias, min-tokens), indexed by
the request's row in the batch. These functions read them; what the rules mean lives in
the core. Anything else (custom logits processors, thinking budgets, logprobs of chosen
token ids, processed-logprobs modes) is named by `undraftable_reason`: such a step runs
without drafts (sampler.py).
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


def min_p_of(sampling_metadata, batch: int) -> torch.Tensor | float:
    """min-p per request, Float [B] (0 = off), or 0.0 when nobody uses it."""
    proc = _builtin(sampling_metadata, "MinPLogitsProcessor")
    if proc is None or not proc.min_p_count:
        return 0.0
    return torch.from_numpy(proc.min_p_cpu[:batch].copy())


def rules_of(sampling_metadata, batch: int, vocab: int) -> RequestRules:
    """The step's rules for its B requests (vocab V = the logits' width)."""
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
        logit_bias=_logit_bias(sampling_metadata),
        min_tokens=_min_tokens(sampling_metadata),
        **penalties,
    )


def _prompt_mask(prompt_token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """prompt ids Long [B, P] padded with `vocab` -> Bool [B, V]."""
    ids = prompt_token_ids.long().cpu()
    mask = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool)
    mask.scatter_(1, ids.clamp(max=vocab), True)
    return mask[:, :vocab]


def _logit_bias(sampling_metadata) -> dict[int, dict[int, float]]:
    proc = _builtin(sampling_metadata, "LogitBiasLogitsProcessor")
    return {} if proc is None else {b: dict(bias) for b, bias in proc.biases.items()}


def _min_tokens(sampling_metadata) -> dict[int, tuple[int, set[int]]]:
    """request -> (tokens it must still emit before a stop token, stop ids)."""
    proc = _builtin(sampling_metadata, "MinTokensLogitsProcessor")
    if proc is None:
        return {}
    return {b: (minimum - len(output), set(stops)) for b, (minimum, output, stops, *_) in proc.min_toks.items()}
