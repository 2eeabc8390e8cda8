"""Stateful, engine-free drafters: per-request draft state on top of a head, producing
draft trees for the verifier. Shared by the reference loop and the engine adapters.

A drafter speaks one protocol (all calls batched over `request_ids`):

  target_hidden_layers(L)  which Hugging Face `hidden_states` entries of an L-layer
                           target it needs, concatenated on the last dim ("Hc" below)
  prefill(ids, prompt_ids, hidden, first_tokens)
                           prompt_ids[b] Long [n_b], hidden[b] [n_b, Hc] (the target's
                           states over the prompt), first_tokens Long [B] (the token the
                           target sampled after the prompt: the first tree root)
  draft(ids, tree)         -> TreeBatch of trees rooted at each request's last committed
                           token (tokens are target-vocab ids; draft_probs are None:
                           drafting is deterministic top-k, so verify with the
                           target-only rule)
  commit(ids, accepted_tokens, hidden, bonus)
                           accepted_tokens[b] Long [m_b] (draft tokens accepted, root
                           excluded), hidden[b] [m_b + 1, Hc] (the target's states at the
                           root and the accepted nodes), bonus Long [B] (the new root)
  release(ids)             forget requests

Invariant: between calls a request's state describes exactly the committed tokens;
draft() never changes it, so a rejected tree leaves nothing behind.
"""

from __future__ import annotations

import logging
from typing import Hashable, Protocol, Sequence

import torch

from . import static_trees
from . import tree as tree_lib
from .drafting.eagle import Committed, EagleDrafting, Root
from .drafting.runner import TorchHeadRunner
from .drafting.sampled import SampledDrafts
from .heads import Eagle1Head, Eagle3Head, MedusaHeads
from .tree import TreeBatch, TreeConfig

logger = logging.getLogger(__name__)


class Drafter(Protocol):
    def target_hidden_layers(self, num_target_layers: int) -> tuple[int, ...]: ...
    def prefill(self, request_ids, prompt_ids, hidden, first_tokens) -> None: ...
    def draft(self, request_ids, tree: TreeConfig) -> TreeBatch: ...
    def commit(self, request_ids, accepted_tokens, hidden, bonus) -> None: ...
    def release(self, request_ids) -> None: ...


def _check_batch(request_ids: Sequence[Hashable], **lists) -> None:
    for name, value in lists.items():
        if len(value) != len(request_ids):
            raise ValueError(
                f"{name} has {len(value)} entries for {len(request_ids)} request_ids: "
                "pass one entry per request, in request_ids order"
            )


def _shifted(tokens, last_tokens, start: int) -> list[torch.Tensor]:
    """Per request: tokens[b][start:] followed by last_tokens[b] (Long, on CPU): the
    token AFTER each position whose target hidden state is given."""
    last = torch.as_tensor(last_tokens).long().cpu()
    return [torch.cat([torch.as_tensor(t).long().cpu()[start:], last[b:b + 1]]) for b, t in enumerate(tokens)]


# --------------------------------------------------------------------------- EAGLE (1 and 3)


