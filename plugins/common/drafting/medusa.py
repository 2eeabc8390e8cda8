"""Medusa heads' drafting per engine step, engine-free: which tree each request gets.

Per step: with adaptive speculation (settings.adaptive) policy.adaptive.AdaptiveController
picks a tree from the budget family (budget_configs) for every request, or none (the roots
alone, no heads pass); otherwise DraftingSession decides per request, as in vLLM: chains
drawn from the heads' q (sampled drafts) for a request that samples without a seed, the
static tree for the others, merged with the token drafter's under the same node count
(hybrid). Drawn and merged trees differ per request; the static and adaptive trees share
one template.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from specplug.common.drafters import MedusaDrafter, prior_accuracies
from specplug.common.drafting.sampled import sampled_tree
from specplug.common.drafting.session import DraftingSession, in_batch_order
from specplug.common.head_section import HeadSettings
from specplug.common.parallel import ALONE, RankGroup
from specplug.common.policy.adaptive import AdaptiveController, pinned_costs, tree_family, tree_option
from specplug.common.tree import DraftTree, TreeBatch, TreeConfig

logger = logging.getLogger(__name__)


def budget_configs(settings: HeadSettings) -> list[TreeConfig]:
    """The trees adaptive speculation chooses among (each as the TreeConfig the drafter
    builds it from): the core's family for the configured tree (policy.adaptive.tree_family);
    explicit choices offer only themselves."""
    return [settings.tree] if settings.medusa.choices is not None else tree_family(settings.tree)


class MedusaDrafting:
    """A MedusaDrafter's trees for an engine that verifies at most `num_nodes` nodes per
    request (root included). `templates` maps each shared template's TreeConfig to its
    DraftTree: the static tree first, then the adaptive budgets."""

    def __init__(self, drafter: MedusaDrafter, settings: HeadSettings, num_nodes: int, *, token_drafter=None,
                 ranks: RankGroup = ALONE, environ: Mapping[str, str] = os.environ):
        self.drafter, self.settings = drafter, settings
        self.template: DraftTree = drafter.template(settings.tree)
        if self.template.num_nodes != num_nodes:
            raise ValueError(
                f"MEDUSA tree has {self.template.num_nodes} nodes but speculative_num_draft_tokens is "
                f"{num_nodes}: leave --speculative-num-draft-tokens unset or give the tree's node count")
        self.sampled_tree = sampled_tree(TreeConfig(min(settings.tree.depth, drafter.heads.num_heads),
                                                    settings.tree.topk, num_nodes - 1))
        self.session = DraftingSession.for_settings(settings, token_drafter=token_drafter, chains=False)
        self.templates: dict = {settings.tree: self.template}
        self.adaptive: AdaptiveController | None = None
        self._budgets: dict = {}  # SpecOption -> TreeConfig
        self._option = None  # the adaptive option of the step in flight
        if settings.adaptive:
            self._start_adaptive(ranks, environ)

    def _start_adaptive(self, ranks: RankGroup, environ: Mapping[str, str]) -> None:
        accuracies = self.settings.medusa.head_accuracies
        if accuracies is None:
            accuracies = prior_accuracies(self.drafter.heads.num_heads, self.settings.tree.topk)
        for config in budget_configs(self.settings):
            template = self.templates.setdefault(config, self.drafter.template(config))
            self._budgets[tree_option(template, accuracies)] = config
        self.adaptive = AdaptiveController(list(self._budgets), ranks=ranks)
        self.adaptive.costs_override = pinned_costs(environ)
        logger.info("MEDUSA adaptive speculation on: each step verifies one of the trees with %s draft nodes, "
                    "or none, as specplug.common.policy.adaptive chooses from costs measured in this engine%s",
                    [o.nodes for o in self.adaptive.options],
                    " (cost curves pinned by SPECPLUG_ADAPTIVE_COSTS)" if self.adaptive.costs_override else "")

    def draft(self, request_ids: Sequence, roots: torch.Tensor, params: Sequence, sync_tokens: Callable[[], None],
              elapsed: Callable[[float], float]) -> tuple[TreeBatch | None, TreeConfig | None]:
        """(the step's trees [B, n] with `roots` [B] in column 0, the TreeConfig of the template
        every request shares, else None); (None, None): the roots alone. params: each request's
        RequestSampling; sync_tokens: brings the token drafter to the engine's tokens;
        elapsed(started): seconds since perf_counter() `started`, the device's work done."""
        self.session.begin_step()
        option = self._option = None if self.adaptive is None else self.adaptive.choose(len(request_ids))
        if self.adaptive is not None and option is None:
            return None, None
        drawn, top_k = ([], list(range(len(request_ids)))) if option is not None else self.session.split(params)
        if not drawn:
            return self._static_trees(request_ids, roots, option, sync_tokens, elapsed)
        parts = [(drawn, self._drawn_trees([request_ids[i] for i in drawn]))]
        if top_k:
            parts.append((top_k, self._static_trees([request_ids[i] for i in top_k], roots[top_k], None,
                                                    sync_tokens, elapsed)[0]))
        tree = parts[0][1] if len(parts) == 1 else in_batch_order(parts, len(request_ids))
        tree.candidates[:, 0] = roots.to(tree.candidates.device)
        return tree, None

    def _drawn_trees(self, request_ids) -> TreeBatch:
        """Chains drawn from the heads' q, recorded for the verify."""
        tree = self.drafter.draft_sampled(request_ids, self.sampled_tree, self.session.sampled)
        self.session.record.draw(request_ids, tree)
        return tree

    def _static_trees(self, request_ids, roots: torch.Tensor, option, sync_tokens, elapsed):
        """The static (or the adaptive option's) tree with these roots, merged with the token
        drafter's when hybrid (then per request: no shared template)."""
        config = self.settings.tree if option is None else self._budgets[option]
        started = time.perf_counter()
        tree = self.drafter.draft(request_ids, config)
        if option is not None:
            self.adaptive.draft_timed(len(request_ids), option, elapsed(started))
        tree.candidates[:, 0] = roots.to(tree.candidates.device)
        if self.session.token_drafter is None:
            return tree, config
        sync_tokens()
        return self.session.merged(tree, request_ids, self.template.max_depth, tree.candidates.shape[1] - 1), None

    def verified(self, tree: TreeBatch, num_accepted: torch.Tensor, seconds: float | None) -> None:
        """A step's result and its verify pass's seconds (adaptive speculation's measurements)."""
        if self.adaptive is not None:
            self.adaptive.verify_timed(tree.candidates.numel(), seconds)
            if self._option is not None:
                self.adaptive.accepted(self._option, num_accepted)
