"""The seam between drafting and a draft network: one head step over the rows of
several requests, each with its own past key/value and attention mask.

`HeadRunner` is what `specplug.common.drafting.eagle` drives. Two implementations:
`TorchHeadRunner` here (specplug's own Eagle3Head / Eagle1Head modules) and the vLLM
adapter's `DenseEagle3Head` (the EAGLE-3 layers vLLM loaded). Both return the same
`DraftStep` for the same inputs, up to the attention kernel's rounding.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

PADDED_ROWS = 1 << 15  # most (requests x longest past + rows) one padded head forward holds


class DraftStep(NamedTuple):
    logprobs: torch.Tensor  # [T or R, draft_vocab] draft log-probs of the NEXT token (see token_map, logit_rows)
    hidden: torch.Tensor  # [T, H] pre-norm output: the `hidden` input of a child step
    key: torch.Tensor  # [T, kv_heads, head_dim] keys of the T inputs (after RoPE; all layers' kv heads)
    value: torch.Tensor  # [T, kv_heads, head_dim]


class Segment(NamedTuple):
    """One request's rows in a batched head step."""

    rows: slice  # its rows among the step's T rows
    past_key: torch.Tensor  # [S, kv_heads, head_dim] what those rows may attend to before them
    past_value: torch.Tensor
    mask: torch.Tensor  # Bool [rows, S + rows]: row t may attend to column j


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One segment's attention: q [T, heads*D]; keys/values [S+T, kv_heads, D]; mask
    Bool [T, S+T] (row t may attend to column j; every row to at least one) -> [T, heads*D].

    Equals scaled_dot_product_attention over keys and values repeated to every query
    head (grouped-query attention: query head h reads kv head h // groups), up to fp32
    rounding. Two batched matmuls per kv head with the groups' queries as rows: for the
    few rows of a head step this is 3-8x faster on a CPU than SDPA with a boolean mask,
    which takes its unfused path, and it never copies the past keys per query head."""
    t, kv_heads, dim = q.shape[0], keys.shape[1], keys.shape[2]
    groups = q.shape[1] // (kv_heads * dim)
    q = q.view(t, kv_heads, groups, dim).permute(1, 0, 2, 3).reshape(kv_heads, t * groups, dim)
    scores = torch.bmm(q, keys.permute(1, 2, 0)).view(kv_heads, t, groups, -1) * scale  # [kvh, T, G, S+T]
    scores = scores.masked_fill(~mask.to(scores.device)[None, :, None], float("-inf"))
    weights = scores.softmax(-1, dtype=torch.float32).to(values.dtype).view(kv_heads, t * groups, -1)
    out = torch.bmm(weights, values.transpose(0, 1))  # [kvh, T*G, D]
    return out.view(kv_heads, t, groups, dim).permute(1, 0, 2, 3).reshape(t, kv_heads * groups * dim)


class HeadRunner(Protocol):
    """An EAGLE head as drafting sees it. Input row i pairs token x_{i+1} with hidden
    h_i (the combined target state for committed positions, the parent's pre-norm
    output inside a draft tree) and predicts x_{i+2}; RoPE uses position i."""

    @property
    def token_map(self) -> torch.Tensor | None:
        """Long [draft_vocab] target id of each draft id, None if identical."""

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[T, Hc] the target's (concatenated aux) states -> [T, H]."""

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             segments: list[Segment], logit_rows: torch.Tensor | None = None) -> DraftStep:
        """tokens [T], hidden [T, H], positions [T]; `segments` cover the rows in order.
        logit_rows Long [R]: only these rows' log-probs (None = all T)."""

    def empty_kv(self) -> torch.Tensor:
        """A [0, kv_heads, head_dim] cache tensor in the head's dtype and device."""


