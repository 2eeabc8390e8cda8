"""The worker of every registered token drafter (RETRIEVAL and the drafters plugins register:
--speculative-algorithm NAME): before each decode step the drafter's copy of every request
is synced to SGLang's committed tokens (TokenDrafter.sync), then it drafts one tree per
request; a step where no request has a draft verifies the roots alone. No hidden states
are captured.
"""

from __future__ import annotations

import logging

import torch.nn.functional as F
from sglang.srt.arg_groups.overrides import resolving_view

from specplug.common import drafter_registry
from specplug.common.head_section import payoff_flag
from specplug.common.drafting.engine_layers import EngineTarget
from specplug.common.drafting.session import SyncedTokenDrafter
from specplug.common.tree import TreeBatch
from specplug.sglang_medusa import batch_view as view
from specplug.sglang_medusa.settings import token_settings
from specplug.common.sglang_trees import ROOT_ONLY, batch_layout
from specplug.sglang_medusa.tree_worker import TreeVerifyWorker

logger = logging.getLogger(__name__)


def synced_drafter(choice, cfg, model_runner) -> SyncedTokenDrafter:
    """The registered drafter `choice` built for a worker of server arguments `cfg`,
    bound to the target `model_runner` loaded (self_spec drafts with its layers)."""
    drafter = drafter_registry.build(choice, view.vocab_size(model_runner))
    drafter_registry.bind_target(drafter, engine_target(model_runner))
    return SyncedTokenDrafter(drafter, view.max_live(cfg))


def engine_target(model_runner) -> EngineTarget:
    """SGLang's loaded target as drafting.engine_layers sees it: logits from its whole LM head
    weight (batch_view.whole_vocab), SGLang's all-reduce for its row-parallel layers."""
    return EngineTarget(view.target_model(model_runner),  # the whole weight is gathered at the first call only
                        lambda hidden: F.linear(hidden, view.lm_head_weight(model_runner)),
                        view.target_config(model_runner), view.tp_all_reduce())


class TokenDrafterWorker(TreeVerifyWorker):
    """The trees of the registered drafter --speculative-algorithm names (lower case), verified
    losslessly; SGLang builds it with the scheduler's worker arguments (see TreeVerifyWorker)."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        cfg = resolving_view(server_args)
        name = str(cfg.speculative_algorithm).lower()
        self.settings: drafter_registry.TokenDrafterSettings = token_settings(name, cfg)
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
        tree = self.token_drafts.draft(view.committed_tokens(batch), view.last_tokens(batch))  # candidates [B, n]
        return tree, ROOT_ONLY if tree.candidates.shape[1] == 1 else batch_layout(tree)
