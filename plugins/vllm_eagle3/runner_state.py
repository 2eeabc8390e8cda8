"""vLLM's V1 model runner as the adapter reads and hooks it: the one module that touches the
runner's request state and step layout (private in vLLM 0.32.0). Its hooks are instance
patches declared in patches.py; docs/architecture.md lists every engine-private name.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from specplug.vllm_eagle3.patches import (
    BUILD_ATTENTION_METADATA, PATCHES, PREPARE_INPUTS, PROPOSE_DRAFT_TOKEN_IDS, REJECTION_SAMPLER,
)


class RunnerState:
    """Reads of one GPUModelRunner (vLLM-CPU runs the same class) for the first `batch`
    rows of its input batch, and the two hooks stage "tree" needs."""

    def __init__(self, runner):
        self.runner = runner

    # -- requests ------------------------------------------------------------------------
    def request_ids(self, batch: int) -> list[str]:
        """The request ids of batch rows 0..batch-1, in row order."""
        return self.runner.input_batch.req_ids[:batch]

    @property
    def live(self) -> Mapping:
        """Every request the runner holds (scheduled or not), by id."""
        return self.runner.requests

    def sampling_params(self, req_id: str):
        """The request's SamplingParams, None if unknown."""
        return getattr(self.runner.requests.get(req_id), "sampling_params", None)

    def request_params(self, batch: int) -> list:
        """SamplingParams of batch rows 0..batch-1 (None where unknown)."""
        return [self.sampling_params(r) for r in self.request_ids(batch)]

    def known_tokens(self, req_id: str) -> list[int]:
        """Prompt then output tokens vLLM holds for the request (negative ids: embeddings)."""
        state = self.runner.requests[req_id]
        return list(state.prompt_token_ids or []) + list(state.output_token_ids)

    def token_at(self, req_id: str, position: int) -> int:
        """The request's token at `position` (prompt or committed output)."""
        return self.runner.requests[req_id].get_token_id(position)

    # -- this step's layout --------------------------------------------------------------
    def discarded(self, batch: int) -> list[bool]:
        """Per row: vLLM discards the token sampled this step (a partial prefill)."""
        return self.runner.discard_request_mask.cpu[:batch].tolist()

    def tokens_before_step(self, batch: int) -> torch.Tensor:
        """Long [batch]: tokens each row holds before this step (prompt + committed output)."""
        return torch.from_numpy(self.runner.input_batch.num_tokens_no_spec[:batch].copy()).long()

    def query_ends(self, batch: int) -> list[int]:
        """Per row: one past its last token row in this step's flat token layout."""
        return self.runner.query_start_loc.np[1:batch + 1].tolist()

    def query_lens(self, batch: int) -> list[int]:
        """Per row: the tokens it ran in this step (1 + its drafts for a decode)."""
        starts = self.runner.query_start_loc.np[:batch + 1]
        return (starts[1:] - starts[:-1]).tolist()

    @property
    def positions(self) -> torch.Tensor:
        """Long [max tokens]: the step's token positions (written in place by stage tree)."""
        return self.runner.positions

    def attention_layer(self, name: str):
        """The attention layer `name` (its kv_cache and isa)."""
        return self.runner.compilation_config.static_forward_context[name]

    # -- hooks (instance patches declared in patches.py) ------------------------------------
    def wrap_step_inputs(self, after_prepare: Callable, after_build: Callable) -> None:
        """After the runner's `_prepare_inputs`, call after_prepare(spec_metadata); after
        `_build_attention_metadata` (not for cudagraph capture), after_build(attn_metadata).
        Instance attributes: the class and other engines are untouched."""
        PATCHES.on(PREPARE_INPUTS, self.runner, after_prepare)
        PATCHES.on(BUILD_ATTENTION_METADATA, self.runner, after_build)

    def wrap_sample_hidden(self, reorder: Callable) -> None:
        """Before the runner's `propose_draft_token_ids`, its sample_hidden_states become
        reorder(hidden_states, sample_hidden_states, spec_decode_metadata) (vLLM's Medusa
        branch reads the drafter's input from them). Instance attribute, as above."""
        PATCHES.on(PROPOSE_DRAFT_TOKEN_IDS, self.runner, reorder)

    def replace_rejection_sampler(self, make: Callable) -> None:
        """runner.rejection_sampler = make(the runner's own rejection sampler)."""
        PATCHES.on(REJECTION_SAMPLER, self.runner, make)


def after_prepare_inputs(prepare: Callable, after_prepare: Callable) -> Callable:
    """A runner's bound `_prepare_inputs` that calls after_prepare(spec_metadata) after it."""

    def _prepare_inputs(scheduler_output, num_scheduled_tokens):
        out = prepare(scheduler_output, num_scheduled_tokens)
        after_prepare(out[1])
        return out

    return _prepare_inputs


def after_build_attention_metadata(build: Callable, after_build: Callable) -> Callable:
    """A runner's bound `_build_attention_metadata` that calls after_build(attn_metadata)
    after it (not for cudagraph capture)."""

    def _build_attention_metadata(*args, **kwargs):
        attn_metadata, spec_metadata = build(*args, **kwargs)
        if not kwargs.get("for_cudagraph_capture", False):
            after_build(attn_metadata)
        return attn_metadata, spec_metadata

    return _build_attention_metadata


def reordering_sample_hidden(propose: Callable, reorder: Callable) -> Callable:
    """A runner's bound `propose_draft_token_ids` whose sample_hidden_states are reordered first."""

    def propose_draft_token_ids(scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata, *rest):
        sample_hidden_states = reorder(hidden_states, sample_hidden_states, spec_decode_metadata)
        return propose(scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                       sample_hidden_states, aux_hidden_states, spec_decode_metadata, *rest)

    return propose_draft_token_ids


def replacing_sampler(own, make: Callable):
    """make(the runner's own rejection sampler)."""
    return make(own)
