"""EAGLE-1/3 drafting state for an engine's live requests, through a `HeadRunner`.

Per request the head's key/value over the committed positions it has seen is kept
densely here (`DraftCache`). Each step the engine hands over what it committed
(`Committed`: the new rows, rejected drafts already cut off); `EagleDrafting.catch_up`
rolls the cache back to the first new position (undoing a rejected step or a
preemption), runs ONE head step over every request's new rows and returns a `Root`
per request, from which `trees` drafts EAGLE-2 dynamic trees (or trees sampled from q).

Invariant: a request's cache holds exactly the head entries of committed positions,
ascending (a gap where a deferred backlog was dropped); drafting never changes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, NamedTuple

import torch

from .. import dynamic_trees
from ..dynamic_trees import Frontier
from ..tree import DraftTree, TreeBatch, TreeConfig, stack_trees
from .runner import HeadRunner, Segment
from .sampled import SampledDrafts
from .session import in_batch_order, stale_requests

MAX_PENDING_ROWS = 512  # a request's deferred rows the head has not seen (adaptive steps without drafts)


class Committed(NamedTuple):
    """One request's rows committed since the head last saw it."""

    req_id: Hashable
    shifted: torch.Tensor  # Long [n]: the committed token after each position; the last = the new root
    positions: torch.Tensor  # Long [n] ascending
    hidden: torch.Tensor  # [n, Hc] the target's states there as captured (catch_up combines them: runner.combine)


class Root(NamedTuple):
    """One request's last committed position, as the head's catch-up step left it."""

    token: int  # the root token (last committed, not yet seen by the target)
    logprobs: torch.Tensor  # [draft_vocab] draft log-probs of the first draft token
    hidden: torch.Tensor  # [H] head pre-norm output: hidden input of the root's children
    position: int  # position of the root's KV entry (the last entry of the cache)
    key: torch.Tensor  # [S, kv_heads, head_dim] committed head KV, root's entry last
    value: torch.Tensor


class DraftCache:
    """Dense head KV for one request: `key`/`value` [length, kv_heads, head_dim] at the
    committed positions `positions` Long [length] (ascending; a gap where a backlog was
    dropped), views into buffers of power-of-two capacity. Appending writes in place;
    a full buffer is copied into one twice its size, so a request's cache is reallocated
    O(log length) times, in a few size classes, instead of copied every step (which left
    the allocator's heap fragmented under load: docs/reliability.md)."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor):
        self._key, self._value, self._positions = key, value, positions  # buffers [capacity, ...]
        self.length = key.shape[0]

    @property
    def key(self) -> torch.Tensor:
        return self._key[:self.length]

    @property
    def value(self) -> torch.Tensor:
        return self._value[:self.length]

    @property
    def positions(self) -> torch.Tensor:
        return self._positions[:self.length]

    @property
    def capacity(self) -> int:
        return self._key.shape[0]

    def truncate(self, position: int) -> None:
        """Keep the entries before `position` (the engine rolled back the rest)."""
        self.length = int(torch.searchsorted(self.positions, position))

    def append(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> None:
        start, end = self.length, self.length + key.shape[0]
        if end > self.capacity:
            self._reserve(end)
        self._key[start:end], self._value[start:end] = key, value
        self._positions[start:end] = positions
        self.length = end

    def _reserve(self, rows: int) -> None:
        """Buffers of the next power of two >= rows (at least 16), the entries copied over."""
        capacity = max(16, 1 << (rows - 1).bit_length())
        self._key, self._value, self._positions = (
            _grown(t, capacity, self.length) for t in (self._key, self._value, self._positions))


def _grown(buffer: torch.Tensor, capacity: int, length: int) -> torch.Tensor:
    """A copy of buffer[:length] at the start of a new buffer of `capacity` rows."""
    out = buffer.new_empty((capacity, *buffer.shape[1:]))
    out[:length] = buffer[:length]
    return out


@dataclass
class Backlog:
    """Committed rows the head has not run yet (steps without drafts): Committed chunks,
    oldest first, at most `cap` rows; when more arrive the oldest are dropped, so an
    idle head costs no head forwards and bounded memory, and its context later skips
    the dropped stretch (drafts stay verified, so this changes acceptance only)."""

    chunks: list = field(default_factory=list)
    rows: int = 0

    def cut(self, position: int) -> None:
        """Drop rows at or past `position` (the engine rolled them back)."""
        while self.chunks and int(self.chunks[-1].positions[0]) >= position:
            self.rows -= self.chunks.pop().positions.shape[0]
        if self.chunks and int(self.chunks[-1].positions[-1]) >= position:
            last = self.chunks[-1]
            keep = last.positions < position
            self.rows -= int((~keep).sum())
            self.chunks[-1] = _rows(last, keep)

    def add(self, chunk: Committed, cap: int) -> None:
        self.chunks.append(chunk)
        self.rows += chunk.positions.shape[0]
        while self.rows > cap:
            over, oldest = self.rows - cap, self.chunks[0]
            if over >= oldest.positions.shape[0]:
                self.chunks.pop(0)
                self.rows -= oldest.positions.shape[0]
            else:
                self.chunks[0] = _rows(oldest, slice(over, None))
                self.rows -= over

    def before(self, request: Committed) -> Committed:
        """`request` with the backlog prepended."""
        self.cut(int(request.positions[0]))
        return _joined(request.req_id, self.chunks + [request])

    def alone(self, req_id) -> Committed | None:
        """The backlog's rows as one Committed, None when it holds none."""
        return _joined(req_id, self.chunks) if self.chunks else None