class Eagle3Drafter:
    """EAGLE drafting for the reference loop and training evaluation: EAGLE-2 dynamic
    trees or chains (or trees sampled from q) for an Eagle3Head or an Eagle1Head, through
    the same engine-free state the engine adapters use (drafting.eagle.EagleDrafting) and
    specplug's own modules (drafting.runner.TorchHeadRunner).

    commit() runs the head on the accepted path with the TARGET's hidden states (as
    EAGLE and vLLM do), so the committed cache never holds draft-fed entries.
    """

    def __init__(self, head: Eagle3Head | Eagle1Head, *, aux_layer_ids: Sequence[int] | None = None,
                 temperature: float | None = None, seed: int | None = None):
        self.head = head.eval()
        self.aux_layer_ids = None if aux_layer_ids is None else tuple(aux_layer_ids)
        self.runner = TorchHeadRunner(self.head)
        self.drafting = EagleDrafting(self.runner)
        self.roots: dict[Hashable, Root] = {}  # each request's last catch-up
        self.sampled = SampledDrafts(temperature, seed)
        self.token_map = self.runner.token_map  # [draft_vocab] target id of each draft id

    def target_hidden_layers(self, num_target_layers: int) -> tuple[int, ...]:
        if self.aux_layer_ids is not None:
            return self.aux_layer_ids
        return self.head.config.resolved_aux_layer_ids(num_target_layers)

    # -- committing ------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, request_ids, prompt_ids, hidden, first_tokens) -> None:
        _check_batch(request_ids, prompt_ids=prompt_ids, hidden=hidden, first_tokens=first_tokens)
        self.drafting.free(request_ids)
        self.sampled.start(request_ids, self.runner.device)
        self._extend(request_ids, _shifted(prompt_ids, first_tokens, start=1), hidden)

    @torch.no_grad()
    def commit(self, request_ids, accepted_tokens, hidden, bonus) -> None:
        _check_batch(request_ids, accepted_tokens=accepted_tokens, hidden=hidden, bonus=bonus)
        self._extend(request_ids, _shifted(accepted_tokens, bonus, start=0), hidden)

    def release(self, request_ids) -> None:
        self.drafting.free(request_ids)
        for rid in request_ids:
            self.roots.pop(rid, None)
        self.sampled.release(request_ids)

    def _extend(self, request_ids, next_tokens, aux_hidden) -> None:
        """Run the head on (next_tokens[b][i], target aux state i) pairs at the positions
        after each request's committed cache (one batched step), and keep the roots."""
        for b, (t, h) in enumerate(zip(next_tokens, aux_hidden)):
            if h.shape[0] != t.shape[0]:
                raise ValueError(
                    f"request {request_ids[b]!r}: hidden has {h.shape[0]} rows but {t.shape[0]} next "
                    "tokens were given: pass the target's states at the root and every accepted node"
                )
        states = torch.cat([h.to(self.runner.device) for h in aux_hidden])  # [sum n, Hc]: catch_up combines them
        committed, offset = [], 0
        for rid, tokens in zip(request_ids, next_tokens):
            n, start = tokens.shape[0], self.drafting.length(rid)
            positions = torch.arange(start, start + n)
            committed.append(Committed(rid, tokens.to(self.runner.device), positions, states[offset:offset + n]))
            offset += n
        self.roots.update(zip(request_ids, self.drafting.catch_up(committed)))

    # -- drafting --------------------------------------------------------------------
    @torch.no_grad()
    def draft(self, request_ids, tree: TreeConfig = TreeConfig()) -> TreeBatch:
        """EAGLE-2 dynamic trees (depth, topk, budget from `tree`) rooted at each request's
        last committed token, or trees sampled from q (see SampledDrafts). Leaves the
        committed state untouched."""
        missing = [rid for rid in request_ids if rid not in self.roots]
        if missing:
            raise ValueError(f"requests {missing} have no draft state: call prefill() for them first")
        return self.drafting.trees([self.roots[rid] for rid in request_ids], tree, self.sampled, request_ids)

    def draft_chain(self, request_ids, k: int) -> TreeBatch:
        """A greedy chain of k draft tokens (a dynamic tree with topk 1)."""
        return self.draft(request_ids, TreeConfig(depth=k, topk=1, budget=k))


EagleDrafter = Eagle3Drafter  # the name that says it drives EAGLE-1 heads too


# --------------------------------------------------------------------------- Medusa


def prior_accuracies(num_heads: int, topk: int) -> torch.Tensor:
    """A stand-in [heads, topk] accuracy table for trees before any measurement:
    head h's rank-r token is right with probability 0.6 * 0.75**h * 0.5**r (roughly
    Medusa-1 on Vicuna-7B). Replace it with measured `head_accuracies`."""
    h = torch.arange(num_heads, dtype=torch.float64)[:, None]
    r = torch.arange(topk, dtype=torch.float64)[None, :]
    return 0.6 * 0.75 ** h * 0.5 ** r


