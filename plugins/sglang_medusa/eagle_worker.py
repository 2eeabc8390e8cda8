"""SPECPLUG_EAGLE3: EAGLE-3 and EAGLE-1 heads with EAGLE-2 dynamic trees in SGLang 0.5.23
(tree_worker.TreeVerifyWorker's step). Drafting is the core's, as in vLLM and the reference
loop (drafting.eagle.EagleDrafting through drafting.runner.TorchHeadRunner; per request
DraftingSession's choice); this worker translates SGLang's batches into `Committed` rows:
each prefill chunk's states paired with the token after each position, each verify's
accepted path paired with the emitted tokens (HeldRoots.committed). The states are
SGLang's CaptureHiddenMode.FULL capture: an EAGLE-3 head's aux layers' inputs
(capture_aux_states), an EAGLE-1 head's the target's final hidden state.

A request whose head state does not match SGLang's (root token or position, e.g. after a
retraction) verifies its root alone until the next catch-up; a prefix SGLang's radix
cache holds is not recomputed, so the head's context starts after it (acceptance only).
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from specplug.common.drafting.eagle import (
    EagleDrafting, HeldRoots, accepted_rows, held_trees, prefill_rows, serving_head,
)
from specplug.common.head_section import HeadSettings
from specplug.common.heads.eagle3 import check_capture_order
from specplug.common.drafting.runner import TorchHeadRunner
from specplug.common.drafting.sampled import sampled_tree
from specplug.common.drafting.session import DraftingSession
from specplug.common.tree import TreeBatch
from specplug.sglang_medusa import batch_view as view
from specplug.sglang_medusa.settings import eagle3_settings
from specplug.sglang_medusa.token_worker import synced_drafter
from specplug.common.sglang_trees import batch_layout
from specplug.sglang_medusa.tree_worker import TreeVerifyWorker

logger = logging.getLogger(__name__)


def capture_aux_states(model, layer_ids) -> None:
    """Make SGLang's Llama-family `model` capture the inputs of layers `layer_ids` (Hugging
    Face's hidden_states[i], specplug's aux convention; SGLang's own
    set_eagle3_layers_to_capture shifts ids by one), concatenated."""
    if not hasattr(model, "capture_aux_hidden_states") or not hasattr(model.model, "layers_to_capture"):
        raise ValueError(f"{type(model).__name__} cannot capture aux hidden states in SGLang 0.5.23: "
                         "SPECPLUG_EAGLE3 needs a Llama-family target")
    ids = [int(i) for i in layer_ids]
    check_capture_order(ids, "SGLang", "SPECPLUG_EAGLE3: the head's config.json")
    model.capture_aux_hidden_states = True
    model.model.layers_to_capture = ids


class Eagle3Worker(TreeVerifyWorker):
    """EAGLE-3 trees over the target's aux hidden states; SGLang builds it with the
    scheduler's worker arguments (see TreeVerifyWorker)."""

    prefill_capture = CaptureHiddenMode.FULL
    verify_capture = CaptureHiddenMode.FULL

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        cfg = resolving_view(server_args)
        super().__init__(server_args, target_worker, int(cfg.speculative_num_draft_tokens))
        self.head_path = str(cfg.speculative_draft_model_path)
        self.settings: HeadSettings = eagle3_settings(cfg)
        runner = self.model_runner
        head = serving_head(self.head_path, server_args.model_path, self.device, view.target_dtype(runner),
                            lambda: view.embedding_weight(runner), lambda: view.lm_head_weight(runner),
                            self.settings.head_weights, "SPECPLUG_EAGLE3", logger)
        self.drafting = EagleDrafting(TorchHeadRunner(head))
        self.roots = HeldRoots(self.drafting, view.max_live(cfg))  # each request's last catch-up
        self.sampled_tree = sampled_tree(self.settings.tree)
        if self.settings.drafter is not None:
            self.token_drafts = synced_drafter(self.settings.drafter, cfg, self.model_runner)
        self.session = DraftingSession.for_settings(
            self.settings, self.drafting, chains=False,
            token_drafter=None if self.token_drafts is None else self.token_drafts.drafter)
        self._start_payoff(self.settings.tree.depth, self.settings.payoff)
        feature = "the target's final hidden state"
        if head.KIND == "EAGLE-3":
            layers = head.config.resolved_aux_layer_ids(view.target_config(self.model_runner).num_hidden_layers)
            capture_aux_states(view.target_model(self.model_runner), layers)
            feature = f"aux layers {list(layers)}"
        logger.info("SPECPLUG_EAGLE3 worker: %s head %s, %s, dynamic trees %s (up to %d nodes)%s, "
                    "lossless verification", head.KIND, self.head_path, feature, self.settings.tree,
                    self.num_nodes, "" if self.token_drafts is None else
                    f", merged with drafter {self.settings.drafter.name!r}")

    def clear_cache_pool(self):
        self.roots.clear()
        self._free_token_drafts()

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self.roots.free([rid])
        self._free_token_drafts(rid)

    def _prefilled(self, batch, result) -> None:
        """Each request's extend tokens paired with the token after each (drafting.eagle.prefill_rows)."""
        aux = result.logits_output.hidden_states  # [sum n, 3 * H_target]
        if aux is None:
            return
        known = [list(view.prompt_ids(req)) + list(view.output_ids(req)) for req in view.requests(batch)]
        self.roots.catch_up(prefill_rows(view.request_ids(batch), known, view.extend_spans(batch),
                                         result.next_token_ids.tolist(), aux))

    def _commit(self, batch, tree: TreeBatch, verdict, hidden: torch.Tensor) -> None:
        """The accepted paths' rows (drafting.eagle.accepted_rows), caught up or deferred."""
        if hidden is None:  # nothing captured: the head keeps its state and these requests verify roots alone
            return
        rids = view.request_ids(batch)
        requests = accepted_rows(rids, tree.candidates, verdict, view.seq_lens(batch).tolist(), hidden)
        self.roots.committed(requests, drafted=self.payoff is None or self.payoff.depth > 0)
        # SGLang reports only requests that finish in a decode step (not one that ends at
        # prefill, an early stop, an abort); a decode batch holds every running request
        self.roots.forget_stale(rids)

    def _draft(self, batch) -> tuple[TreeBatch, dict]:
        """One tree per request from its held root (drafting.eagle.held_trees); [B, n], n <= num_nodes."""
        self.session.begin_step()
        trees = held_trees(self.roots, self.session, view.request_ids(batch), view.last_tokens(batch),
                           view.seq_lens(batch).tolist(), view.request_sampling(batch), self.settings.tree,
                           self.sampled_tree, lambda: self.token_drafts.sync(view.committed_tokens(batch)))
        return trees, batch_layout(trees)
