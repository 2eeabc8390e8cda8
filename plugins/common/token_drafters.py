"""Token drafters: drafters that read only each request's committed tokens, and the one
way both engines drive them (specplug.common.drafter_registry chooses and builds them).

A token drafter is ONE class registered under a name (the ``specplug_drafters`` hook,
entry-point group ``specplug``); vLLM merges its trees with the EAGLE-3 head's (hybrid
drafting) and SGLang runs it alone as ``--speculative-algorithm NAME`` (upper case).
The engines speak to it through :class:`TokenDrafter` only:

  from_settings(settings, vocab_size)   build (classmethod); settings: a dict of its own
                                        fields, plus "budget" / "max_depth" where the
                                        engine fixes them (SGLang's tree size)
  check_settings(settings)              raise ValueError naming a bad field (classmethod,
                                        called before the model loads)
  prefill(rid, tokens)                  start a request or append a prompt chunk
  extend(rid, tokens)                   append committed tokens (accepted + bonus)
  rollback(rid, length)                 keep the first `length` tokens (rejected drafts,
                                        preemption, a step the engine discarded)
  sync(rid, *parts)                     hold exactly the concatenation of parts
  length(rid), live                     tokens held; the request ids held
  free(rid)                             the request finished (unknown ids: no-op)
  clear_cache()                         forget anything kept across requests
  draft(rids, root_tokens=None, *, budget=None, max_depth=None, min_prob=None)
                                        -> TreeBatch rooted at each request's last
                                        committed token; scores = log of each node's
                                        estimated acceptance probability (root 0,
                                        padding -inf), the scale the hybrid merge ranks
                                        on; draft_probs None (verified with the
                                        target-only rule, so any draft is lossless)
  alone(rids, depth)                    Long [B, depth] chains to verify without running
                                        the head this step, or None (the head drafts)
  continuation(rid, path, k)            optional: up to k tokens continuing the committed
                                        tokens followed by `path` (unverified drafts),
                                        state unchanged; fills the slots past a chain's
                                        path (path_choice.lengthen_chains)
  budget                                nodes drafted when draft() is given no budget
  bind_target(EngineTarget)             optional: a drafter that runs the target's own
                                        layers (self_spec) gets the engine's loaded
                                        model once it has loaded (`bind_target` below)

Invariant: draft() never changes state; between calls a request's state is exactly the
tokens the engine committed. :class:`TokenDrafterBase` keeps that state as plain lists,
so a new drafter writes ``draft`` (and its fields) only.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol

import torch

from .tree import TreeBatch

logger = logging.getLogger(__name__)

ENGINE_FIELDS = ("budget", "max_depth")  # fields an engine may fix for every drafter


class TokenDrafter(Protocol):
    budget: int
    live: Mapping

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], vocab_size: int) -> "TokenDrafter": ...
    @classmethod
    def check_settings(cls, settings: Mapping[str, Any]) -> None: ...
    def prefill(self, request_id: Hashable, tokens) -> None: ...
    def extend(self, request_id: Hashable, tokens) -> None: ...
    def rollback(self, request_id: Hashable, length: int) -> None: ...
    def sync(self, request_id: Hashable, *parts: Sequence[int]) -> None: ...
    def length(self, request_id: Hashable) -> int: ...
    def free(self, request_id: Hashable) -> None: ...
    def clear_cache(self) -> None: ...
    def draft(self, request_ids, root_tokens=None, *, budget=None, max_depth=None, min_prob=None) -> TreeBatch: ...
    def alone(self, request_ids, depth: int) -> torch.Tensor | None: ...


def token_list(tokens) -> list[int]:
    """Tokens (list, tuple, tensor, ndarray) as a list of Python ints >= 0."""
    out = tokens.tolist() if hasattr(tokens, "tolist") else [int(t) for t in tokens]
    out = out if isinstance(out, list) else [out]  # a 0-d tensor / array
    if out and min(out) < 0:
        raise ValueError(f"token ids must be >= 0, got {min(out)}: pass committed token ids")
    return out


def sync_tokens(drafter, request_id: Hashable, parts: Sequence[Sequence[int]], have: int) -> None:
    """Make `drafter`, holding `have` tokens of the request, hold exactly concat(parts), of
    which those are a prefix: roll back what the engine discarded, or prefill only the
    new tokens (slicing only those)."""
    total = sum(len(part) for part in parts)
    if have > total:
        drafter.rollback(request_id, total)
        return
    new, offset = [], 0
    for part in parts:
        if have < offset + len(part):
            new.extend(part[max(0, have - offset):])
        offset += len(part)
    if new:
        drafter.prefill(request_id, new)


def pack_trees(roots: list[int], trees: list[tuple[list[int], list[int], list[float]]]
               ) -> tuple[TreeBatch, torch.Tensor]:
    """Per request (tokens, parents, probs) of its draft nodes (parents index the request's
    nodes, 0 = root) -> right-padded TreeBatch (scores = log probs) and probs Float [B, N]
    (root 1, padding 0)."""
    n = 1 + max((len(t[0]) for t in trees), default=0)
    cand, par, prob = [], [], []
    for root, (tokens, parents, probs) in zip(roots, trees):
        pad = n - 1 - len(tokens)
        cand.append([root] + tokens + [0] * pad)
        par.append([-1] + parents + [-1] * pad)
        prob.append([1.0] + probs + [0.0] * pad)
    probs = torch.tensor(prob, dtype=torch.float32).reshape(len(roots), n)
    longs = torch.tensor([cand, par], dtype=torch.long).reshape(2, len(roots), n)
    num_nodes = torch.tensor([1 + len(t[0]) for t in trees], dtype=torch.long)
    return TreeBatch(longs[0], longs[1], num_nodes, probs.log()), probs


def draft_or_roots(drafter: TokenDrafter, request_ids, root_tokens, **overrides) -> TreeBatch:
    """drafter.draft(...), or every request's root alone when it raises: a drafter's bug
    costs the step its drafts, never the server (logged with its traceback).
    root_tokens: each request's last committed token."""
    try:
        return drafter.draft(request_ids, root_tokens, **overrides)
    except Exception:
        logger.exception("token drafter %s failed; this step runs without its drafts", type(drafter).__name__)
        return pack_trees([int(t) for t in root_tokens], [([], [], [])] * len(request_ids))[0]


