"""SGLang's per-request sampling rules (read from each request: penalties over its
committed output, min-new-tokens with the stop ids SGLang's penalizer bans, logit bias) ->
specplug.common.request_rules.RequestRules, applied by the core with engine="sglang"."""

from __future__ import annotations

import torch

from specplug.common.request_rules import RequestRules
from specplug.sglang_medusa import batch_view as view


def rules_of(reqs) -> RequestRules:
    """The decode batch's rules, one entry per request (empty when nobody sets any)."""
    params = [req.sampling_params for req in reqs]
    penalties = {}
    if any(_penalised(p) for p in params):
        penalties = dict(
            frequency=torch.tensor([float(p.frequency_penalty) for p in params]),
            presence=torch.tensor([float(p.presence_penalty) for p in params]),
            repetition=torch.tensor([float(p.repetition_penalty) for p in params]),
        )
    return RequestRules(
        output_tokens=[list(view.output_ids(req)) for req in reqs] if penalties else [],
        logit_bias={b: {int(t): float(v) for t, v in p.logit_bias.items()}
                    for b, p in enumerate(params) if p.logit_bias},
        min_tokens={b: (p.min_new_tokens - len(view.output_ids(req)), stop_ids(req))
                    for b, (req, p) in enumerate(zip(reqs, params)) if p.min_new_tokens > len(view.output_ids(req))},
        engine="sglang",
        **penalties,
    )


def _penalised(params) -> bool:
    return params.frequency_penalty != 0.0 or params.presence_penalty != 0.0 or params.repetition_penalty != 1.0


def stop_ids(req) -> set[int]:
    """The tokens SGLang's min-new-tokens penalizer bans: the request's stop ids, its EOS
    ids and the tokenizer's EOS / additional stop ids."""
    tokenizer = req.tokenizer
    ids = set(req.sampling_params.stop_token_ids or ()) | set(req.eos_token_ids or ())
    if tokenizer is not None:
        ids |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
        ids |= {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    return {int(t) for t in ids if t is not None}
