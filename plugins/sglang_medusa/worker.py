"""The MEDUSA speculative worker for SGLang 0.5.23 (synchronous V2 scheduler schema).

The step is specplug.sglang_medusa.tree_worker.TreeVerifyWorker's; MEDUSA drafts:
MedusaDrafter turns each request's last target hidden state (kept from the previous
step: the prefill captures the LAST hidden state, each verify pass every node's) into
a static candidate tree (specplug.common.tree), one shared topology; after a verify
the drafter keeps the hidden state of the last accepted node.

Sampled drafts (the heads' "draft_temperature" or SPECPLUG_DRAFT_TEMPERATURE): a request
that samples without a seed gets chains drawn from the heads' q at that temperature
(MedusaDrafter.draft_sampled), verified with q; greedy and seeded requests keep the
static tree (the core's DraftingSession decides, per request, as in vLLM).

Adaptive speculation (settings.adaptive): before each decode step
specplug.common.policy.adaptive.AdaptiveController picks a tree from a family of budgets (the
optimal sparse trees for the heads' accuracies, or chains of 1..depth) or none, from
verify-pass timings by tokens in the batch, heads timings by batch, and the verify
results. A smaller tree uses the first n of the KV slots SGLang reserved, and "none"
verifies the root alone (n = 1, no heads pass): an ordinary decode step through the
verify path.

Hybrid drafting (the heads' "retrieval" / "drafter", SPECPLUG_RETRIEVAL / SPECPLUG_DRAFTER):
each drafted static tree is merged with the token drafter's tree of the same root under
the static tree's node count (specplug.common.merge, on the heads' path scores), so a
step's trees differ per request; drafts drawn from q and root-only steps are not merged.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from specplug.common.policy.adaptive import AdaptiveController, pinned_costs, tree_family, tree_option
from specplug.common.drafters import MedusaDrafter, prior_accuracies
from specplug.common.drafting.sampled import SampledDrafts, sampled_tree
from specplug.common.drafting.session import DraftingSession, in_batch_order
from specplug.common.head_section import HeadSettings
from specplug.common.tree import DraftTree, TreeBatch, TreeConfig
from specplug.sglang_medusa import batch_view as view
from specplug.sglang_medusa.settings import medusa_settings, verify_method
from specplug.sglang_medusa.token_worker import synced_drafter
from specplug.common.sglang_trees import ROOT_ONLY, batch_layout, root_only_batch, tree_layout
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
        self.method = verify_method(self.settings)
        self.typical_epsilon = self.settings.verification.typical_epsilon
        self.typical_delta = self.settings.verification.typical_delta
        self.drafter = MedusaDrafter(self._load_heads(), choices=self.settings.medusa.choices,
                                     head_accuracies=self.settings.medusa.head_accuracies)
        self.template: DraftTree = self.drafter.template(self.settings.tree)
        if self.template.num_nodes != self.num_nodes:
            raise ValueError(
                f"MEDUSA tree has {self.template.num_nodes} nodes but speculative_num_draft_tokens is "
                f"{self.num_nodes}: leave --speculative-num-draft-tokens unset or give the tree's node count")
        self._layout = tree_layout(self.template, self.device)
        self.sampled_tree = sampled_tree(TreeConfig(min(self.settings.tree.depth, self.drafter.heads.num_heads),
                                                    self.settings.tree.topk, self.num_nodes - 1))
        self.adaptive: AdaptiveController | None = None
        self._option = None  # the adaptive option of the step in flight
        self._budgets: dict = {}  # SpecOption -> (TreeConfig, layout)
        if self.settings.adaptive:
            self._start_adaptive()
        else:
            self._start_payoff(self.template.max_depth, self.settings.payoff)
        if self.settings.drafter is not None:
            self.token_drafts = synced_drafter(self.settings.drafter, cfg, self.model_runner)
        self.session = DraftingSession(
            None, token_drafter=None if self.token_drafts is None else self.token_drafts.drafter,
            sampled=SampledDrafts(self.settings.draft_temperature))
        logger.info("MEDUSA worker: %d heads, %d-node tree (depth %d), %s verification%s",
                    self.drafter.heads.num_heads, self.num_nodes, self.template.max_depth,
                    self.settings.verification.method,
                    "" if self.token_drafts is None else f", merged with drafter {self.settings.drafter.name!r}")

    # ------------------------------------------------------------------ set-up

    def _load_heads(self):
        from specplug.common.formats import load_head_module

        dtype = view.target_dtype(self.model_runner)
        return load_head_module(self.heads_path, target_config=self.server_args.model_path,
                                device=self.device, dtype=dtype).eval()

    def _start_adaptive(self) -> None:
        """The controller over this worker's budget family (see budget_configs)."""
        accuracies = self.settings.medusa.head_accuracies
        if accuracies is None:
            accuracies = prior_accuracies(self.drafter.heads.num_heads, self.settings.tree.topk)
        for config in budget_configs(self.settings):
            template = self.drafter.template(config)
            self._budgets[tree_option(template, accuracies)] = (config, tree_layout(template, self.device))
        self.adaptive = AdaptiveController(list(self._budgets), ranks=self.ranks)
        self.times_verify = True
        self.adaptive.costs_override = pinned_costs(os.environ)
        logger.info("MEDUSA adaptive speculation on: each step verifies one of the trees with %s draft nodes, "
                    "or none, as specplug.common.policy.adaptive chooses from costs measured in this engine%s",
                    [o.nodes for o in self.adaptive.options],
                    " (cost curves pinned by SPECPLUG_ADAPTIVE_COSTS)" if self.adaptive.costs_override else "")

    def clear_cache_pool(self):
        self.drafter.release(list(self.drafter.hidden))
        self._free_token_drafts()

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self.drafter.release([rid])
        self._free_token_drafts(rid)

    # ------------------------------------------------------------------ drafting

    def _draft(self, batch) -> tuple[TreeBatch, dict]:
        """(candidates [B, N] from the heads, the trees' layout); the root is the request's
        last committed token. Which request drafts how is the core's DraftingSession's
        decision: with sampled drafts on, a request that samples without a seed gets
        chains drawn from the heads' q; the others the static tree (merged with the token
        drafter's when hybrid). Adaptive steps draft the chosen option's tree for every
        request, or (None) the root alone without running the heads."""
        self.session.begin_step()
        rids = view.request_ids(batch)
        roots = torch.tensor(view.last_tokens(batch), dtype=torch.long)
        option = self._option = None if self.adaptive is None else self.adaptive.choose(len(rids))
        if self.adaptive is not None and option is None:
            return root_only_batch(roots), ROOT_ONLY
        drawn, top_k = ([], list(range(len(rids)))) if option is not None else self.session.split(
            view.request_sampling(batch))
        if not drawn:
            return self._static_trees(batch, rids, roots, option)
        parts = [(drawn, self._drawn_trees([rids[i] for i in drawn]))]
        if top_k:
            parts.append((top_k, self._static_trees(batch, [rids[i] for i in top_k], roots[top_k], None)[0]))
        tree = parts[0][1] if len(parts) == 1 else in_batch_order(parts, len(rids))
        tree.candidates[:, 0] = roots.to(tree.candidates.device)
        return tree, batch_layout(tree)

    def _drawn_trees(self, rids) -> TreeBatch:
        """Chains drawn from the heads' q for requests `rids`, recorded for the verify."""
        tree = self.drafter.draft_sampled(rids, self.sampled_tree, self.session.sampled)
        self.session.record.draw(rids, tree)
        return tree

    def _static_trees(self, batch, rids, roots: torch.Tensor, option) -> tuple[TreeBatch, dict]:
        """The static (or the adaptive option's) tree for requests `rids` with these
        roots, merged with the token drafter's when hybrid; and its layout."""
        config, layout = (self.settings.tree, self._layout) if option is None else self._budgets[option]
        started = time.perf_counter()
        tree = self.drafter.draft(rids, config)
        if option is not None:
            self.adaptive.draft_timed(len(rids), option, self._elapsed(started))
        tree.candidates[:, 0] = roots.to(tree.candidates.device)
        if self.token_drafts is None:
            return tree, layout
        self.token_drafts.sync(batch)
        merged = self.session.merged(tree, rids, self.template.max_depth, tree.candidates.shape[1] - 1)
        return merged, batch_layout(merged)

    def _verified(self, tree, verdict, seconds) -> None:
        if self.adaptive is not None:
            self.adaptive.verify_timed(tree.candidates.numel(), seconds)
            if self._option is not None:
                self.adaptive.accepted(self._option, verdict.num_accepted)

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


def budget_configs(settings: HeadSettings) -> list[TreeConfig]:
    """The trees adaptive speculation chooses among (each as the TreeConfig the drafter
    builds it from): the core's family for the configured tree
    (specplug.common.policy.adaptive.tree_family); explicit choices offer only themselves."""
    return [settings.tree] if settings.medusa.choices is not None else tree_family(settings.tree)
