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
from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence

import torch

from . import tree as tree_lib
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


def _stack_padded(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad [n_b, ...] tensors to [B, max n, ...]; also return valid Bool [B, max n]."""
    n = max(r.shape[0] for r in rows)
    out = rows[0].new_zeros((len(rows), n, *rows[0].shape[1:]))
    valid = torch.zeros(len(rows), n, dtype=torch.bool, device=rows[0].device)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
        valid[b, : r.shape[0]] = True
    return out, valid


class SampledDrafts:
    """Sampled drafting for a model-backed drafter: trees drawn i.i.d. from
    q = softmax(draft log-probs / temperature) (specplug.common.tree.sampled), with
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
        when off, EAGLE-2 top-k trees (tree.dynamic, with ``tree.stop_below``)."""
        if not self.on:
            return tree_lib.dynamic(expand, root_tokens, root_logprobs, depth=tree.depth, topk=tree.topk,
                                    budget=tree.budget, token_map=token_map, stop_below=tree.stop_below)
        return tree_lib.sampled(lambda f: self.q(expand(f)), root_tokens, self.q(root_logprobs),
                                depth=tree.depth, width=tree.topk,
                                generators=[self.generators.get(rid) for rid in request_ids],
                                token_map=token_map, vocab_size=vocab_size)


# --------------------------------------------------------------------------- EAGLE (1 and 3)


@dataclass
class _Eagle3State:
    """One request's committed draft state. k, v [kv_heads, S, D] hold the draft KV of
    positions 0..S-1 (entry i pairs target state i with token i+1), so S is the root's
    position; hidden [H] and logprobs [draft_vocab] are the last entry's outputs, i.e.
    the root's draft state and the draft distribution of the token after the root."""

    k: torch.Tensor
    v: torch.Tensor
    hidden: torch.Tensor
    logprobs: torch.Tensor
    root_token: int

    @property
    def length(self) -> int:
        return self.k.shape[1]


class Eagle3Drafter:
    """EAGLE drafting: EAGLE-2 dynamic trees (via specplug.common.tree.dynamic) or chains,
    for an Eagle3Head or an Eagle1Head (same interface: combine, forward, compute_logits,
    to_target_ids, config.draft_vocab_size, config.resolved_aux_layer_ids).

    The draft KV cache is small and dense, owned here per request. Tree drafting runs
    the head on each frontier with tree attention over the committed cache plus the
    frontier nodes drafted so far, in a scratch copy; commit() re-runs the head on the
    accepted path with the TARGET's hidden states (as EAGLE and vLLM do), so the
    committed cache never holds draft-fed entries.
    """

    def __init__(self, head: Eagle3Head | Eagle1Head, *, aux_layer_ids: Sequence[int] | None = None,
                 temperature: float | None = None, seed: int | None = None):
        self.head = head.eval()
        self.aux_layer_ids = None if aux_layer_ids is None else tuple(aux_layer_ids)
        self.states: dict[Hashable, _Eagle3State] = {}
        self.sampled = SampledDrafts(temperature, seed)
        # [draft_vocab] target id of each draft id
        self.token_map = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=head.fc.weight.device))

    def target_hidden_layers(self, num_target_layers: int) -> tuple[int, ...]:
        if self.aux_layer_ids is not None:
            return self.aux_layer_ids
        return self.head.config.resolved_aux_layer_ids(num_target_layers)

    # -- committing ------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, request_ids, prompt_ids, hidden, first_tokens) -> None:
        _check_batch(request_ids, prompt_ids=prompt_ids, hidden=hidden, first_tokens=first_tokens)
        for rid in request_ids:
            self.states.pop(rid, None)
        self.sampled.start(request_ids, self.token_map.device)
        self._extend(request_ids, _shifted(prompt_ids, first_tokens, start=1), hidden)

    @torch.no_grad()
    def commit(self, request_ids, accepted_tokens, hidden, bonus) -> None:
        _check_batch(request_ids, accepted_tokens=accepted_tokens, hidden=hidden, bonus=bonus)
        self._extend(request_ids, _shifted(accepted_tokens, bonus, start=0), hidden)

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)
        self.sampled.release(request_ids)

    def _extend(self, request_ids, next_tokens, aux_hidden) -> None:
        """Run the head on (next_tokens[b][i], target aux state i) pairs, causally after each
        request's committed cache, and append the resulting KV."""
        for b, (t, h) in enumerate(zip(next_tokens, aux_hidden)):
            if h.shape[0] != t.shape[0]:
                raise ValueError(
                    f"request {request_ids[b]!r}: hidden has {h.shape[0]} rows but {t.shape[0]} next "
                    "tokens were given: pass the target's states at the root and every accepted node"
                )
        dev = self.head.fc.weight.device
        ids, valid = _stack_padded([t.to(dev) for t in next_tokens])  # [B, T]
        g = self.head.combine(_stack_padded([h.to(dev) for h in aux_hidden])[0])  # [B, T, H]
        past, past_valid, lengths = self._past(request_ids)
        t_len = ids.shape[1]
        causal = torch.ones(t_len, t_len, dtype=torch.bool, device=dev).tril()
        new_cols = causal & valid[:, None, :]  # padded inputs are never attended
        new_cols |= torch.eye(t_len, dtype=torch.bool, device=dev)  # every row attends somewhere
        mask = torch.cat([past_valid[:, None, :].expand(-1, t_len, -1), new_cols], 2)  # [B, T, S+T]
        positions = lengths[:, None] + torch.arange(t_len, device=dev)  # [B, T]
        out = self.head(ids, g, positions, mask, past)
        logprobs = self.head.compute_logits(out.normed).float().log_softmax(-1)  # [B, T, V']
        for b, rid in enumerate(request_ids):
            n, s = int(valid[b].sum()), int(lengths[b])
            prev = self.states.get(rid)
            k_new, v_new = out.kv[0][b, :, :n], out.kv[1][b, :, :n]
            k = k_new if prev is None else torch.cat([prev.k, k_new], 1)
            v = v_new if prev is None else torch.cat([prev.v, v_new], 1)
            assert k.shape[1] == s + n
            self.states[rid] = _Eagle3State(k, v, out.hidden[b, n - 1], logprobs[b, n - 1], int(ids[b, n - 1]))

    def _past(self, request_ids):
        """Batched committed caches: (k, v) [B, kvh, S, D] right-padded (or None when all
        empty), valid Bool [B, S], lengths Long [B]."""
        dev = self.head.fc.weight.device
        states = [self.states.get(rid) for rid in request_ids]
        lengths = torch.tensor([0 if s is None else s.length for s in states], device=dev)
        if int(lengths.max()) == 0:
            return None, torch.zeros(len(states), 0, dtype=torch.bool, device=dev), lengths
        cfg = self.head.config
        empty = torch.zeros(0, cfg.num_key_value_heads, cfg.head_dim, dtype=self.head.fc.weight.dtype, device=dev)
        ks, valid = _stack_padded([empty if s is None else s.k.transpose(0, 1) for s in states])
        vs, _ = _stack_padded([empty if s is None else s.v.transpose(0, 1) for s in states])
        return (ks.transpose(1, 2), vs.transpose(1, 2)), valid, lengths

    # -- drafting --------------------------------------------------------------------
    @torch.no_grad()
    def draft(self, request_ids, tree: TreeConfig = TreeConfig()) -> TreeBatch:
        """EAGLE-2 dynamic trees (depth, topk, budget from `tree`) rooted at each request's
        last committed token, or trees sampled from q (see SampledDrafts). Leaves the
        committed state untouched."""
        states = self._states(request_ids)
        root_tokens = torch.tensor([s.root_token for s in states], device=self.token_map.device)
        root_logprobs = torch.stack([s.logprobs for s in states])  # [B, V']
        expand = _TreeExpander(self, request_ids)
        return self.sampled.draft(expand, root_tokens, root_logprobs, tree, request_ids,
                                  token_map=self.token_map, vocab_size=self.head.config.vocab_size)

    def draft_chain(self, request_ids, k: int) -> TreeBatch:
        """A greedy chain of k draft tokens (a dynamic tree with topk 1)."""
        return self.draft(request_ids, TreeConfig(depth=k, topk=1, budget=k))

    def _states(self, request_ids) -> list[_Eagle3State]:
        missing = [rid for rid in request_ids if rid not in self.states]
        if missing:
            raise ValueError(f"requests {missing} have no draft state: call prefill() for them first")
        return [self.states[rid] for rid in request_ids]


