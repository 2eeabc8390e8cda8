"""The EAGLE-1 draft head (Li et al. 2024) as a torch module, with the tensor names and
config keys of the checkpoints the EAGLE repo publishes (e.g. EAGLE-LLaMA3-Instruct-8B),
shaped so that Eagle3Drafter drives it unchanged.

Math (the EAGLE repo's `cnets1.py` Model; vLLM 0.32's `EagleLlamaForCausalLM`):
  f  = the feature: the target's last hidden state AFTER its final norm (Hugging Face
       `hidden_states[L]`), or, deeper in a draft tree, the head's own output `r`
  x  = fc(cat(embed(token), f))                              # [.., 2H] -> [.., H] (+ fc.bias)
  a  = o_proj(attn(q_proj(x), k_proj(x), v_proj(x))) + x      # layer 0 has NO input_layernorm
  r  = mlp(post_attention_layernorm(a)) + a                  # output = the next feature
  logits = target.lm_head(r)                                 # no norm: r predicts a post-norm state

The head has no final norm and no lm_head of its own: it scores with the TARGET's lm_head
(`set_target_lm_head`), and its output lives in the target's post-norm feature space.
Positions and the pairing (feature i with token i+1, RoPE position i) are EAGLE-3's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from .eagle3 import (Eagle3Attention, Eagle3MLP, Eagle3Output, RMSNorm, TargetEmbedding, checked_vocab_matrix,
                     check_llama_shape, llama_fields, load_checked, rope_inv_freq)

ARCHITECTURE = "LlamaForCausalLM"  # what EAGLE-1 config.json files say
# Keys of config.json that Eagle1Config models; all others go to `extra`.
_FIXED_KEYS = {"num_hidden_layers", "bias", "rope_parameters", "specplug"}


@dataclass(frozen=True)
class Eagle1Config:
    """An EAGLE-1 head's shape: a Llama config.json with one layer.

    `fc_bias` is the EAGLE repo's `bias` key (None: the key is absent, so the weights
    decide; the EAGLE repo's default is a bias). `qkv_bias` is its `qkv_bias` key.
    The draft vocabulary is the target's (`draft_vocab_size` == `vocab_size`).
    `extra` keeps every other config.json key so a round trip loses nothing.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    fc_bias: bool | None = None
    qkv_bias: bool = False
    hidden_act: str = "silu"
    specplug: dict | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        check_llama_shape(self, "EAGLE-1")

    @property
    def cache_kv_heads(self) -> int:
        """Width of the head's key/value cache in kv heads (one layer)."""
        return self.num_key_value_heads

    @property
    def draft_vocab_size(self) -> int:
        """EAGLE-1 scores with the target's lm_head: the whole target vocabulary."""
        return self.vocab_size

    def resolved_aux_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        """The one feature EAGLE-1 reads: Hugging Face's `hidden_states[L]` (final-norm output)."""
        if num_target_layers < 1:
            raise ValueError(f"num_target_layers must be >= 1, got {num_target_layers}: pass the target's layer count")
        return (num_target_layers,)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "Eagle1Config":
        """Parse an EAGLE-1 config.json dict. ValueError names the key for unsupported ones."""
        arch = config.get("architectures") or [ARCHITECTURE]
        if any("eagle3" in a.lower() or "medusa" in a.lower() for a in arch):
            raise ValueError(f"architectures {arch} is not an EAGLE-1 head (a Llama config, e.g. "
                             f"{[ARCHITECTURE]}): load it with specplug.common.formats.load_head_module")
        if config.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"num_hidden_layers must be 1 for specplug's EAGLE-1 head (layers.0 only), "
                             f"got {config['num_hidden_layers']}: use a one-layer EAGLE-1 head")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**llama_fields(config, "EAGLE-1"), fc_bias=config.get("bias"),
                   qkv_bias=bool(config.get("qkv_bias", False)), specplug=config.get("specplug"),
                   extra={k: v for k, v in config.items() if k not in known and k not in _FIXED_KEYS})

    def to_dict(self) -> dict[str, Any]:
        """The EAGLE-1 config.json dict (what the EAGLE repo and the engines read)."""
        out = {"architectures": [ARCHITECTURE], "model_type": "llama", **self.extra}
        out.update(num_hidden_layers=1, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                   num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                   head_dim=self.head_dim, vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps,
                   rope_theta=self.rope_theta, rope_scaling=self.rope_scaling, hidden_act=self.hidden_act,
                   max_position_embeddings=self.max_position_embeddings)
        if self.fc_bias is not None:
            out["bias"] = self.fc_bias
        if self.qkv_bias:
            out["qkv_bias"] = True
        if self.specplug is not None:
            out["specplug"] = self.specplug
        return out

    @classmethod
    def for_target(cls, target_config: Any, **overrides) -> "Eagle1Config":
        """A head shaped like `target_config` (a transformers config or its dict), with an fc bias."""
        kwargs = llama_fields(target_config, "target")
        kwargs.pop("hidden_act")
        kwargs["fc_bias"] = True
        kwargs.update(overrides)
        return cls(**kwargs)


