"""The specplug EAGLE proposer for vLLM's V1 model runner (EAGLE-3 heads, method "eagle3";
EAGLE-1 heads, method "eagle"), in place of vLLM's `EagleProposer`; for heads without a
`specplug` section every method is vLLM's own.

Drafting is the core's (DraftingSession over EagleDrafting), each step's depth the core's
StepPolicy; this module translates vLLM's batch into `Committed` rows and the drafts back
into vLLM's draft tokens: in stage "chain" each request's best tree path, verified by
specplug's sampler (sampler.py); in stage "tree" every kept node, verified in one target
pass (tree_verify.py), with a chain for requests that need one (tree_verify.needs_chain).
"""

from __future__ import annotations

import logging
import time

import torch
from vllm.v1.spec_decode.eagle import EagleProposer

from specplug.vllm_eagle3.ranks import tp_ranks
from specplug.vllm_eagle3.dense_head import DenseEagle1Head, DenseEagle3Head
from specplug.vllm_eagle3.quantized_layers import use_quantized_weights
from specplug.vllm_eagle3.runner_state import RunnerState
from specplug.vllm_eagle3.tree_platform import check_platform
from specplug.vllm_eagle3.sampler import install_verification
from specplug.common.head_section import HeadSettings
from specplug.vllm_eagle3.settings import (
    adapter_settings,
    check_head_matches_target,
    check_num_speculative_tokens,
    specplug_section,
)
from specplug.common import drafter_registry, memory
from specplug.common.drafting.eagle import Committed, EagleDrafting
from specplug.common.drafting.engine_layers import EngineTarget
from specplug.common.drafting.session import DraftingSession
from specplug.common.path_choice import best_chains
from specplug.common.quantization import head_linears
from specplug.common.policy.step_policy import StepPolicy
from specplug.common.tree import TreeConfig

logger = logging.getLogger(__name__)