EagleDrafter = Eagle3Drafter  # the name that says it drives EAGLE-1 heads too


class _TreeExpander:
    """The `expand` callback of tree.dynamic for one draft() call: runs the head on each
    frontier with tree attention and keeps the frontier's KV in a scratch cache."""

    def __init__(self, drafter: Eagle3Drafter, request_ids):
        self.head = drafter.head
        self.past, self.past_valid, self.lengths = drafter._past(request_ids)
        states = drafter._states(request_ids)
        self.prev_hidden = torch.stack([s.hidden for s in states])[:, None]  # [B, 1, H] the root's
        self.tree_k: list[torch.Tensor] = []  # per call [B, kvh, F, D]
        self.tree_v: list[torch.Tensor] = []

    def __call__(self, frontier: tree_lib.Frontier) -> torch.Tensor:
        """-> draft log-probs [B, F, draft_vocab] of the token after each frontier node."""
        width = frontier.tokens.shape[1]
        hidden = self.prev_hidden.gather(
            1, frontier.parent_slot[..., None].expand(-1, -1, self.prev_hidden.shape[-1]))  # [B, F, H]
        # Context columns: the committed cache (it ends with the root's own entry).
        ctx = self.past_valid[:, None, :].expand(-1, width, -1)
        mask = torch.cat([ctx, frontier.expanded_mask[:, :, 1:]], 2)  # [B, F, S + depth*F]
        positions = self.lengths[:, None] - 1 + frontier.positions  # draft position = target position - 1
        out = self.head(frontier.tokens, hidden, positions, mask, self._past_with_tree())
        self.tree_k.append(out.kv[0])
        self.tree_v.append(out.kv[1])
        self.prev_hidden = out.hidden
        return self.head.compute_logits(out.normed).float().log_softmax(-1)

    def _past_with_tree(self):
        if not self.tree_k:
            return self.past
        ks = ([] if self.past is None else [self.past[0]]) + self.tree_k
        vs = ([] if self.past is None else [self.past[1]]) + self.tree_v
        return torch.cat(ks, 2), torch.cat(vs, 2)


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
        self.head_accuracies = None if head_accuracies is None else torch.as_tensor(head_accuracies, dtype=torch.float64)
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
        missing = [rid for rid in request_ids if rid not in self.hidden]
        if missing:
            raise ValueError(f"requests {missing} have no Medusa state: call prefill() for them first")
        template = self.template(tree)
        topk = int(template.tokens.max()) + 1
        hidden = torch.stack([self.hidden[rid] for rid in request_ids])[:, None]  # [B, 1, H]
        logits = self.heads(hidden)[:, :, 0]  # [K, B, V]
        head_tokens = logits.topk(topk, dim=-1).indices.transpose(0, 1)  # [B, K, topk]
        roots = torch.tensor([self.root_tokens[rid] for rid in request_ids], device=head_tokens.device)
        candidates = tree_lib.fill_static(template, roots, head_tokens)  # [B, N]
        parents = template.parents.to(candidates.device).expand_as(candidates).clone()
        num_nodes = torch.full((len(request_ids),), template.num_nodes, dtype=torch.long, device=candidates.device)
        return TreeBatch(candidates, parents, num_nodes)

    def draft_chain(self, request_ids, k: int) -> TreeBatch:
        """Head 0..k-1's top-1 tokens as a chain (k <= number of heads)."""
        return self.draft(request_ids, TreeConfig(depth=k, topk=1, budget=k))

    def template(self, tree: TreeConfig) -> tree_lib.DraftTree:
        """The static tree (tokens = top-k ranks) for `tree`, cached per TreeConfig."""
        if tree not in self._templates:
            self._templates[tree] = self._build_template(tree)
        return self._templates[tree]

    def _build_template(self, tree: TreeConfig) -> tree_lib.DraftTree:
        num_heads = self.heads.num_heads
        if self.choices is not None:
            return tree_lib.from_choices(self.choices)
        depth = min(tree.depth, num_heads)
        if tree.topk == 1:
            if tree.depth > num_heads:
                logger.info("chain of %d asked from %d Medusa heads: drafting %d", tree.depth, num_heads, depth)
            return tree_lib.from_choices([[0] * d for d in range(1, depth + 1)])
        acc = self.head_accuracies if self.head_accuracies is not None else prior_accuracies(num_heads, tree.topk)
        template, expected = tree_lib.optimal_sparse(acc[:depth, : tree.topk], tree.budget)
        logger.info("Medusa sparse tree: %d nodes, expected acceptance length %.2f (%s accuracies)",
                    template.num_nodes, expected, "measured" if self.head_accuracies is not None else "prior")
        return template