class Eagle1DecoderLayer(nn.Module):
    """EAGLE-1's `layers.0`: a Llama decoder layer without input_layernorm."""

    def __init__(self, config: Eagle1Config):
        super().__init__()
        self.self_attn = Eagle3Attention(config, input_size=config.hidden_size, bias=config.qkv_bias)
        self.mlp = Eagle3MLP(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, positions, attention_mask, past_kv, inv_freq):
        """x [B, T, H] (fc's output). Returns (output [B, T, H], new (k, v))."""
        attn, kv = self.self_attn(x, positions, attention_mask, past_kv, inv_freq)
        residual = attn + x
        return self.mlp(self.post_attention_layernorm(residual)) + residual, kv


class Eagle1Head(TargetEmbedding, nn.Module):
    """EAGLE-1 draft head. state_dict keys are exactly the EAGLE repo's: fc.weight [H, 2H],
    optional fc.bias [H], layers.0.self_attn.{q,k,v,o}_proj.weight (+ q/k/v bias with
    qkv_bias), layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight,
    optional embed_tokens.weight [vocab, H]. The target's lm_head (`set_target_lm_head`)
    and, without embed_tokens, its embedding (`set_target_embedding`) are kept out of the
    state_dict; `set_target(model)` sets both from a Hugging Face causal LM.

    Same interface as Eagle3Head, so Eagle3Drafter drives it: `combine` is the identity
    (the feature is the target's final hidden state), `forward` returns an Eagle3Output
    whose `normed` and `hidden` are both the output r, `to_target_ids` is the identity."""

    KIND = "EAGLE-1"

    def __init__(self, config: Eagle1Config, *, own_embedding: bool = False):
        super().__init__()
        self.config = config
        h = config.hidden_size
        if own_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias is not False)
        self.layers = nn.ModuleList([Eagle1DecoderLayer(config)])
        self.inv_freq = rope_inv_freq(config)  # float32, deliberately not a buffer (see Eagle3Head)
        self._target_embedding: list[nn.Module] = []
        self._target_lm_head: list[nn.Module] = []

    @classmethod
    def from_state_dict(cls, config: Eagle1Config, state_dict: Mapping[str, torch.Tensor], *,
                        target: nn.Module | None = None) -> "Eagle1Head":
        """Build a head from EAGLE-1 tensors with strict key checking; `fc_bias` None
        follows the tensors. `target` (a Hugging Face causal LM) is attached with set_target."""
        if config.fc_bias is None:
            config = dataclasses.replace(config, fc_bias="fc.bias" in state_dict)
        head = cls(config, own_embedding="embed_tokens.weight" in state_dict)
        load_checked(head, dict(state_dict), "EAGLE-1 head")
        if target is not None:
            head.set_target(target)
        return head

    def set_target_lm_head(self, lm_head: nn.Module) -> None:
        """The target's lm_head [vocab, H]: EAGLE-1 scores its output with it."""
        self._target_lm_head[:] = [checked_vocab_matrix(lm_head, self.config, "target lm_head")]

    def set_target(self, model: nn.Module) -> None:
        """Attach a Hugging Face causal LM's lm_head and (when the head has no
        embed_tokens) its input embedding."""
        self.set_target_lm_head(model.get_output_embeddings())
        if not hasattr(self, "embed_tokens"):
            self.set_target_embedding(model.get_input_embeddings())

    # -- the interface Eagle3Drafter uses ----------------------------------------------
    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The target's final hidden state [..., H] is the feature itself (cast to the head)."""
        return aux_hidden.to(self.fc.weight)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attention_mask: torch.Tensor,
                past_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> Eagle3Output:
        """One draft step over T inputs; arguments as Eagle3Head.forward, `hidden` [B, T, H]
        being the feature (target's final hidden state or the head's own output)."""
        x = self.fc(torch.cat([self.embed(input_ids), hidden], dim=-1))  # [B, T, H]
        out, kv = self.layers[0](x, positions, attention_mask, past_kv, self.inv_freq.to(hidden.device))
        return Eagle3Output(out, out, kv)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[..., H] -> target-vocab logits [..., vocab] through the target's lm_head."""
        if not self._target_lm_head:
            raise ValueError("this EAGLE-1 head scores with the target's lm_head: call "
                             "set_target_lm_head(target.get_output_embeddings()) or set_target(target)")
        lm_head = self._target_lm_head[0]
        return lm_head(normed.to(lm_head.weight.dtype))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """EAGLE-1 drafts in the target vocabulary: the identity."""
        return draft_ids

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        return draft_logits