class TorchHeadRunner:
    """HeadRunner over specplug's own Eagle3Head or Eagle1Head (any module with combine,
    forward, compute_logits, to_target_ids and config): consecutive segments are
    right-padded into batched forwards of at most PADDED_ROWS padded rows each, so one
    long request beside many short ones costs its own length, not the batch times it."""

    def __init__(self, head):
        self.head = head.eval()
        config = head.config
        self.num_kv_heads, self.head_dim = config.cache_kv_heads, config.head_dim  # every layer's kv heads
        self.vocab_size = config.vocab_size
        self.device = head.fc.weight.device
        self.token_map = head.to_target_ids(torch.arange(config.draft_vocab_size, device=self.device))

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        return self.head.combine(aux_hidden.to(self.device))

    def empty_kv(self) -> torch.Tensor:
        return self.head.fc.weight.new_zeros(0, self.num_kv_heads, self.head_dim)

    @torch.no_grad()
    def step(self, tokens, hidden, positions, segments, logit_rows=None) -> DraftStep:
        parts, wanted_at = [], []
        for group in _groups(segments):
            start, stop = group[0].rows.start, group[-1].rows.stop
            local = [seg._replace(rows=slice(seg.rows.start - start, seg.rows.stop - start)) for seg in group]
            wanted = None
            if logit_rows is not None:
                at = ((logit_rows >= start) & (logit_rows < stop)).nonzero().flatten()
                wanted_at.append(at)
                wanted = logit_rows[at] - start
            parts.append(self._step(tokens[start:stop], hidden[start:stop], positions[start:stop], local, wanted))
        key, value, out_hidden = (torch.cat([p[i] for p in parts]) for i in (2, 3, 1))
        logprobs = torch.cat([p.logprobs for p in parts])
        if logit_rows is not None:  # back in the order asked
            logprobs = logprobs[torch.cat(wanted_at).argsort()]
        return DraftStep(logprobs, out_hidden, key, value)

    def _step(self, tokens, hidden, positions, segments, logit_rows) -> DraftStep:
        ids, padded_hidden, padded_positions, mask, past, rows = self._padded(tokens, hidden, positions, segments)
        out = self.head(ids, padded_hidden, padded_positions, mask, past)
        width = ids.shape[1]
        key = out.kv[0].transpose(1, 2).reshape(-1, self.num_kv_heads, self.head_dim)[rows]  # [T, kvh, D]
        value = out.kv[1].transpose(1, 2).reshape(-1, self.num_kv_heads, self.head_dim)[rows]
        normed = out.normed.reshape(len(segments) * width, -1)[rows]  # [T, H]
        if logit_rows is not None:
            normed = normed[logit_rows.to(normed.device)]
        logprobs = self.head.compute_logits(normed).float().log_softmax(-1)
        return DraftStep(logprobs, out.hidden.reshape(len(segments) * width, -1)[rows], key, value)

    def _padded(self, tokens, hidden, positions, segments):
        """Segments right-padded to [B, W] rows and [B, S] past columns; the mask's
        columns are the padded past then the padded new rows; a padding row attends to
        itself only. Also returns Long [T]: each real row's index in the flat [B*W]."""
        dev = self.device
        count = [seg.rows.stop - seg.rows.start for seg in segments]
        past_len = [seg.past_key.shape[0] for seg in segments]
        batch, width, span = len(segments), max(count), max(past_len)
        ids = torch.zeros(batch, width, dtype=torch.long, device=dev)
        padded_hidden = hidden.new_zeros(batch, width, hidden.shape[-1])
        padded_positions = torch.zeros(batch, width, dtype=torch.long, device=dev)
        mask = torch.zeros(batch, width, span + width, dtype=torch.bool, device=dev)
        mask[:, torch.arange(width), span + torch.arange(width)] = True
        past_key = self.empty_kv().new_zeros(batch, span, self.num_kv_heads, self.head_dim)
        past_value = torch.zeros_like(past_key)
        for b, (seg, n, s) in enumerate(zip(segments, count, past_len)):
            ids[b, :n], padded_hidden[b, :n] = tokens[seg.rows], hidden[seg.rows]
            padded_positions[b, :n] = positions[seg.rows]
            mask[b, :n, :s], mask[b, :n, span:span + n] = seg.mask[:, :s], seg.mask[:, s:]
            past_key[b, :s], past_value[b, :s] = seg.past_key, seg.past_value
        past = None if span == 0 else (past_key.transpose(1, 2), past_value.transpose(1, 2))  # [B, kvh, S, D]
        rows = torch.cat([b * width + torch.arange(n, device=dev) for b, n in enumerate(count)])
        return ids, padded_hidden, padded_positions, mask, past, rows


def _groups(segments):
    """Consecutive segments, each group's padded size (segments x longest past + rows)
    at most PADDED_ROWS (a segment larger than that alone)."""
    group, longest = [], 0
    for seg in segments:
        size = seg.past_key.shape[0] + seg.rows.stop - seg.rows.start
        if group and (len(group) + 1) * max(longest, size) > PADDED_ROWS:
            yield group
            group, longest = [], 0
        group.append(seg)
        longest = max(longest, size)
    if group:
        yield group