def _joined(req_id, parts: list[Committed]) -> Committed:
    return Committed(req_id, *(torch.cat([c[i] for c in parts]) for i in (1, 2, 3)))


def _rows(chunk: Committed, index) -> Committed:
    return Committed(chunk.req_id, chunk.shifted[index], chunk.positions[index], chunk.hidden[index])


class EagleDrafting:
    """Head caches, deferred rows and tree drafting for an engine's live requests."""

    def __init__(self, runner: HeadRunner, max_pending_rows: int | None = None):
        self.runner = runner
        self.max_pending_rows = MAX_PENDING_ROWS if max_pending_rows is None else max_pending_rows
        self.caches: dict[Hashable, DraftCache] = {}
        self.pending: dict[Hashable, Backlog] = {}

    def catch_up(self, requests: list[Committed]) -> list[Root]:
        """Roll each request's cache back to its first new position (what the engine
        rejected), run ONE head step over all newly committed rows (deferred ones first;
        input i pairs shifted[i] with the combined state of hidden i), append the new KV;
        a Root per request. The states are combined here, once for all rows, so rows that
        wait (defer) and are dropped or never drafted from cost no head compute."""
        requests = [self._with_pending(r) for r in requests]
        segments, offset = [], 0
        for request in requests:
            cache = self.cache(request.req_id)
            cache.truncate(int(request.positions[0]))
            n, past = request.positions.shape[0], cache.length
            mask = torch.ones(n, past + n, dtype=torch.bool).tril(diagonal=past)
            segments.append(Segment(slice(offset, offset + n), cache.key, cache.value, mask))
            offset += n
        last_rows = torch.tensor([seg.rows.stop - 1 for seg in segments])  # each request's root row
        hidden = self.runner.combine(torch.cat([r.hidden for r in requests]))  # [T, H]
        step = self.runner.step(torch.cat([r.shifted for r in requests]), hidden,
                                torch.cat([r.positions for r in requests]), segments, logit_rows=last_rows)
        roots = []
        for i, (request, seg) in enumerate(zip(requests, segments)):
            cache = self.caches[request.req_id]
            cache.append(step.key[seg.rows], step.value[seg.rows], request.positions)
            roots.append(Root(int(request.shifted[-1]), step.logprobs[i], step.hidden[seg.rows.stop - 1],
                              int(request.positions[-1]), cache.key, cache.value))
        return roots

    def catch_up_deferred(self, request_ids) -> dict[Hashable, Root]:
        """A Root per request of `request_ids` that has deferred rows, from one head step
        over those rows (catch_up with nothing new); the others are left as they are."""
        requests = [self.pending.pop(r).alone(r) for r in request_ids if r in self.pending]
        requests = [r for r in requests if r is not None]
        return dict(zip((r.req_id for r in requests), self.catch_up(requests))) if requests else {}

    def defer(self, requests: list[Committed]) -> None:
        """Keep the committed rows for the next catch-up (the newest max_pending_rows
        per request: Backlog), as copies: an engine may reuse the buffers they view."""
        for request in requests:
            backlog = self.pending.setdefault(request.req_id, Backlog())
            backlog.cut(int(request.positions[0]))
            kept = _rows(request, slice(-self.max_pending_rows, None))
            backlog.add(kept._replace(hidden=kept.hidden.clone()), self.max_pending_rows)

    def trees(self, roots: list[Root], tree: TreeConfig, sampled: SampledDrafts | None = None,
              request_ids=()) -> TreeBatch:
        """EAGLE-2 dynamic trees (`tree`'s depth, topk, budget, stop_below) from each root,
        or, with `sampled` on, trees drawn from q; a node at depth d runs at position
        root.position + d and attends to its request's cache plus its ancestors."""
        expand = TreeExpander(self.runner, roots)
        token_map = self.runner.token_map
        device = roots[0].logprobs.device
        root_tokens = torch.tensor([r.token for r in roots], device=device)
        root_logprobs = torch.stack([r.logprobs for r in roots])  # [B, draft_vocab]
        if sampled is not None and sampled.on:
            return sampled.draft(expand, root_tokens, root_logprobs, tree, request_ids, token_map=token_map,
                                 vocab_size=getattr(self.runner, "vocab_size", None))
        return dynamic_trees.dynamic(expand, root_tokens, root_logprobs, depth=tree.depth, topk=tree.topk,
                                     budget=tree.budget, token_map=token_map, stop_below=tree.stop_below)

    def cache(self, req_id) -> DraftCache:
        if req_id not in self.caches:
            empty = self.runner.empty_kv()
            self.caches[req_id] = DraftCache(empty, empty, torch.zeros(0, dtype=torch.long))
        return self.caches[req_id]

    def length(self, req_id) -> int:
        """Head entries a request holds (0 when unknown)."""
        cache = self.caches.get(req_id)
        return 0 if cache is None else cache.length

    def free(self, request_ids) -> None:
        for req_id in request_ids:
            self.caches.pop(req_id, None)
            self.pending.pop(req_id, None)

    def forget(self, live) -> None:
        """Free every request not in `live` (the engine finished or dropped it)."""
        self.free([r for r in list(self.caches) + list(self.pending) if r not in live])

    def _with_pending(self, request: Committed) -> Committed:
        backlog = self.pending.pop(request.req_id, None)
        return request if backlog is None else backlog.before(request)


