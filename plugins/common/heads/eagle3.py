"""The EAGLE-3 draft head (Li et al. 2025) as a torch module, with the tensor names and
config keys of the published EAGLE / SpecForge `LlamaForCausalLMEagle3` checkpoints.

Math (identical to vLLM 0.32's `Eagle3LlamaForCausalLM`):
  first draft step   g = fc(cat(aux_0, aux_1, aux_2))          # [.., 3*Ht] -> [.., H]
  later steps        g = the head's own pre-norm output of the parent step
  x  = cat(input_layernorm(embed(token)), hidden_norm(g))        # [.., 2H]
  a  = o_proj(attn(q_proj(x), k_proj(x), v_proj(x)))  + g        # RoPE on q, k
  r  = mlp(post_attention_layernorm(a)) + a                      # pre-norm output
  with num_hidden_layers = n > 1 (vLLM's multi-layer EAGLE-3), layers.1 .. layers.{n-1}
  follow, each a plain pre-norm Llama layer over the previous one's H-wide r:
     a' = o_proj(attn(input_layernorm(r))) + r;   r = mlp(post_attention_layernorm(a')) + a'
  logits = lm_head(norm(r))                                      # [.., draft_vocab]
  target id of draft id i = i + d2t[i];  t2d[t] says target id t is in the draft vocab.

The input at position i pairs the target's hidden state at i with the token at i+1,
and predicts the token at i+2; RoPE uses position i. The head owns no cache: the
caller passes the past keys/values and gets the new ones back, so it can draft trees
with any boolean attention mask. The keys/values of all n layers travel as one tensor,
the layers' kv heads side by side ([.., n * kv_heads, .., head_dim], layer 0 first), so
every cache holder treats a multi-layer head like a one-layer one with more kv heads.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
NUM_AUX_HIDDEN_STATES = 3


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's default aux layers for an L-layer target: (2, L // 2, L - 3).

    Aux id i is the residual-stream INPUT of target decoder layer i, i.e. Hugging Face's
    `output_hidden_states=True` entry `hidden_states[i]` (entry 0 = the embeddings).
    """
    if num_target_layers < 4:
        raise ValueError(
            f"num_target_layers must be >= 4 for the default EAGLE-3 aux layers (2, L//2, L-3), "
            f"got {num_target_layers}: pass aux_layer_ids explicitly"
        )
    return (2, num_target_layers // 2, num_target_layers - 3)


def check_capture_order(ids, engine: str, where: str) -> None:
    """ValueError unless aux layer `ids` are distinct and ascending: the engines capture
    each aux layer once, in layer order, and concatenate them so (the fc's column order)."""
    if ids is not None and list(ids) != sorted(set(ids)):
        raise ValueError(f"head eagle_aux_hidden_state_layer_ids {list(ids)} must be distinct and ascending: {engine} "
                         f"captures the aux layers once each, in layer order ({where}); fix: train or convert a "
                         "head for this target with sorted ids")


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    """Read `key` from a dict-like or attribute-style (transformers) config."""
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def rope_settings(config: Any) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of a Llama config, also from transformers-5 `rope_parameters`;
    plain RoPE gives rope_scaling None (what older readers such as the EAGLE repo expect)."""
    rope = dict(_get(config, "rope_parameters") or {})
    scaling = _get(config, "rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return _get(config, "rope_theta") or rope.get("rope_theta", 10000.0), scaling


def llama_fields(config: Any, what: str) -> dict[str, Any]:
    """The Llama decoder-layer fields every EAGLE head config shares, read from a
    config.json dict or a transformers config; ValueError names missing keys."""
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
               if _get(config, k) is None]
    if missing:
        raise ValueError(f"{what} config.json is missing {missing}: add them (copy from the target's config)")
    rope_theta, rope_scaling = rope_settings(config)
    return dict(
        hidden_size=_get(config, "hidden_size"),
        intermediate_size=_get(config, "intermediate_size"),
        num_attention_heads=_get(config, "num_attention_heads"),
        num_key_value_heads=_get(config, "num_key_value_heads") or _get(config, "num_attention_heads"),
        vocab_size=_get(config, "vocab_size"),
        head_dim=_get(config, "head_dim"),
        rms_norm_eps=_get(config, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=_get(config, "max_position_embeddings", 2048),
        hidden_act=_get(config, "hidden_act", "silu"),
    )


def check_llama_shape(config: Any, what: str) -> None:
    """Fill a frozen config's head_dim (hidden / heads) and check heads, KV heads and the
    activation; ValueError names the field and the fix."""
    if config.head_dim is None:
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(
                f"hidden_size {config.hidden_size} is not divisible by num_attention_heads "
                f"{config.num_attention_heads}: set head_dim in the head's config.json"
            )
        object.__setattr__(config, "head_dim", config.hidden_size // config.num_attention_heads)
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads {config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {config.num_key_value_heads}: fix the head's config.json"
        )
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act must be 'silu' for an {what} Llama head, got {config.hidden_act!r}")


# Keys of the canonical config.json that Eagle3Config models; all others go to `extra`.
_FIXED_KEYS = {"architectures", "model_type", "num_hidden_layers", "eagle_config",
               "tie_word_embeddings", "specplug", "rope_parameters", "norm_before_residual"}


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 head's shape, in the EAGLE / SpecForge `LlamaForCausalLMEagle3` format.

    `vocab_size` is the TARGET's vocabulary, `draft_vocab_size` the head's lm_head rows;
    `target_hidden_size` is the width of each aux hidden state (fc takes 3x it).
    `aux_layer_ids` None means the default (2, L//2, L-3) for the target's L layers.
    `specplug` is the optional specplug section (tree settings, verification mode);
    `extra` keeps every other config.json key so a round trip loses nothing.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    aux_layer_ids: tuple[int, ...] | None = None
    attention_bias: bool = False
    norm_before_residual: bool = False
    hidden_act: str = "silu"
    num_hidden_layers: int = 1
    specplug: dict | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        check_llama_shape(self, "EAGLE-3")
        if not isinstance(self.num_hidden_layers, int) or self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be an int >= 1 for an EAGLE-3 head (the midlayer, then "
                             f"plain decoder layers), got {self.num_hidden_layers!r}: fix the head's config.json")
        if self.aux_layer_ids is not None:
            object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
            if len(self.aux_layer_ids) != NUM_AUX_HIDDEN_STATES:
                raise ValueError(
                    f"eagle_aux_hidden_state_layer_ids must list {NUM_AUX_HIDDEN_STATES} layers, "
                    f"got {list(self.aux_layer_ids)}"
                )

    @property
    def fc_input_size(self) -> int:
        return NUM_AUX_HIDDEN_STATES * self.target_hidden_size

    @property
    def cache_kv_heads(self) -> int:
        """Width of the head's key/value cache in kv heads: every layer's, side by side."""
        return self.num_hidden_layers * self.num_key_value_heads

    def resolved_aux_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        """The aux layer ids for a target with `num_target_layers` layers."""
        ids = self.aux_layer_ids or default_aux_layer_ids(num_target_layers)
        bad = [i for i in ids if not 0 <= i < num_target_layers]
        if bad:
            raise ValueError(
                f"eagle_aux_hidden_state_layer_ids {list(ids)} has ids {bad} outside "
                f"[0, {num_target_layers}) for a {num_target_layers}-layer target: "
                "train or convert a head for this target"
            )
        return tuple(ids)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "Eagle3Config":
        """Parse an EAGLE / SpecForge config.json dict (also accepts transformers-5
        `rope_parameters`). Raises ValueError naming the key for missing/unsupported ones."""
        arch = config.get("architectures") or [ARCHITECTURE]
        if not any("eagle3" in a.lower() for a in arch):
            raise ValueError(
                f"architectures {arch} is not an EAGLE-3 head (expected {ARCHITECTURE!r}): "
                "convert it with `specplug convert` or pass the right checkpoint"
            )
        eagle = config.get("eagle_config") or {}
        for key in ("norm_before_fc", "fc_norm", "norm_output"):
            if eagle.get(key, config.get(key, False)):
                raise ValueError(f"EAGLE-3 variant with {key}=true is not supported by specplug")
        if eagle.get("use_aux_hidden_state", True) is False:
            raise ValueError("eagle_config.use_aux_hidden_state=false (EAGLE-1 style) is not supported")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(
            **llama_fields(config, "EAGLE-3"),
            draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
            target_hidden_size=config.get("target_hidden_size") or config["hidden_size"],
            aux_layer_ids=eagle.get("eagle_aux_hidden_state_layer_ids",
                                    config.get("eagle_aux_hidden_state_layer_ids")),
            attention_bias=config.get("attention_bias", False),
            norm_before_residual=bool(config.get("norm_before_residual", eagle.get("norm_before_residual", False))),
            num_hidden_layers=config.get("num_hidden_layers", 1),
            specplug=config.get("specplug"),
            extra={k: v for k, v in config.items()
                   if k not in known and k not in _FIXED_KEYS and k != "eagle_aux_hidden_state_layer_ids"},
        )

    def to_dict(self) -> dict[str, Any]:
        """The canonical config.json dict (loads in vLLM's and SGLang's built-in eagle3)."""
        eagle_config: dict[str, Any] = {"use_aux_hidden_state": True}
        if self.aux_layer_ids is not None:
            eagle_config["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        out = dict(self.extra)
        out.update(
            architectures=[ARCHITECTURE], model_type="llama", num_hidden_layers=self.num_hidden_layers,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, vocab_size=self.vocab_size, draft_vocab_size=self.draft_vocab_size,
            target_hidden_size=self.target_hidden_size, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings, attention_bias=self.attention_bias,
            hidden_act=self.hidden_act, tie_word_embeddings=False, eagle_config=eagle_config,
        )
        out["norm_before_residual"] = self.norm_before_residual  # top level: where vLLM reads it
        if self.specplug is not None:
            out["specplug"] = self.specplug
        return out

    @classmethod
    def for_target(cls, target_config: Any, *, draft_vocab_size: int | None = None,
                   aux_layer_ids: tuple[int, ...] | None = None, **overrides) -> "Eagle3Config":
        """A head shaped like `target_config` (a transformers config or its dict): same
        width, heads, MLP, norm eps and RoPE; `draft_vocab_size` defaults to the target vocab."""
        kwargs = llama_fields(target_config, "target")
        kwargs.pop("hidden_act")
        kwargs.update(draft_vocab_size=draft_vocab_size or kwargs["vocab_size"],
                      target_hidden_size=kwargs["hidden_size"], aux_layer_ids=aux_layer_ids)
        kwargs.update(overrides)
        return cls(**kwargs)


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in float32 like Hugging Face and vLLM."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: Any) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim/2] for the target's rope settings
    (default, linear, llama3); other rope types raise ValueError."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq.float()
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).float()
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling).float()
    raise ValueError(
        f"rope_scaling type {rope_type!r} is not supported by the specplug EAGLE heads "
        "(supported: default, linear, llama3)"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama-3.1 frequency-dependent RoPE scaling."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding. x [B, heads, T, D], positions [B, T]."""
    freqs = positions[:, None, :, None].float() * inv_freq  # [B, 1, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (x.float() * emb.cos() + _rotate_half(x.float()) * emb.sin()).to(x.dtype)


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H-wide [embedding ; hidden] input (EAGLE-3),
    or an `input_size`-wide one (EAGLE-1: H); `bias` (q/k/v) defaults to attention_bias."""

    def __init__(self, config: Eagle3Config, *, input_size: int | None = None, bias: bool | None = None):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        bias = config.attention_bias if bias is None else bias
        width = 2 * h if input_size is None else input_size
        self.q_proj = nn.Linear(width, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(width, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(width, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, heads, self.head_dim).transpose(1, 2)  # [B, heads, T, D]

    def forward(self, x, positions, attention_mask, past_kv, inv_freq):
        """x [B, T, 2H] (or [B, T, input_size]); attention_mask Bool [B, T, S+T]; past_kv (k, v) [B, kvh, S, D] or None.
        Returns (out [B, T, H], (k_new, v_new) [B, kvh, T, D])."""
        q = apply_rope(self._split(self.q_proj(x), self.num_heads), positions, inv_freq)
        k_new = apply_rope(self._split(self.k_proj(x), self.num_kv_heads), positions, inv_freq)
        v_new = self._split(self.v_proj(x), self.num_kv_heads)
        k, v = k_new, v_new
        if past_kv is not None:
            k, v = torch.cat([past_kv[0], k_new], dim=2), torch.cat([past_kv[1], v_new], dim=2)
        out = grouped_attention(q, k, v, attention_mask[:, None])  # [B, heads, T, D]
        out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        return self.o_proj(out), (k_new, v_new)


SDPA_TAKES_GROUPS = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa


def grouped_attention(q, k, v, mask) -> torch.Tensor:
    """scaled_dot_product_attention with grouped-query heads: q [B, heads, T, D] where
    query head h reads kv head h // groups of k, v [B, kv_heads, S, D]; mask Bool
    broadcastable to [B, heads, T, S]. torch >= 2.5 reads the kv heads in place
    (enable_gqa, the same numbers; on a CPU up to 20x faster for a batch of one-row
    queries over long caches); older torch repeats them."""
    if SDPA_TAKES_GROUPS:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1),
                                          attn_mask=mask)


class Eagle3MLP(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """EAGLE-3's `midlayer`: one Llama decoder layer over [embedding ; hidden]."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.self_attn = Eagle3Attention(config)
        self.mlp = Eagle3MLP(config)
        self.norm_before_residual = config.norm_before_residual

    def forward(self, embeds, hidden, positions, attention_mask, past_kv, inv_freq):
        """Returns (pre-norm output [B, T, H], new (k, v))."""
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)  # [B, T, 2H]
        attn, kv = self.self_attn(x, positions, attention_mask, past_kv, inv_freq)
        residual = attn + residual
        out = self.mlp(self.post_attention_layernorm(residual)) + residual
        return out, kv


