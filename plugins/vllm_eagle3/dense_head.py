"""The vLLM side of the drafting seam (specplug.common.drafting.runner.HeadRunner):
runs vLLM's loaded EAGLE-3 or EAGLE-1 draft layer in plain torch with a dense key/value
cache and an arbitrary boolean attention mask (which vLLM's paged draft attention cannot
take).

Every sub-module except the attention op is vLLM's own (`Eagle3LlamaForCausalLM` /
`EagleLlamaForCausalLM` as vLLM loaded them: fc, fused qkv, RoPE, norms, MLP, lm_head
with d2t, or the target's lm_head for EAGLE-1), so a chain drafted here is the chain
vLLM's built-in EAGLE drafts, up to the attention kernel's rounding.
"""

from __future__ import annotations

import torch

from specplug.common.drafting.runner import DraftStep, Segment, masked_attention
from specplug.common.heads.eagle3 import split_kv, stack_kv


class _DenseLayer:
    """vLLM decoder layers' attention run over caller-owned dense KV, per request: the
    cache holds every layer's kv heads side by side (layer 0 first), as the core head's
    does. Subclasses name their head kind in KIND and say in MULTI_LAYER whether they
    run heads of more than one layer."""

    KIND = "EAGLE"
    MULTI_LAYER = False

    def __init__(self, model):
        layers = model.model.layers
        if len(layers) != 1 and not self.MULTI_LAYER:
            raise ValueError(
                f"the specplug {self.KIND} proposer needs a one-layer head (num_hidden_layers=1), "
                f"got {len(layers)} layers: use vLLM's built-in path (drop the specplug section)"
            )
        self.model = model
        self.layers = list(layers)
        self.layer = layers[0]
        attn = self.layer.self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.q_size, self.kv_size = attn.q_size, attn.kv_size

    def _layer_segments(self, segments: list[Segment], i: int) -> list[Segment]:
        """The segments with layer i's past keys/values: kv heads [i*kvh, (i+1)*kvh)."""
        if len(self.layers) == 1:
            return segments
        parts = []
        for seg in segments:  # the core head's stacked layout ([S, layers * kv_heads, D]), split its way
            key, value = split_kv((seg.past_key, seg.past_value), len(self.layers))[i]
            parts.append(seg._replace(past_key=key, past_value=value))
        return parts

    def _attention(self, x, positions, segments, i: int = 0):
        """x [T, In] -> (o_proj output [T, H], key, value [T, kv_heads, D]): layer i's
        attention, each segment's rows over its own past KV (layer i's) and mask."""
        attn_layer = self.layers[i].self_attn
        segments = self._layer_segments(segments, i)
        qkv, _ = attn_layer.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = attn_layer.rotary_emb(positions, q, k)
        key = k.reshape(-1, self.num_kv_heads, self.head_dim)
        value = v.reshape(-1, self.num_kv_heads, self.head_dim)
        attn = torch.cat([masked_attention(q[seg.rows], torch.cat([seg.past_key, key[seg.rows]]),
                                            torch.cat([seg.past_value, value[seg.rows]]), seg.mask, self.scaling)
                          for seg in segments])
        out, _ = attn_layer.o_proj(attn)
        return out, key, value

    def _logprobs(self, rows: torch.Tensor, logit_rows: torch.Tensor | None) -> torch.Tensor:
        """[T, H] lm_head inputs -> draft log-probs [T or R, draft_vocab] (R = logit_rows)."""
        if logit_rows is not None:
            rows = rows[logit_rows]
        return torch.log_softmax(self.model.logits_processor(self.model.lm_head, rows).float(), dim=-1)

    def empty_kv(self) -> torch.Tensor:
        """A [0, layers * kv_heads, head_dim] cache tensor in the head's dtype."""
        weight = self.layer.self_attn.o_proj.weight
        return weight.new_zeros(0, len(self.layers) * self.num_kv_heads, self.head_dim)