class MedusaDrafter:
    """Medusa drafting: each head's top-k candidates fill a static tree. The tree is
    `choices` when given; else, per TreeConfig, a chain (topk 1) or Medusa's optimal
    sparse tree for `head_accuracies` ([heads, topk], measured; a prior otherwise)."""

    def __init__(self, heads: MedusaHeads, *, choices: Sequence[Sequence[int]] | None = None,
                 head_accuracies=None):
        self.heads = heads.eval()
        self.choices = None if choices is None else [list(c) for c in choices]
        self.head_accuracies = (None if head_accuracies is None
                                else torch.as_tensor(head_accuracies, dtype=torch.float64))
        self.hidden: dict[Hashable, torch.Tensor] = {}  # [H] target's last hidden state
        self.root_tokens: dict[Hashable, int] = {}
        self._templates: dict[TreeConfig, tree_lib.DraftTree] = {}

    def target_hidden_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target's final-norm output: Hugging Face's hidden_states[L]."""
        return (num_target_layers,)

    def prefill(self, request_ids, prompt_ids, hidden, first_tokens) -> None:
        _check_batch(request_ids, prompt_ids=prompt_ids, hidden=hidden, first_tokens=first_tokens)
        self._remember(request_ids, hidden, first_tokens)

    def commit(self, request_ids, accepted_tokens, hidden, bonus) -> None:
        _check_batch(request_ids, accepted_tokens=accepted_tokens, hidden=hidden, bonus=bonus)
        self._remember(request_ids, hidden, bonus)

    def _remember(self, request_ids, hidden, roots) -> None:
        for b, rid in enumerate(request_ids):
            self.hidden[rid] = hidden[b][-1]
            self.root_tokens[rid] = int(roots[b])

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self.hidden.pop(rid, None)
            self.root_tokens.pop(rid, None)

    @torch.no_grad()
    def draft(self, request_ids, tree: TreeConfig = TreeConfig()) -> TreeBatch:
        logits = self._head_logits(request_ids)  # [K, B, V]
        roots = torch.tensor([self.root_tokens[rid] for rid in request_ids], device=logits.device)
        return self.fill(logits, roots, tree)

    @torch.no_grad()
    def logits_from(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every head's logits [K, B, V] for hidden Float [B, H] (each request's last target
        hidden state): the stateless path for engines that hand it over every step."""
        return self.heads(hidden[:, None])[:, :, 0]

    def fill(self, logits: torch.Tensor, roots: torch.Tensor, tree: TreeConfig) -> TreeBatch:
        """The static tree for `tree` under roots Long [B], filled with each head's top-k of
        logits [K, B, V]; scores [B, N] the template's path_scores (the same for every request)."""
        template = self.template(tree)
        topk = int(template.tokens.max()) + 1
        head_tokens = logits.topk(topk, dim=-1).indices.transpose(0, 1)  # [B, K, topk]
        candidates = static_trees.fill_static(template, roots.to(head_tokens.device), head_tokens)  # [B, N]
        parents = template.parents.to(candidates.device).expand_as(candidates).clone()
        num_nodes = torch.full((candidates.shape[0],), template.num_nodes, dtype=torch.long, device=candidates.device)
        scores = template.scores.to(candidates.device).expand(candidates.shape).clone()  # [B, N]
        return TreeBatch(candidates, parents, num_nodes, scores)

    @torch.no_grad()
    def draft_sampled(self, request_ids, tree: TreeConfig, sampled) -> TreeBatch:
        """`tree.topk` chains of min(tree.depth, heads) tokens sharing the root, drawn from
        the heads' q (`sampled`: an on SampledDrafts), with TreeBatch.draft_probs = q per
        node. A Medusa head sees no drafted token, so every node at depth d is drawn from
        head d-1's q whatever its parent: verified with that q, lossless."""
        logprobs = self._head_logits(request_ids).float().log_softmax(-1)  # [K, B, V]
        depth = min(tree.depth, self.heads.num_heads)

        def expand(front):  # the next depth's head for every frontier node: [B, F, V]
            return logprobs[front.depth][:, None].expand(-1, front.tokens.shape[1], -1)

        roots = torch.tensor([self.root_tokens[rid] for rid in request_ids], device=logprobs.device)
        return sampled.draft(expand, roots, logprobs[0], TreeConfig(depth, tree.topk, depth * tree.topk),
                             request_ids)

    def _head_logits(self, request_ids) -> torch.Tensor:
        """Every head's logits for each request's last hidden state, [K, B, V]."""
        missing = [rid for rid in request_ids if rid not in self.hidden]
        if missing:
            raise ValueError(f"requests {missing} have no Medusa state: call prefill() for them first")
        return self.logits_from(torch.stack([self.hidden[rid] for rid in request_ids]))  # hidden [B, H]

    def draft_chain(self, request_ids, k: int) -> TreeBatch:
        """Head 0..k-1's top-1 tokens as a chain (k <= number of heads)."""
        return self.draft(request_ids, TreeConfig(depth=k, topk=1, budget=k))

    def template(self, tree: TreeConfig) -> tree_lib.DraftTree:
        """The static tree (tokens = top-k ranks, scores = path_scores) for `tree`, cached
        per TreeConfig."""
        if tree not in self._templates:
            template = self._build_template(tree)
            self._templates[tree] = tree_lib.DraftTree(template.tokens, template.parents, self.path_scores(template))
        return self._templates[tree]

    def path_scores(self, template: tree_lib.DraftTree) -> torch.Tensor:
        """Float [N]: log estimated acceptance of each node's path, the sum over it of
        log accuracy[head, rank] (head_accuracies, else the prior; a rank past the table's
        last column counts as that column). What merging with other drafters' trees ranks."""
        ranks = int(template.tokens.max()) + 1
        acc = (self.head_accuracies if self.head_accuracies is not None
               else prior_accuracies(self.heads.num_heads, ranks))
        depth = template.depth
        node = acc[(depth - 1).clamp(min=0), template.tokens.clamp(max=acc.shape[1] - 1)].log().float()  # [N]
        node[0] = 0.0
        return tree_lib.path_reduce(node, template.parents, torch.add)

    def _build_template(self, tree: TreeConfig) -> tree_lib.DraftTree:
        num_heads = self.heads.num_heads
        if self.choices is not None:
            return static_trees.from_choices(self.choices)
        depth = min(tree.depth, num_heads)
        if tree.topk == 1:
            if tree.depth > num_heads:
                logger.info("chain of %d asked from %d Medusa heads: drafting %d", tree.depth, num_heads, depth)
            return static_trees.from_choices([[0] * d for d in range(1, depth + 1)])
        acc = self.head_accuracies if self.head_accuracies is not None else prior_accuracies(num_heads, tree.topk)
        template, expected = static_trees.optimal_sparse(acc[:depth, : tree.topk], tree.budget)
        logger.info("Medusa sparse tree: %d nodes, expected acceptance length %.2f (%s accuracies)",
                    template.num_nodes, expected, "measured" if self.head_accuracies is not None else "prior")
        return template
