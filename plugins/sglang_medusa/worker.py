"""The MEDUSA worker (tree_worker.TreeVerifyWorker's step): MedusaDrafter turns each
request's last target hidden state (the prefill captures the last one, each verify pass
every node's; the drafter keeps the last accepted node's) into the static tree, one shared
topology. The core decides the rest, as in vLLM: per request, chains drawn from the heads'
q (DraftingSession, sampled drafts) or the static tree merged with the token drafter's
(hybrid); adaptive speculation's tree, or none, per step (policy.adaptive).
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from specplug.common.drafters import MedusaDrafter
from specplug.common.drafting.medusa import MedusaDrafting
from specplug.common.formats import load_head_module
from specplug.common.head_section import HeadSettings
from specplug.common.sglang_trees import ROOT_ONLY, batch_layout, root_only_batch, tree_layout
from specplug.common.tree import TreeBatch
from specplug.sglang_medusa import batch_view as view
from specplug.sglang_medusa.settings import medusa_settings
from specplug.sglang_medusa.token_worker import synced_drafter
from specplug.sglang_medusa.tree_worker import TreeVerifyWorker

logger = logging.getLogger(__name__)


class MedusaWorker(TreeVerifyWorker):
    """MEDUSA heads over the target's hidden states; SGLang builds it with the
    scheduler's worker arguments (see TreeVerifyWorker)."""

    prefill_capture = CaptureHiddenMode.LAST
    verify_capture = CaptureHiddenMode.FULL

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        cfg = resolving_view(server_args)  # server_args plus what resolution declared
        super().__init__(server_args, target_worker, int(cfg.speculative_num_draft_tokens))
        self.heads_path = str(cfg.speculative_draft_model_path)
        self.settings: HeadSettings = medusa_settings(
            cfg, adaptive_arg=bool(getattr(server_args, "speculative_adaptive", False)))
        self.method = self.settings.verification.rule
        self.typical_epsilon = self.settings.verification.typical_epsilon
        self.typical_delta = self.settings.verification.typical_delta
        heads = load_head_module(self.heads_path, target_config=server_args.model_path, device=self.device,
                                 dtype=view.target_dtype(self.model_runner)).eval()
        self.drafter = MedusaDrafter(heads, choices=self.settings.medusa.choices,
                                     head_accuracies=self.settings.medusa.head_accuracies)
        if self.settings.drafter is not None:
            self.token_drafts = synced_drafter(self.settings.drafter, cfg, self.model_runner)
        self.medusa = MedusaDrafting(self.drafter, self.settings, self.num_nodes, ranks=self.ranks,
                                     token_drafter=None if self.token_drafts is None else self.token_drafts.drafter)
        self.session = self.medusa.session
        self._layouts = {config: tree_layout(t, self.device) for config, t in self.medusa.templates.items()}
        self.times_verify = self.medusa.adaptive is not None
        if self.medusa.adaptive is None:
            self._start_payoff(self.medusa.template.max_depth, self.settings.payoff)
        logger.info("MEDUSA worker: %d heads, %d-node tree (depth %d), %s verification%s",
                    self.drafter.heads.num_heads, self.num_nodes, self.medusa.template.max_depth,
                    self.settings.verification.method,
                    "" if self.token_drafts is None else f", merged with drafter {self.settings.drafter.name!r}")

    def clear_cache_pool(self):
        self.drafter.release(list(self.drafter.hidden))
        self._free_token_drafts()

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self.drafter.release([rid])
        self._free_token_drafts(rid)

    def _draft(self, batch) -> tuple[TreeBatch, dict]:
        """The core's trees (MedusaDrafting.draft) rooted at each request's last committed token."""
        roots = torch.tensor(view.last_tokens(batch), dtype=torch.long)
        tree, shared = self.medusa.draft(view.request_ids(batch), roots, view.request_sampling(batch),
                                         lambda: self.token_drafts.sync(view.committed_tokens(batch)), self._elapsed)
        if tree is None:
            return root_only_batch(roots), ROOT_ONLY
        return tree, batch_layout(tree) if shared is None else self._layouts[shared]

    def _verified(self, tree, verdict, seconds) -> None:
        self.medusa.verified(tree, verdict.num_accepted, seconds)

    def _prefilled(self, batch, result) -> None:
        """Remember each request's last hidden state [B, H] and first token."""
        hidden = result.logits_output.hidden_states
        if hidden is not None:
            rids = view.request_ids(batch)
            self.drafter.prefill(rids, [None] * len(rids), hidden[:, None], result.next_token_ids)

    def _commit(self, batch, tree: TreeBatch, verdict, hidden: torch.Tensor) -> None:
        """Keep the hidden state of each request's last accepted node ([B*N, H] -> [B, H])."""
        bs, n = tree.candidates.shape
        last_node = verdict.accepted_nodes.gather(1, verdict.num_accepted.long()[:, None])[:, 0]
        rows = torch.arange(bs, device=hidden.device) * n + last_node.to(hidden.device)
        accepted_tokens = [tree.candidates[b, verdict.accepted_nodes[b, 1:int(verdict.num_accepted[b]) + 1]]
                           for b in range(bs)]
        self.drafter.commit(view.request_ids(batch), accepted_tokens, hidden[rows][:, None],
                            verdict.bonus_token)