class DenseEagle3Head(_DenseLayer):
    """HeadRunner over the EAGLE-3 modules vLLM loaded: one step of the midlayer (and of
    any later layers, vLLM's multi-layer EAGLE-3) over T inputs with caller-owned dense KV.

    Input at position i pairs token x_{i+1} with hidden h_i (the target's combined aux
    state for committed positions, the parent's pre-norm output inside a draft tree) and
    predicts x_{i+2}; RoPE uses position i.
    """

    KIND = "EAGLE-3"
    MULTI_LAYER = True

    @property
    def token_map(self) -> torch.Tensor | None:
        """Long [draft_vocab] target id of each draft id (arange + d2t), None if identical."""
        d2t = self.model.draft_id_to_target_id
        if d2t is None:
            return None
        return torch.arange(d2t.shape[0], device=d2t.device) + d2t

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size: sampled drafts scatter q into its columns."""
        return self.model.config.vocab_size

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[T, 3*Ht] concatenated target aux states -> [T, H] (the head's fc)."""
        return self.model.combine_hidden_states(aux_hidden)

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             segments: list[Segment], logit_rows: torch.Tensor | None = None) -> DraftStep:
        """One head step over T rows of several requests: tokens [T], hidden [T, H],
        positions [T]; `segments` cover the rows in order, one per request, each with its
        past KV and mask. Linear layers run once over all rows; attention per segment.
        logit_rows: Long [R], the rows whose draft log-probs are needed (DraftStep.logprobs
        is then [R, draft_vocab] in that order; None = all T). A catch-up over committed
        tokens needs only each request's last row, and the LM head is the costly part."""
        layer = self.layer
        embeds = layer.input_layernorm(self.model.embed_input_ids(tokens))
        normed, residual = layer._residual_norm(hidden_states=hidden)
        out, key, value = self._attention(torch.cat([embeds, normed], dim=-1), positions, segments)  # [T, 2H] in
        out, residual = layer.post_attention_layernorm(out, residual)
        out = layer.mlp(out)
        kvs = [(key, value)]
        for i, later in enumerate(self.layers[1:], start=1):  # vLLM's LlamaModel.forward, layer by layer
            normed, residual = later.input_layernorm(out, residual)
            out, key, value = self._attention(normed, positions, segments, i)
            out, residual = later.post_attention_layernorm(out, residual)
            out = later.mlp(out)
            kvs.append((key, value))
        normed_out, prenorm = self.model.model.norm(out, residual)
        key, value = stack_kv(kvs)  # [T, layers * kv_heads, D]
        return DraftStep(self._logprobs(normed_out, logit_rows), prenorm, key, value)

class DenseEagle1Head(_DenseLayer):
    """HeadRunner over the EAGLE-1 modules vLLM loaded (EagleLlamaForCausalLM, the
    target's lm_head shared by vLLM): x = fc([embed(token); h]), r = x + attn(x), then
    r + mlp(norm(r)), scored by the target's lm_head. h is the target's final hidden
    state (after its norm) for committed positions, the parent's output r in a tree."""

    KIND = "EAGLE-1"
    token_map = None  # EAGLE-1 drafts in the target's vocabulary

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The target's final hidden state [T, H] is the feature itself."""
        return aux_hidden.to(self.layer.self_attn.o_proj.weight.dtype)

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             segments: list[Segment], logit_rows: torch.Tensor | None = None) -> DraftStep:
        """As DenseEagle3Head.step; DraftStep.hidden is the output r (no final norm)."""
        layer = self.layer
        x = self.model.model.fc(torch.cat([self.model.embed_input_ids(tokens), hidden], dim=-1))  # [T, H]
        out, key, value = self._attention(x, positions, segments)  # layer 0 has no input_layernorm
        out, residual = layer.post_attention_layernorm(out, x)
        r = layer.mlp(out) + residual
        return DraftStep(self._logprobs(r, logit_rows), r, key, value)
