"""Stage "tree": vLLM verifies a whole draft tree in one target pass (V1 runner, CPU).

The scheduler is untouched: the proposer hands vLLM a tree's N non-root nodes as N draft
tokens (parents precede children, so any prefix vLLM keeps is still a tree) and records
the topology here. `TreeVerifier` hooks the runner through RunnerState: after
`_prepare_inputs` it plans the step and gives the tree rows positions ctx + depth (the slot
mapping stays the chain's); after `_build_attention_metadata` it attaches the trees to
every CPU attention metadata object (tree_attention.py masks those rows); the sampler
verifies with `parents_for` and calls `accept`, which moves each accepted node's KV to its
chain slot in every layer and keeps the row order for the drafter (`committed_order`), so
the drafter and the rest of vLLM see an ordinary chain.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from specplug.common.paged_tree_attention import TreeRows, compaction_moves, scheduled_parents, tree_rows
from specplug.common.tree import TreeBatch, is_chain, tree_depths
from specplug.vllm_eagle3 import paged_kv
from specplug.vllm_eagle3.runner_state import RunnerState

logger = logging.getLogger(__name__)


def needs_chain(params) -> bool:
    """Whether a request (vllm.SamplingParams, or None for a pooling or unknown request)
    must be drafted as a chain: vLLM applies its grammar bitmask to the rows of a chain
    of drafts. Every other rule specplug applies per tree node."""
    return params is None or params.structured_outputs is not None


@dataclass
class TreeStep:
    """One engine step's trees (only built when at least one request verifies a tree)."""

    parents: list[torch.Tensor]  # per batch row, Long [n_b + 1] (chains for non-tree requests)
    root_rows: list[int]  # per batch row, token row of its root
    trees: list[TreeRows]  # the requests whose tree is not a chain
    layer_slots: dict[str, torch.Tensor] = field(default_factory=dict)  # layer -> slot mapping [T]


