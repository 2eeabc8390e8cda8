"""The one reader of SGLang 0.5.23's batch, request and target-worker fields (listed in
docs/architecture.md), but for the verify inputs tree_worker writes into the batch and the
sampling-rule fields request_rules reads."""

from __future__ import annotations

import torch

from specplug.common.verify_step import RequestSampling


# ---------------------------------------------------------------------- requests


def requests(batch) -> list:
    """The batch's requests (SGLang `Req`s), in row order."""
    return batch.reqs


def request_ids(batch) -> list[str]:
    return [req.rid for req in batch.reqs]


def prompt_ids(req) -> list[int]:
    return req.origin_input_ids


def output_ids(req) -> list[int]:
    """Committed output tokens; the last one is the next step's root."""
    return req.output_ids


def committed_tokens(batch) -> list[tuple[str, list[int], list[int]]]:
    """(request id, prompt ids, committed output ids) per request, in row order."""
    return [(req.rid, req.origin_input_ids, req.output_ids) for req in batch.reqs]


def max_live(cfg) -> int:
    """Requests a worker keeps drafting state for before it frees the ones SGLang never
    reported finished (drafting.session.stale_requests): twice --max-running-requests."""
    return 2 * int(cfg.max_running_requests or 48)


def last_tokens(batch) -> list[int]:
    """Each request's last committed token (the root of its next tree)."""
    return [req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1] for req in batch.reqs]


# ---------------------------------------------------------------------- batch layout


def seq_lens(batch) -> torch.Tensor:
    """Int [B] on the device: tokens in each request's KV before this step."""
    return batch.seq_lens


def extend_spans(batch) -> list[tuple[int, int]]:
    """Per request of an extend (prefill) batch: (first position, tokens) of this chunk."""
    return [(int(start), int(n)) for start, n in zip(batch.prefix_lens, batch.extend_lens)]


def is_decode(batch) -> bool:
    return batch.forward_mode.is_decode()


def committed_length(req) -> int:
    """Tokens the request holds: prompt + committed output (the root included), i.e. the
    sequence position of the next token it emits."""
    return len(req.origin_input_ids) + len(req.output_ids)


def request_sampling(batch) -> list[RequestSampling]:
    """Each request's sampling settings in the core's terms, from its SamplingParams:
    SGLang marks a greedy request with top_k 1 (temperature < 1e-6 becomes top_k 1), its
    seed is `sampling_seed`, its filters run in SGLang's order."""
    out = []
    for req in batch.reqs:
        sp = req.sampling_params
        greedy = sp.top_k <= 1 or sp.temperature < 1e-6
        out.append(RequestSampling(
            temperature=0.0 if greedy else float(sp.temperature), top_k=0 if greedy else int(sp.top_k),
            top_p=float(sp.top_p), min_p=float(sp.min_p), order="sglang", seed=sp.sampling_seed,
            position=committed_length(req)))
    return out


# ---------------------------------------------------------------------- the target


def target_model(model_runner) -> torch.nn.Module:
    return model_runner.model


def target_config(model_runner):
    """The target's Hugging Face config."""
    return model_runner.model_config.hf_config


def target_dtype(model_runner) -> torch.dtype:
    return model_runner.model_config.dtype


def vocab_size(model_runner) -> int:
    return model_runner.model_config.vocab_size


def embedding_weight(model_runner) -> torch.Tensor:
    """The target's input embedding [vocab', H] (vocab' >= vocab: SGLang pads it), whole (whole_vocab)."""
    return whole_vocab(model_runner, "embed_tokens", model_runner.model.model.embed_tokens.weight)


def lm_head_weight(model_runner) -> torch.Tensor:
    """The target's LM head [vocab', H], as embedding_weight."""
    return whole_vocab(model_runner, "lm_head", model_runner.model.lm_head.weight)


def whole_vocab(model_runner, name: str, shard: torch.Tensor) -> torch.Tensor:
    """`shard` itself on one tensor-parallel rank, never copied; on several, the ranks'
    vocabulary shards [vocab' / tp, H] all-gathered into [vocab', H] once and kept on the
    model runner. A collective: every rank calls it for the same names in the same order."""
    group = tp_group()
    if group is None:
        return shard
    kept = model_runner.__dict__.setdefault("_specplug_whole_vocab", {})
    if name not in kept:
        kept[name] = group.all_gather(shard.detach().contiguous(), dim=0)
    return kept[name]


def tp_group():
    """SGLang's tensor-parallel GroupCoordinator when this process is one of several ranks;
    None with one rank, or outside an engine (SGLang's groups not initialised)."""
    from sglang.srt.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized() or get_tp_group().world_size == 1:
        return None
    return get_tp_group()


def tp_all_reduce():
    """SGLang's all-reduce over the tensor-parallel ranks, or None with one rank."""
    group = tp_group()
    return None if group is None else group.all_reduce
