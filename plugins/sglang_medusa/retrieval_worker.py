"""The RETRIEVAL speculative worker for SGLang 0.5.23: specplug's model-free retrieval
drafter (specplug.common.retrieval.RetrievalDrafter) in SGLang's scheduler.

Before each decode step the drafter's copy of every request is brought to the tokens
SGLang committed (prompt + output, `RetrievalDrafter.sync`: appends what is new, forgets
what SGLang discarded, such as a retracted request's recomputation), and it drafts one
tree per request from the continuations of the request's longest matching suffix. The
trees differ per request and from step to step: n = 1 + the most draft nodes any
request has (<= budget + 1, SGLang's speculative_num_draft_tokens); a step where no
request has a match verifies the roots alone, an ordinary decode step through the
verify path. No hidden states are captured. A finished request's tokens go to the
drafter's bounded cache of recent requests; SGLang's flush_cache clears it.
"""

from __future__ import annotations

import logging

from sglang.srt.arg_groups.overrides import resolving_view

from specplug.common.retrieval import RetrievalDrafter, load_datastore
from specplug.common.tree import TreeBatch
from specplug.sglang_medusa.settings import RetrievalSettings, retrieval_settings_from_server_args
from specplug.sglang_medusa.tree_worker import ROOT_ONLY, TreeVerifyWorker, batch_layout

logger = logging.getLogger(__name__)


class RetrievalWorker(TreeVerifyWorker):
    """Retrieval drafts, lossless tree verification; SGLang builds it with the scheduler's
    worker arguments (see TreeVerifyWorker)."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        cfg = resolving_view(server_args)
        self.settings: RetrievalSettings = retrieval_settings_from_server_args(cfg)
        super().__init__(server_args, target_worker, self.settings.num_nodes)
        store = None
        if self.settings.datastore is not None:
            store = load_datastore(self.settings.datastore, vocab_size=self.model_runner.model_config.vocab_size)
        self.drafter = RetrievalDrafter(self.settings.config, store)
        # requests SGLang never reported finished (e.g. aborted) are dropped beyond this
        self.max_live = 2 * int(cfg.max_running_requests or 48)
        logger.info("RETRIEVAL worker: up to %d draft nodes, depth %d, lossless verification",
                    self.settings.config.budget, self.settings.config.max_depth)

    def clear_cache_pool(self):
        self.drafter.live.clear()
        self.drafter.clear_cache()

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self.drafter.free(rid)

    def _draft(self, batch) -> tuple[TreeBatch, dict]:
        """Each request's retrieval tree, rooted at its last committed token."""
        rids = [req.rid for req in batch.reqs]
        for req in batch.reqs:
            self.drafter.sync(req.rid, req.origin_input_ids, req.output_ids)
        self._forget_stale(rids)
        tree = self.drafter.draft(rids)  # candidates [B, n], scores unused
        if tree.candidates.shape[1] == 1:
            return tree, ROOT_ONLY
        return tree, batch_layout(tree)

    def _forget_stale(self, rids: list) -> None:
        """Bound the live requests: past max_live, those not in this batch are freed (one
        that comes back is synced from SGLang's tokens again)."""
        if len(self.drafter.live) <= self.max_live:
            return
        current = set(rids)
        for rid in [r for r in self.drafter.live if r not in current]:
            self.drafter.free(rid)