class TokenDrafterBase:
    """State of a token drafter as plain token lists (see the module docstring); a
    subclass takes its fields as keyword arguments (with ``budget`` and ``max_depth``)
    and implements ``draft``."""

    def __init__(self, budget: int = 8, max_depth: int = 8):
        for name, value in (("budget", budget), ("max_depth", max_depth)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be an int >= 1, got {value!r}")
        self.budget, self.max_depth = budget, max_depth
        self.live: dict[Hashable, list[int]] = {}

    @classmethod
    def check_settings(cls, settings: Mapping[str, Any]) -> None:
        try:
            inspect.signature(cls).bind(**settings)
        except TypeError as exc:
            raise ValueError(f"drafter {cls.__name__}: {exc}; its fields are "
                             f"{list(inspect.signature(cls).parameters)}") from exc

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], vocab_size: int) -> "TokenDrafterBase":
        cls.check_settings(settings)
        return cls(**settings)

    def prefill(self, request_id: Hashable, tokens) -> None:
        self.live.setdefault(request_id, []).extend(token_list(tokens))

    def extend(self, request_id: Hashable, tokens) -> None:
        self._tokens(request_id).extend(token_list(tokens))

    def rollback(self, request_id: Hashable, length: int) -> None:
        tokens = self._tokens(request_id)
        if not 0 <= length <= len(tokens):
            raise ValueError(f"rollback length must be in [0, {len(tokens)}] for request {request_id!r}, "
                             f"got {length!r}")
        del tokens[length:]

    def sync(self, request_id: Hashable, *parts: Sequence[int]) -> None:
        sync_tokens(self, request_id, parts, len(self.live.get(request_id, ())))

    def length(self, request_id: Hashable) -> int:
        return len(self._tokens(request_id))

    def free(self, request_id: Hashable) -> None:
        self.live.pop(request_id, None)

    def clear_cache(self) -> None:
        pass

    def alone(self, request_ids, depth: int) -> torch.Tensor | None:
        return None

    def draft(self, request_ids, root_tokens=None, *, budget=None, max_depth=None, min_prob=None) -> TreeBatch:
        raise NotImplementedError(f"{type(self).__name__} must implement draft()")

    def _tokens(self, request_id: Hashable) -> list[int]:
        if request_id not in self.live:
            raise ValueError(f"request {request_id!r} has no drafter state: call prefill() for it first")
        return self.live[request_id]