class TreeExpander:
    """The `expand` callback of dynamic_trees.dynamic / dynamic_trees.sampled for one draft: one head step
    per frontier over every request's frontier nodes, each attending to its request's
    committed cache plus the frontier nodes drafted so far (kept here, in call order)."""

    def __init__(self, runner: HeadRunner, roots: list[Root]):
        self.runner, self.roots = runner, roots
        self.tree_kv = [(r.key[:0], r.value[:0]) for r in roots]  # frontier KV, in call order
        self.hidden = [r.hidden[None] for r in roots]  # [F_prev, H] the previous call's outputs

    def __call__(self, front: Frontier) -> torch.Tensor:
        """-> draft log-probs [B, F, draft_vocab] of the token after each frontier node."""
        batch, width = front.tokens.shape  # [B, F]
        segments = []
        for b, root in enumerate(self.roots):
            tree_key, tree_value = self.tree_kv[b]
            context = root.key.shape[0] - 1  # committed entries before the root's
            mask = torch.cat([front.expanded_mask[b].new_ones(width, context),
                              front.expanded_mask[b]], dim=1)  # [F, S + E - 1]
            segments.append(Segment(slice(b * width, (b + 1) * width), torch.cat([root.key, tree_key]),
                                    torch.cat([root.value, tree_value]), mask))
        parent_hidden = torch.cat([self.hidden[b][front.parent_slot[b]] for b in range(batch)])  # [B*F, H]
        root_positions = torch.tensor([r.position for r in self.roots], device=front.positions.device)
        positions = (root_positions[:, None] + front.positions).flatten()
        step = self.runner.step(front.tokens.flatten(), parent_hidden, positions, segments)
        for b in range(batch):
            rows = slice(b * width, (b + 1) * width)
            tree_key, tree_value = self.tree_kv[b]
            self.tree_kv[b] = (torch.cat([tree_key, step.key[rows]]), torch.cat([tree_value, step.value[rows]]))
            self.hidden[b] = step.hidden[rows]
        return step.logprobs.view(batch, width, -1)  # [B, F, draft_vocab]