class SpecplugEagleProposer(EagleProposer):
    """vLLM's EagleProposer, plus specplug's tree drafting for specplug heads."""

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.state = None if runner is None else RunnerState(runner)  # vLLM's runner: the batch being drafted
        section = specplug_section(self.draft_model_config.hf_config, self.method)
        self.specplug: HeadSettings | None = None
        if section is None:
            return
        check_head_matches_target(self.draft_model_config.model, vllm_config.model_config.hf_text_config,
                                  self.method)
        self.head_runner = DenseEagle3Head if self.method == "eagle3" else DenseEagle1Head
        self.specplug = adapter_settings(section)
        check_num_speculative_tokens(self.specplug, self.num_speculative_tokens)
        self.ranks = tp_ranks()  # the engine's TP group: decisions are rank 0's (specplug.common.parallel)
        self.steps = 0  # propose calls, the step number of the rank check
        self.tree_verifier = None  # stage "tree": a TreeVerifier, built with the runner
        check_platform(vllm_config, self.specplug.stage)
        token_drafter = None  # hybrid drafting: the section's token drafter, or None
        if self.specplug.drafter is not None:
            token_drafter = drafter_registry.build(self.specplug.drafter, vllm_config.model_config.get_vocab_size())
        # the head's EagleDrafting joins the session on the loaded head at the first step
        self.session = DraftingSession.for_settings(self.specplug, token_drafter=token_drafter, ranks=self.ranks,
                                                    chains=self.specplug.stage == "chain")
        self.policy = StepPolicy(self.num_speculative_tokens, adaptive=self.specplug.adaptive,
                                 payoff=self.specplug.payoff, all_or_none=self.specplug.stage == "tree",
                                 gate=self.session.gate, ranks=self.ranks, drafts="tree")
        memory.from_environment()  # opt-in: SPECPLUG_MALLOC_TRIM_S, SPECPLUG_MEMORY_LOG_S (docs/reliability.md)
        self._log_active()

    def load_model(self, target_model):
        super().load_model(target_model)
        if self.specplug is not None and self.specplug.head_weights != "float":
            self._use_quantized_weights(target_model)
        if self.specplug is not None and self.session.token_drafter is not None:  # self_spec: the target's layers
            drafter_registry.bind_target(self.session.token_drafter, EngineTarget(
                target_model, target_model.compute_logits, self.vllm_config.model_config.hf_text_config))
        if self.specplug is not None and self.state is not None:  # the runner builds its sampler after the drafter
            self.tree_verifier = install_verification(self.state, self.specplug.stage == "tree", self.session,
                                                      self._verified)

    def propose(self, num_speculative_tokens, target_token_ids, target_positions,
                target_hidden_states, next_token_ids, token_indices_to_sample,
                common_attn_metadata, sampling_metadata, mm_embed_inputs=None,
                num_rejected_tokens_gpu=None, slot_mappings=None):
        if self.specplug is None:
            return super().propose(
                num_speculative_tokens, target_token_ids, target_positions,
                target_hidden_states, next_token_ids, token_indices_to_sample,
                common_attn_metadata, sampling_metadata, mm_embed_inputs,
                num_rejected_tokens_gpu, slot_mappings,
            )
        self._last_draft_probs = None  # vLLM's own draft-probs slot stays empty (q travels in the step record)
        self.session.begin_step()
        if self.session.drafting is None:
            self.session.drafting = EagleDrafting(self.head_runner(self.model))
        starts = common_attn_metadata.query_start_loc_cpu[: common_attn_metadata.num_reqs + 1]
        self.policy.begin((starts[1:] - starts[:-1]).tolist())  # the step since the last propose call
        if self.tree_verifier is not None:  # accepted tree nodes first, as in a chain
            target_token_ids, target_positions, target_hidden_states = self.tree_verifier.committed_order(
                target_token_ids, target_positions, target_hidden_states)
        try:
            with torch.inference_mode():
                drafts = self._propose_chains(target_token_ids, target_positions, target_hidden_states,
                                              next_token_ids, common_attn_metadata, num_rejected_tokens_gpu)
        finally:
            self.policy.end()
        self.steps += 1
        self.ranks.check(self.steps, drafts)  # SPECPLUG_CHECK_RANKS=1: every TP rank drafted the same
        return drafts

    # -- specplug path ------------------------------------------------------------
    def _propose_chains(self, token_ids, positions, aux_hidden, next_token_ids, attn_metadata, num_rejected):
        """Returns the best tree path per request, [batch, depth] (int), depth this step's
        StepPolicy.depth (num_speculative_tokens without adaptive or payoff control; 0
        columns = no speculation: vLLM's scheduler takes each request's list of drafts as
        is and verifies exactly that many); in stage "tree" every kept tree node, [batch,
        budget]. With the draft gate on, a list
        of `batch` lists: a request's chain, or none where it would not pay (_gated)."""
        batch = attn_metadata.num_reqs
        self.session.forget(self.state.live)
        discarded = self.state.discarded(batch)
        rows, requests = self._committed_rows(token_ids, positions, aux_hidden, next_token_ids,
                                              attn_metadata, num_rejected, discarded)
        keep = [i for i, b in enumerate(rows) if not discarded[b]]  # vLLM drops partial prefills' drafts
        depth = self.policy.depth(len(keep))
        if self.session.token_drafter is not None and depth > 0:  # else the next drafting step fills it in
            self.session.sync_committed(requests, self.state.known_tokens)
        kept_ids = [requests[i][0] for i in keep]
        roots, alone = self.session.catch_up(requests, kept_ids, depth, chains=self.tree_verifier is None)
        if alone is not None:
            return self._scatter(alone, [rows[i] for i in keep], batch, next_token_ids)
        if not keep or depth == 0:
            return torch.zeros(batch, depth, dtype=next_token_ids.dtype, device=next_token_ids.device)
        started = time.perf_counter()
        kept_roots = [roots[i] for i in keep]
        if self.tree_verifier is None:
            params = [self.state.sampling_params(r) for r in kept_ids]
            drafts, expected = self.session.chains(kept_roots, kept_ids, depth, params, self.specplug.tree)
        else:
            drafts, expected = self._draft_trees(kept_roots, kept_ids), None
        self.policy.drafted(len(keep), depth, started)
        if self.session.gate is not None:
            return self._gated(drafts, expected, [rows[i] for i in keep], kept_ids, batch)
        return self._scatter(drafts, [rows[i] for i in keep], batch, next_token_ids)

    def _gated(self, drafts, expected, rows, req_ids, batch) -> list[list[int]]:
        """Each batch row's drafts as vLLM's list of lists: the chain where the draft gate
        keeps it (DraftingSession.gated), else none (vLLM then runs that request's step
        plain, as for n-gram drafts that found nothing)."""
        keep = self.session.gated(drafts, expected, req_ids, batch)  # [len(rows)]
        out: list[list[int]] = [[] for _ in range(batch)]
        for i in torch.nonzero(keep).flatten().tolist():
            out[rows[i]] = drafts[i].tolist()
        return out

    @staticmethod
    def _scatter(drafts, rows, batch, next_token_ids):
        """Drafts [len(rows), K] placed at their batch rows of a [batch, K] zero tensor."""
        out = torch.zeros(batch, drafts.shape[1], dtype=next_token_ids.dtype)
        out[rows] = drafts.to(out.dtype)
        return out.to(next_token_ids.device)

    def _draft_trees(self, roots, req_ids):
        """Stage "tree": every kept node of each root's tree, Long [len(roots), N - 1]
        (TreeVerifier.hand_over); requests that need a chain get its best path."""
        config = self.specplug.tree
        trees = self.session.drafting.trees(roots, TreeConfig(config.depth, config.topk, config.budget))
        trees = self.session.merged(trees, req_ids, None, budget=config.budget)
        width = trees.candidates.shape[1] - 1
        return self.tree_verifier.hand_over(trees, req_ids, lambda rows: best_chains(trees, width)[rows])

    def _verified(self, req_ids, num_draft_tokens, num_accepted):
        """The sampler's verify result, [B] drafts scheduled and accepted per batch row."""
        self.policy.verified(num_draft_tokens, num_accepted)
        self.session.verified(req_ids, num_draft_tokens, num_accepted.tolist())

    def _committed_rows(self, token_ids, positions, aux_hidden, next_token_ids, attn_metadata,
                        num_rejected, discarded):
        """(batch rows with new tokens, their Committed rows): what vLLM committed this
        step, rejected drafts cut off."""
        batch = attn_metadata.num_reqs
        req_ids = self.state.request_ids(batch)
        starts = attn_metadata.query_start_loc_cpu[: batch + 1].tolist()
        rejected = [0] * batch if num_rejected is None else num_rejected[:batch].tolist()
        total = starts[-1]
        hidden = aux_hidden[:total]  # [T, Hc]: the head combines the rows it runs (EagleDrafting.catch_up)
        positions = positions[:total].clone()  # vLLM reuses its buffer; backlogs keep views
        shifted = token_ids[:total].clone()  # [T]: row i's committed next token ...
        shifted[:-1] = token_ids[1:total]
        rows, requests, last, next_tokens = [], [], [], next_token_ids[:batch].tolist()
        for b, req_id in enumerate(req_ids):
            start, end = starts[b], starts[b + 1] - rejected[b]
            if end <= start:
                continue
            if discarded[b]:  # partial prefill: vLLM's next token is a placeholder
                next_tokens[b] = self.state.token_at(req_id, int(positions[end - 1]) + 1)
            rows.append(b)
            last.append(end - 1)
            requests.append(Committed(req_id, shifted[start:end], positions[start:end], hidden[start:end]))
        shifted[last] = torch.tensor([next_tokens[b] for b in rows], dtype=shifted.dtype)  # ... vLLM's next token last
        return rows, requests

    def _use_quantized_weights(self, target_model):
        """The section's "head_weights" (int8 or int4): the EAGLE-3 head's linears with
        quantized weights, from its checkpoint (quantized_layers.use_quantized_weights); where
        they cannot run, as loaded."""
        from specplug.common import formats

        head_dir, fmt = self.draft_model_config.model, self.specplug.head_weights
        head_linears.use_head_weights(self.head_runner.KIND, fmt, lambda: use_quantized_weights(
            self.model, formats.load_head(head_dir).state_dict, fmt, target_model), head_dir, "specplug", logger)

    def _log_active(self):
        tree, stage = self.specplug.tree, self.specplug.stage
        logger.info("specplug %s proposer active for head %s: dynamic tree topk=%d depth=%d, stage %s (%s)",
                    self.head_runner.KIND, self.draft_model_config.model, tree.topk, tree.depth, stage,
                    f"the whole tree of {tree.budget} nodes is verified in one target pass" if stage == "tree" else
                    f"the tree's best path of {self.num_speculative_tokens} tokens is verified as a chain")
