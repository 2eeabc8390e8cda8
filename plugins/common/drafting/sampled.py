"""Sampled drafting for every model-backed drafter: trees drawn from the draft
distribution q instead of top-k, carrying q per node for lossless rejection sampling."""

from __future__ import annotations

from typing import Hashable

import torch

from .. import dynamic_trees
from ..tree import TreeBatch, TreeConfig


ENV_DRAFT_TEMPERATURE = "SPECPLUG_DRAFT_TEMPERATURE"  # overrides a head section's "draft_temperature"


class SampledDrafts:
    """Sampled drafting for a model-backed drafter: trees drawn i.i.d. from
    q = softmax(draft log-probs / temperature) (specplug.common.dynamic_trees.sampled), with
    TreeBatch.draft_probs = q, to verify with method "rejection". ``temperature`` None
    turns it off (deterministic top-k trees). ``seed`` gives each request a generator
    seeded at prefill, so a request's drafts reproduce whatever its batch mates."""

    def __init__(self, temperature: float | None = None, seed: int | None = None):
        if temperature is not None and not temperature > 0:
            raise ValueError(f"temperature must be > 0 for sampled drafts (or None for top-k trees), got {temperature}")
        self.temperature, self.seed = temperature, seed
        self.generators: dict[Hashable, torch.Generator] = {}

    @property
    def on(self) -> bool:
        return self.temperature is not None

    def start(self, request_ids, device) -> None:
        if self.on and self.seed is not None:
            for rid in request_ids:
                self.generators[rid] = torch.Generator(device).manual_seed(self.seed)

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self.generators.pop(rid, None)

    def q(self, logprobs: torch.Tensor) -> torch.Tensor:
        return (logprobs / self.temperature).softmax(-1)

    def draft(self, expand, root_tokens, root_logprobs, tree: TreeConfig, request_ids,
              token_map: torch.Tensor | None = None, vocab_size: int | None = None) -> TreeBatch:
        """The trees of a model-backed drafter, one place for all of them: when on,
        ``tree.topk`` sampled chains of ``tree.depth`` sharing the root (budget unused);
        when off, EAGLE-2 top-k trees (dynamic_trees.dynamic, with ``tree.stop_below``)."""
        if not self.on:
            return dynamic_trees.dynamic(expand, root_tokens, root_logprobs, depth=tree.depth, topk=tree.topk,
                                         budget=tree.budget, token_map=token_map, stop_below=tree.stop_below)
        return dynamic_trees.sampled(lambda f: self.q(expand(f)), root_tokens, self.q(root_logprobs),
                                     depth=tree.depth, width=tree.topk,
                                     generators=[self.generators.get(rid) for rid in request_ids],
                                     token_map=token_map, vocab_size=vocab_size)


def sampled_tree(tree: TreeConfig) -> TreeConfig:
    """The sampled-draft shape within `tree`'s budget: width chains of depth, width * depth
    <= budget (a sampled tree has 1 + width * depth nodes)."""
    depth = min(tree.depth, tree.budget)
    return TreeConfig(depth, max(1, tree.budget // depth), tree.budget)