class HeldRoots:
    """Each request's Root from its last catch-up, for an engine that catches the head up
    right after verification and drafts from it at the next step (SGLang). After a step
    without drafts the rows wait (`defer`); the next step that drafts catches them up
    first (`in_step`), so steps without drafts run no head.

    Invariant: a held Root is drafted from only while it is in step with the engine: the
    same root token, at position seq_len - 1. A retraction, or a commit whose states were
    not captured, breaks that; the request then verifies its root alone until its next
    catch-up. Requests the engine never reports finished are dropped past `max_live`
    (session.stale_requests)."""

    def __init__(self, drafting: EagleDrafting, max_live: int):
        self.drafting, self.max_live = drafting, max_live
        self.roots: dict[Hashable, Root] = {}

    def catch_up(self, requests: list[Committed]) -> None:
        with torch.inference_mode():
            self.roots.update(zip((r.req_id for r in requests), self.drafting.catch_up(requests)))

    def defer(self, requests: list[Committed]) -> None:
        """Keep a step's committed rows for the next catch-up (EagleDrafting.defer); the
        held Roots are out of step until then."""
        self.drafting.defer(requests)

    def committed(self, requests: list[Committed], drafted: bool) -> None:
        """A verify step's committed rows: caught up now after a step that drafted, else
        deferred (steps without drafts tend to follow each other, and run no head)."""
        if drafted:
            self.catch_up(requests)
        else:
            self.defer(requests)

    def in_step(self, request_ids, tokens, seq_lens) -> list[Root | None]:
        """Per request: its held Root, caught up over its deferred rows first, where in
        step with the engine's root token and sequence length, else None."""
        with torch.inference_mode():
            self.roots.update(self.drafting.catch_up_deferred(request_ids))
        held = [self.roots.get(rid) for rid in request_ids]
        return [r if r is not None and r.token == t and r.position == s - 1 else None
                for r, t, s in zip(held, tokens, seq_lens)]

    def free(self, request_ids) -> None:
        self.drafting.free(request_ids)
        for rid in request_ids:
            self.roots.pop(rid, None)

    def clear(self) -> None:
        self.drafting.forget(())
        self.roots.clear()

    def forget_stale(self, current) -> None:
        """Free the requests not in `current` (a decode batch: every running request)
        once more than max_live are held."""
        self.free(stale_requests(self.roots, current, self.max_live))


# -- an engine's batches as Committed rows, and a step's trees from held Roots ----------------


def prefill_rows(request_ids, known_tokens, spans, sampled, states: torch.Tensor) -> list[Committed]:
    """Each request's prefill chunk (spans: (first position, n) per request) as Committed
    rows: positions start .. start + n - 1, each paired with the token after it in the
    request's known tokens (prompt + output), the last chunk's last with its `sampled`
    token; states [sum n, Hc] in request order."""
    requests, offset = [], 0
    for rid, known, (start, n), token in zip(request_ids, known_tokens, spans, sampled):
        after = list(known[start + 1:start + n]) + [known[start + n] if start + n < len(known) else token]
        requests.append(Committed(rid, torch.tensor(after), torch.arange(start, start + n),
                                  states[offset:offset + n]))  # the head combines them at its catch-up
        offset += n
    return requests


