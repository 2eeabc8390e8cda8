"""The vLLM side of the drafting seam (specplug.common.drafting.runner.HeadRunner):
runs vLLM's loaded EAGLE-3 draft layer in plain torch with a dense key/value cache and
an arbitrary boolean attention mask (which vLLM's paged draft attention cannot take).

Every sub-module except the attention op is vLLM's own (`Eagle3LlamaForCausalLM` as
vLLM loaded it: fused qkv, RoPE, norms, MLP, lm_head with d2t), so a chain drafted here
is the chain vLLM's built-in EAGLE-3 drafts, up to the attention kernel's rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specplug.common.drafting.runner import DraftStep, Segment


class DenseEagle3Head:
    """HeadRunner over the EAGLE-3 modules vLLM loaded: one midlayer step over T inputs
    with caller-owned dense KV.

    Input at position i pairs token x_{i+1} with hidden h_i (the target's combined aux
    state for committed positions, the parent's pre-norm output inside a draft tree) and
    predicts x_{i+2}; RoPE uses position i.
    """

    def __init__(self, model):
        layers = model.model.layers
        if len(layers) != 1:
            raise ValueError(
                f"the specplug EAGLE-3 proposer needs a one-layer head (num_hidden_layers=1), "
                f"got {len(layers)} layers: use vLLM's built-in eagle3 path (drop the specplug section)"
            )
        self.model = model
        self.layer = layers[0]
        attn = self.layer.self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.q_size, self.kv_size = attn.q_size, attn.kv_size

    @property
    def token_map(self) -> torch.Tensor | None:
        """Long [draft_vocab] target id of each draft id (arange + d2t), None if identical."""
        d2t = self.model.draft_id_to_target_id
        if d2t is None:
            return None
        return torch.arange(d2t.shape[0], device=d2t.device) + d2t

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
        x = torch.cat([embeds, normed], dim=-1)  # [T, 2H]
        qkv, _ = layer.self_attn.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = layer.self_attn.rotary_emb(positions, q, k)
        key = k.reshape(-1, self.num_kv_heads, self.head_dim)
        value = v.reshape(-1, self.num_kv_heads, self.head_dim)
        attn = torch.cat([self._attend(q[seg.rows], torch.cat([seg.past_key, key[seg.rows]]),
                                       torch.cat([seg.past_value, value[seg.rows]]), seg.mask)
                          for seg in segments])
        out, _ = layer.self_attn.o_proj(attn)
        out, residual = layer.post_attention_layernorm(out, residual)
        out = layer.mlp(out)
        normed_out, prenorm = self.model.model.norm(out, residual)
        if logit_rows is not None:
            normed_out = normed_out[logit_rows]
        logits = self.model.logits_processor(self.model.lm_head, normed_out).float()  # [T or R, draft_vocab]
        return DraftStep(torch.log_softmax(logits, dim=-1), prenorm, key, value)

    def _attend(self, q, keys, values, mask):
        """q [T, heads*D]; keys/values [S+T, kv_heads, D]; mask [T, S+T] -> [T, heads*D]."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim).transpose(0, 1)  # [heads, T, D]
        groups = self.num_heads // self.num_kv_heads
        k = keys.transpose(0, 1).repeat_interleave(groups, dim=0)  # [heads, S+T, D]
        v = values.transpose(0, 1).repeat_interleave(groups, dim=0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None].to(q.device), scale=self.scaling)
        return out.transpose(0, 1).reshape(t, self.num_heads * self.head_dim)

    def empty_kv(self) -> torch.Tensor:
        """A [0, kv_heads, head_dim] cache tensor in the head's dtype."""
        weight = self.layer.self_attn.o_proj.weight
        return weight.new_zeros(0, self.num_kv_heads, self.head_dim)
