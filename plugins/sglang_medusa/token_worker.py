"""The worker of every registered token drafter in SGLang 0.5.23 (RETRIEVAL, specplug's
retrieval drafter, and any drafter a plugin registers: --speculative-algorithm NAME).

Before each decode step the drafter's copy of every request is brought to the tokens
SGLang committed (prompt + output, `TokenDrafter.sync`: appends what is new, forgets
what SGLang discarded, such as a retracted request's recomputation), and it drafts one
tree per request (specplug.common.token_drafters). The trees differ per request and
from step to step: n = 1 + the most draft nodes any request has (<= budget + 1,
SGLang's speculative_num_draft_tokens); a step where no request has a draft verifies
the roots alone, an ordinary decode step through the verify path. No hidden states are
captured. A finished request is freed (retrieval: its tokens join the cache of recent
requests); SGLang's flush_cache clears what the drafter keeps across requests.
"""

from __future__ import annotations

import logging

import torch.nn.functional as F
from sglang.srt.arg_groups.overrides import resolving_view

from specplug.common import drafter_registry
from specplug.common.head_section import payoff_flag
from specplug.common.drafting.engine_layers import EngineTarget
from specplug.common.drafting.session import stale_requests
from specplug.common.token_drafters import draft_or_roots
from specplug.common.tree import TreeBatch
from specplug.sglang_medusa import batch_view as view
from specplug.sglang_medusa.settings import TokenDrafterSettings, token_settings
from specplug.common.sglang_trees import ROOT_ONLY, batch_layout
from specplug.sglang_medusa.tree_worker import TreeVerifyWorker

logger = logging.getLogger(__name__)


class SyncedTokenDrafter:
    """A token drafter kept in step with SGLang's requests: before drafting, each
    request's copy is synced to SGLang's committed tokens; requests SGLang never reported
    finished (e.g. aborted) are dropped past `max_live`. Shared by TokenDrafterWorker and
    the hybrid drafting of eagle_worker.Eagle3Worker."""

    def __init__(self, drafter, max_live: int):
        self.drafter, self.max_live = drafter, max_live

    def draft(self, batch, **overrides) -> TreeBatch:
        """Each request's tree, rooted at its last committed token (the drafter's
        overrides: budget, max_depth, min_prob); roots alone if the drafter raises."""
        self.sync(batch)
        return draft_or_roots(self.drafter, view.request_ids(batch), view.last_tokens(batch),
                              **overrides)  # candidates [B, n]

    def sync(self, batch) -> None:
        """Each request's copy brought to SGLang's committed tokens (prompt + output)."""
        for req in view.requests(batch):
            self.drafter.sync(view.request_id(req), view.prompt_ids(req), view.output_ids(req))
        self._forget_stale(view.request_ids(batch))

    def free(self, rid) -> None:
        self.drafter.free(rid)

    def clear(self) -> None:
        for rid in list(self.drafter.live):
            self.drafter.free(rid)
        self.drafter.clear_cache()

    def _forget_stale(self, rids: list) -> None:
        """Bound the live requests (stale_requests; one that comes back is synced from
        SGLang's tokens again)."""
        for rid in stale_requests(self.drafter.live, rids, self.max_live):
            self.drafter.free(rid)


def synced_drafter(choice, cfg, model_runner) -> SyncedTokenDrafter:
    """The registered drafter `choice` built for a worker of server arguments `cfg`,
    bound to the target `model_runner` loaded (self_spec drafts with its layers)."""
    drafter = drafter_registry.build(choice, view.vocab_size(model_runner))
    drafter_registry.bind_target(drafter, engine_target(model_runner))
    return SyncedTokenDrafter(drafter, view.max_live(cfg))


def engine_target(model_runner) -> EngineTarget:
    """SGLang's loaded target as drafting.engine_layers sees it; logits from its LM head
    weight (SGLang's LogitsProcessor needs a ForwardBatch; under tensor parallelism the
    whole weight, batch_view.whole_vocab), and SGLang's all-reduce for the row-parallel
    layers it reduces at its layer boundaries."""
    return EngineTarget(view.target_model(model_runner),  # the whole weight is gathered at the first call only
                        lambda hidden: F.linear(hidden, view.lm_head_weight(model_runner)),
                        view.target_config(model_runner), view.tp_all_reduce())


class TokenDrafterWorker(TreeVerifyWorker):
    """A token drafter's drafts, lossless tree verification; SGLang builds it with the
    scheduler's worker arguments (see TreeVerifyWorker). The drafter is the registered
    one named by --speculative-algorithm (lower case)."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        cfg = resolving_view(server_args)
        name = str(cfg.speculative_algorithm).lower()
        self.settings: TokenDrafterSettings = token_settings(name, cfg)
        super().__init__(server_args, target_worker, self.settings.num_nodes)
        self.token_drafts = synced_drafter(self.settings.choice, cfg, self.model_runner)
        self._start_payoff(self.settings.max_depth, payoff_flag())
        logger.info("%s worker: drafter %s, up to %d draft nodes, depth %d, lossless verification",
                    name.upper(), type(self.drafter).__name__, self.settings.budget, self.settings.max_depth)

    @property
    def drafter(self):
        return self.token_drafts.drafter

    def clear_cache_pool(self):
        self.token_drafts.clear()

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self.token_drafts.free(rid)

    def _draft(self, batch) -> tuple[TreeBatch, dict]:
        """Each request's tree, rooted at its last committed token."""
        tree = self.token_drafts.draft(batch)
        if tree.candidates.shape[1] == 1:
            return tree, ROOT_ONLY
        return tree, batch_layout(tree)