class Eagle3LaterLayer(nn.Module):
    """Layer 1, 2, .. of a multi-layer EAGLE-3 head (vLLM's `layers.{i}`, i >= 1): a plain
    pre-norm Llama decoder layer over the previous layer's pre-norm output [B, T, H]."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.self_attn = Eagle3Attention(config, input_size=h)
        self.mlp = Eagle3MLP(config)

    def forward(self, hidden, positions, attention_mask, past_kv, inv_freq):
        """Returns (pre-norm output [B, T, H], new (k, v))."""
        attn, kv = self.self_attn(self.input_layernorm(hidden), positions, attention_mask, past_kv, inv_freq)
        residual = attn + hidden
        return self.mlp(self.post_attention_layernorm(residual)) + residual, kv


def split_kv(past_kv, layers: int) -> list:
    """One (k, v) [B, kv_heads, S, D] per layer from the stacked [B, layers * kv_heads, S, D]
    (None: no past, for every layer). Any layout with the kv heads on dim 1 splits the same
    way (the vLLM adapter's [S, layers * kv_heads, D])."""
    if past_kv is None:
        return [None] * layers
    return list(zip(past_kv[0].chunk(layers, dim=1), past_kv[1].chunk(layers, dim=1)))


def stack_kv(kvs: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The layers' (k, v) [B, kv_heads, T, D] side by side: [B, layers * kv_heads, T, D]
    (or [T, kv_heads, D] -> [T, layers * kv_heads, D]: the kv heads on dim 1)."""
    if len(kvs) == 1:
        return kvs[0]
    return torch.cat([k for k, _ in kvs], dim=1), torch.cat([v for _, v in kvs], dim=1)


class Eagle3Output(NamedTuple):
    normed: torch.Tensor  # [B, T, H] final-norm output: feed to compute_logits
    hidden: torch.Tensor  # [B, T, H] pre-norm output: the next step's `hidden` input
    kv: tuple[torch.Tensor, torch.Tensor]  # (k, v) [B, cache_kv_heads, T, head_dim] of the T inputs


class TargetEmbedding:
    """Mixin for heads that may share the target's input embedding: `embed` uses the head's
    own `embed_tokens` when it has one, else the module set with `set_target_embedding`
    (held in a list, so it stays out of the state_dict). Needs `config.vocab_size`,
    `config.hidden_size`, `fc`, `_target_embedding: list` and a `KIND` string."""

    KIND = "EAGLE"

    def set_target_embedding(self, embedding: nn.Module) -> None:
        """Share the target's input embedding (used when the checkpoint has no embed_tokens)."""
        self._target_embedding[:] = [checked_vocab_matrix(embedding, self.config, "target embedding")]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "embed_tokens"):
            return self.embed_tokens(input_ids)
        if not self._target_embedding:
            raise ValueError(f"this {self.KIND} head has no embed_tokens: "
                             "call set_target_embedding(target's embedding)")
        return self._target_embedding[0](input_ids).to(self.fc.weight.dtype)


def checked_vocab_matrix(module: nn.Module, config: Any, what: str) -> nn.Module:
    """`module` if its weight is [vocab_size, hidden_size] (an embedding or lm_head), else ValueError."""
    weight = getattr(module, "weight", None)
    if weight is None or tuple(weight.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(
            f"{what} must be [vocab_size, hidden_size] = [{config.vocab_size}, {config.hidden_size}], got "
            f"{None if weight is None else list(weight.shape)}: the head was made for another target"
        )
    return module


def load_checked(head: nn.Module, given: Mapping[str, torch.Tensor], what: str) -> None:
    """Strict-check `given` against head's own state_dict, take fc.weight's dtype, load."""
    check_state_dict(head.state_dict(), given, what)
    head.to(given["fc.weight"].dtype)
    head.load_state_dict(given, strict=True)


class Eagle3Head(TargetEmbedding, nn.Module):
    """EAGLE-3 draft head. state_dict keys are exactly EAGLE / SpecForge's:
    fc.weight [H, 3Ht], midlayer.*, layers.{i}.* for i >= 1 (vLLM's multi-layer names, only
    when num_hidden_layers > 1), norm.weight, lm_head.weight [draft_vocab, H],
    d2t int64 [draft_vocab], t2d bool [vocab], optional embed_tokens.weight [vocab, H].
    Without its own embed_tokens the head uses the target's, set with
    `set_target_embedding` (kept out of the state_dict)."""

    KIND = "EAGLE-3"

    def __init__(self, config: Eagle3Config, *, own_embedding: bool = False):
        super().__init__()
        self.config = config
        h = config.hidden_size
        if own_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.fc = nn.Linear(config.fc_input_size, h, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.t2d[: config.draft_vocab_size] = True
        self.inv_freq = rope_inv_freq(config)  # float32, deliberately not a buffer: .to(dtype) must not round it
        self._target_embedding: list[nn.Module] = []  # a list keeps it out of the state_dict
        # always registered (empty for one layer: no state_dict keys), so a head grown by adding
        # entries (training.eagle3.grown) and one built with them list parameters() in one order
        self.layers = nn.ModuleDict({str(i): Eagle3LaterLayer(config) for i in range(1, config.num_hidden_layers)})

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, config: Eagle3Config, state_dict: Mapping[str, torch.Tensor], *,
                        target_embedding: nn.Module | None = None) -> "Eagle3Head":
        """Build a head from canonical tensors with strict key checking. `d2t`/`t2d` may be
        absent only when draft_vocab_size == vocab_size (identity mapping); a missing
        `t2d` is derived from `d2t`. The head takes the dtype of its weights."""
        own_embedding = "embed_tokens.weight" in state_dict
        head = cls(config, own_embedding=own_embedding)
        given = dict(state_dict)
        if "d2t" in given and "t2d" not in given:
            given["t2d"] = d2t_to_t2d(given["d2t"], config.vocab_size)
        if config.draft_vocab_size == config.vocab_size:
            given.setdefault("d2t", head.d2t)
            given.setdefault("t2d", head.t2d)
        load_checked(head, given, "EAGLE-3 head")
        head.d2t.copy_(given["d2t"].long())
        head.t2d.copy_(given["t2d"].bool())
        if target_embedding is not None:
            head.set_target_embedding(target_embedding)
        return head

    # -- forward pieces ----------------------------------------------------------------
    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Fuse the target's aux hidden states: [..., 3*Ht] -> [..., H]."""
        return self.fc(aux_hidden.to(self.fc.weight))  # the head's dtype and device

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attention_mask: torch.Tensor,
                past_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> Eagle3Output:
        """One draft step over T inputs.

        input_ids [B, T] (the token AFTER each hidden state's position), hidden [B, T, H]
        (fc(aux) for target states, or the head's own pre-norm output), positions [B, T],
        attention_mask Bool [B, T, S+T] (True = may attend; columns = past then new; every
        row must allow at least one column), past_kv (k, v) [B, cache_kv_heads, S, head_dim].
        """
        embeds = self.embed(input_ids)
        inv_freq = self.inv_freq.to(hidden.device)
        past = split_kv(past_kv, self.config.num_hidden_layers)
        out, kv = self.midlayer(embeds, hidden, positions, attention_mask, past[0], inv_freq)
        kvs = [kv]
        for layer, layer_past in zip(self.later_layers(), past[1:]):
            out, kv = layer(out, positions, attention_mask, layer_past, inv_freq)
            kvs.append(kv)
        return Eagle3Output(self.norm(out), out, stack_kv(kvs))

    def later_layers(self) -> list[Eagle3LaterLayer]:
        """Layers 1 .. num_hidden_layers - 1 in order (none for a one-layer head)."""
        return list(self.layers.values())

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[..., H] -> draft-vocab logits [..., draft_vocab]."""
        return self.lm_head(normed)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids to target ids: t = i + d2t[i]."""
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Scatter draft-vocab logits [..., draft_vocab] into the target vocab [..., vocab],
        -inf where the target token is outside the draft vocab."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        idx = self.to_target_ids(torch.arange(self.config.draft_vocab_size, device=draft_logits.device))
        out[..., idx] = draft_logits
        return out


def d2t_to_t2d(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d Bool [vocab]: True for target ids reachable from the draft vocab."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.numel()) + d2t.long().cpu()] = True
    return t2d


def check_state_dict(reference: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor], what: str) -> None:
    """Strict check: same key set and same shapes as `reference`, else ValueError."""
    missing, unexpected = sorted(set(reference) - set(given)), sorted(set(given) - set(reference))
    if missing or unexpected:
        raise ValueError(
            f"{what} state_dict does not match its config: missing keys {missing}, "
            f"unexpected keys {unexpected}: convert the checkpoint with `specplug convert` "
            "or check its config.json"
        )
    for name, ref in reference.items():
        if tuple(given[name].shape) != tuple(ref.shape):
            raise ValueError(
                f"{what} tensor {name} has shape {list(given[name].shape)}, the config implies "
                f"{list(ref.shape)}: the config.json and weights disagree"
            )