class TreeVerifier:
    """Per-engine stage-"tree" state: recorded trees, the current step's plan, the compaction."""

    def __init__(self, state: RunnerState):
        self.state = state
        self._drafted: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # req -> (tokens, parents) [N + 1]
        self.step: TreeStep | None = None
        self._order: torch.Tensor | None = None  # Long [T] row permutation for the drafter

    # -- hooks ---------------------------------------------------------------------------
    def install(self) -> None:
        """Plan each step after the runner prepares its inputs; attach the plan to the
        attention metadata it builds (RunnerState.wrap_step_inputs)."""
        self.state.wrap_step_inputs(self._plan, self._attach)

    def record(self, req_id: str, tokens: torch.Tensor, parents: torch.Tensor) -> None:
        """The tree handed to vLLM for req_id: tokens / parents Long [N + 1], root first."""
        self._drafted[req_id] = (tokens, parents)

    def hand_over(self, trees: TreeBatch, req_ids, chains: Callable[[list[int]], torch.Tensor]) -> torch.Tensor:
        """Every node of each request's tree as vLLM draft tokens, Long [B, N - 1], its
        topology recorded; the batch rows whose request needs a chain (needs_chain) get
        chains(rows) [len(rows), N - 1] instead, recorded as nothing (= a chain)."""
        drafts = trees.candidates[:, 1:].clone()
        as_chain = [needs_chain(self.state.sampling_params(r)) for r in req_ids]
        chained = [b for b, chain in enumerate(as_chain) if chain]
        if chained:
            drafts[chained] = chains(chained).to(drafts.dtype)
        for b, req_id in enumerate(req_ids):
            if not as_chain[b]:
                self.record(req_id, trees.candidates[b], trees.parents[b])
        return drafts

    # -- step plan -----------------------------------------------------------------------
    def _plan(self, spec_metadata) -> None:
        """The step's TreeStep (or None: no request verifies a non-chain tree), and tree
        positions for its rows."""
        self.step, self._order = None, None
        if spec_metadata is None or not self._drafted:
            return
        num_reqs = len(spec_metadata.num_draft_tokens)
        req_ids = self.state.request_ids(num_reqs)
        drafted = {r: self._drafted.pop(r) for r in req_ids if r in self._drafted}  # consumed now
        self._drafted = {r: d for r, d in self._drafted.items() if r in self.state.live}  # unscheduled, live
        ends = self.state.query_ends(num_reqs)
        drafts = spec_metadata.draft_token_ids.cpu().split(spec_metadata.num_draft_tokens)
        parents, root_rows, trees = [], [], []
        for b, (req_id, n) in enumerate(zip(req_ids, spec_metadata.num_draft_tokens)):
            parents.append(scheduled_parents(drafted.get(req_id), drafts[b]))
            root_rows.append(ends[b] - n - 1)
            if not is_chain(parents[-1]):
                trees.append(self._tree_rows(b, root_rows[-1], parents[-1]))
        if trees:
            self.step = TreeStep(parents, root_rows, trees)

    def _tree_rows(self, batch_row: int, root_row: int, parents: torch.Tensor) -> TreeRows:
        """Tree positions for the request's rows; its TreeRows for the attention."""
        positions = self.state.positions  # [max tokens], chain positions from _prepare_inputs
        rows = slice(root_row, root_row + parents.shape[0])
        positions[rows] = positions[root_row] + tree_depths(parents).to(positions.dtype)
        return tree_rows(batch_row, root_row, parents)

    def _attach(self, attn_metadata) -> None:
        """The step's trees onto every CPU attention metadata object (no step: nothing)."""
        if self.step is None:
            return
        if not isinstance(attn_metadata, dict):
            raise RuntimeError("specplug stage \"tree\" does not support micro-batching (ubatch): "
                               "use stage \"chain\" (SPECPLUG_STAGE=chain)")
        for layer_name, metadata in attn_metadata.items():
            if hasattr(metadata, "block_table") and hasattr(metadata, "slot_mapping"):
                metadata.specplug_tree = self.step.trees
                self.step.layer_slots[layer_name] = metadata.slot_mapping

    # -- verification and compaction ------------------------------------------------------
    def parents_for(self, num_draft_tokens: list[int]) -> list[torch.Tensor] | None:
        """The step's tree topology per batch row (Long [n_b + 1]), or None: all chains."""
        if self.step is None:
            return None
        if [p.shape[0] - 1 for p in self.step.parents] != list(num_draft_tokens):
            raise RuntimeError("specplug stage \"tree\": the sampler's draft counts differ from the "
                               "step's plan; this vLLM version is not supported")
        return self.step.parents

    def accept(self, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """After verification: move the accepted path (accepted_nodes Long [B, D + 1],
        num_accepted Long [B]) to the chain slots ctx+1..ctx+a in every layer's KV, and
        keep the matching row order for the drafter. Ends the step."""
        step, self.step = self.step, None
        if step is None:
            return
        src, dst = compaction_moves(step.trees, accepted_nodes, num_accepted)
        if src.numel() == 0:
            return
        self._copy_kv(step.layer_slots, src, dst)
        total = self.state.query_ends(len(step.parents))[-1]
        self._order = torch.arange(total)
        self._order[dst] = src

    def _copy_kv(self, layer_slots: dict[str, torch.Tensor], src_rows, dst_rows) -> None:
        for layer_name, slots in layer_slots.items():
            layer = self.state.attention_layer(layer_name)
            paged_kv.copy_slots(layer.kv_cache, layer.isa, slots[src_rows].long(), slots[dst_rows].long())

    def committed_order(self, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The drafter's inputs (token ids [T], positions [T], aux hidden [T, 3H], ...) with each
        tree request's accepted nodes moved to rows root+1..root+a (identity without a move)."""
        if self._order is None:
            return rows
        order, self._order = self._order, None
        return tuple(_reorder(x, order) for x in rows)

    def committed_samples(self, hidden: torch.Tensor, sample_hidden: torch.Tensor, spec_metadata) -> torch.Tensor:
        """vLLM's sample_hidden_states (hidden [T, H] at the step's logits indices) with each
        tree request's accepted nodes in chain order, so the runner's "last accepted row"
        is the accepted node's (unchanged without a move)."""
        if self._order is None:  # set by accept(), in a step that had spec metadata
            return sample_hidden
        order, self._order = self._order, None  # covers every token row, so every logits index
        return hidden[order.to(hidden.device)[spec_metadata.logits_indices]]  # rows committed_order would give


def _reorder(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x [T, ...] with its first len(order) rows taken in `order` (a copy)."""
    out = x.clone()
    out[: order.shape[0]] = x[order.to(x.device)]
    return out