def accepted_rows(request_ids, candidates: torch.Tensor, verdict, seq_lens, states: torch.Tensor) -> list[Committed]:
    """A verify step's accepted path per request as Committed rows: its m nodes at positions
    seq_len .. seq_len + m - 1, each paired with the token emitted after it (the next
    accepted node's, then the bonus). candidates [B, n]; states [B * n, Hc], every node's."""
    bs, n = candidates.shape
    emitted = verdict.output_tokens(candidates.to(verdict.accepted_nodes.device))  # [B, D+1]
    accepted = verdict.num_accepted.tolist()
    rows = torch.cat([b * n + verdict.accepted_nodes[b, :accepted[b] + 1] for b in range(bs)])
    accepted_states = states[rows.to(states.device)]  # [sum m, Hc]
    requests, offset = [], 0
    for b, rid in enumerate(request_ids):
        m = accepted[b] + 1
        requests.append(Committed(rid, emitted[b, :m].cpu(), torch.arange(seq_lens[b], seq_lens[b] + m),
                                  accepted_states[offset:offset + m]))
        offset += m
    return requests


def held_trees(held: HeldRoots, session, request_ids, tokens, seq_lens, params, tree: TreeConfig,
               sampled_tree: TreeConfig, sync_tokens) -> TreeBatch:
    """One tree per request from its held Root (HeldRoots.in_step), as `session` (a
    DraftingSession) decides per request within tree.budget; a request out of step verifies
    its root `tokens[i]` alone. sync_tokens() brings a token drafter to the engine's tokens."""
    roots = held.in_step(request_ids, tokens, seq_lens)
    rows = [i for i, r in enumerate(roots) if r is not None]
    stale = [i for i, r in enumerate(roots) if r is None]
    parts = [(stale, stack_trees([_root_only(tokens[i]) for i in stale]))] if stale else []
    if rows:
        if session.token_drafter is not None:
            sync_tokens()
        with torch.inference_mode():
            parts.append((rows, session.trees([roots[i] for i in rows], [request_ids[i] for i in rows],
                                              [params[i] for i in rows], tree, sampled_tree, budget=tree.budget)))
    return parts[0][1] if len(parts) == 1 else in_batch_order(parts, len(request_ids))


def _root_only(token: int) -> DraftTree:
    return DraftTree(torch.tensor([int(token)]), torch.tensor([-1]), torch.zeros(1))  # score 0 = log 1: mergeable


def serving_head(path, target_config, device, dtype, embedding, lm_head, head_weights: str, who: str, log):
    """The EAGLE-3 or EAGLE-1 head at `path` for serving, without autograd: where it has no
    embedding, the target's (`embedding()`: [vocab', H], sliced to the head's vocab, never
    copied); an EAGLE-1 head scores with the target's LM head (`lm_head()`, likewise); its
    linears with "head_weights" int8 / int4 weights where they can run (quantization.
    head_linears; `who` and `log` name it). ValueError for any other kind of head."""
    from specplug.common.formats import load_head_module
    from specplug.common.quantization import head_linears

    head = load_head_module(path, target_config=target_config, device=device, dtype=dtype).eval()
    head.requires_grad_(False)  # serving: no autograd graph behind the states the head keeps
    if getattr(head, "KIND", None) not in ("EAGLE-3", "EAGLE-1"):
        raise ValueError(f"{who}: {path} holds a {type(head).__name__}, not an EAGLE-3 or EAGLE-1 head: serve "
                         "Medusa heads with their own algorithm (MEDUSA)")
    vocab = head.config.vocab_size
    if not hasattr(head, "embed_tokens"):
        head.set_target_embedding(torch.nn.Embedding.from_pretrained(embedding()[:vocab], freeze=True))
    if head.KIND == "EAGLE-1":
        linear = torch.nn.Linear(head.config.hidden_size, vocab, bias=False, device="meta")
        linear.weight = torch.nn.Parameter(lm_head()[:vocab], requires_grad=False)
        head.set_target_lm_head(linear)
    if head_weights != "float":  # an EAGLE-3 head's linears after fc
        head_linears.use_head_weights(head.KIND, head_weights, lambda: head_linears.swap_linears(
            head, head_linears.EAGLE3_MODULES, head_weights), str(path), who, log)
    return head
