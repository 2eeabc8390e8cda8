"""The frozen target of `specplug train`: loading it, one forward pass over a batch, and
its states as the losses read them (`TargetOutput`, live or from the cached states).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specplug.common.training.samples import Batch


class TargetOutput(NamedTuple):
    """The frozen target's states for a batch: from a live pass (`target_pass`, logits
    given) or from cached states (`states`: logits None, top1 and lm_head given).
    Losses read scores through `scores` / `argmax`, which agree on both: the cached view
    computes only the vocab columns asked for, from the cached last hidden state."""

    last_hidden: torch.Tensor  # [B, T, H] after the final norm (what the lm_head reads)
    logits: torch.Tensor | None  # [B, T, V] float32: position t scores token t + 1
    aux: torch.Tensor | None  # [B, T, 3H] concatenated aux hidden states (EAGLE-3), else None
    top1: torch.Tensor | None = None  # [B, T] the target's full-vocab argmax (cached states)
    lm_head: torch.nn.Module | None = None  # the target's output layer (cached states)

    def scores(self, columns: torch.Tensor | None = None) -> torch.Tensor:
        """float32 target logits [B, T, V], or [B, T, len(columns)] for those vocab ids only."""
        if self.logits is not None:
            return self.logits if columns is None else self.logits[..., columns]
        weight, bias = self.lm_head.weight, getattr(self.lm_head, "bias", None)
        if columns is not None:
            weight, bias = weight[columns], (bias[columns] if bias is not None else None)
        return torch.nn.functional.linear(self.last_hidden.to(weight.dtype), weight, bias).float()

    def argmax(self) -> torch.Tensor:
        """The target's top-1 token id at each position over its full vocab: [B, T]."""
        return self.top1 if self.top1 is not None else self.logits.argmax(-1)


@torch.no_grad()
def target_pass(target, batch: Batch, aux_layer_ids: tuple[int, ...] | None = None) -> TargetOutput:
    """One frozen forward of the target. Aux id i is `hidden_states[i]` (input of layer i)."""
    out = target.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                            output_hidden_states=aux_layer_ids is not None, use_cache=False)
    last = out.last_hidden_state
    logits = target.get_output_embeddings()(last).float()
    aux = torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
    return TargetOutput(last, logits, aux)


def load_target(path: str, device: str = "cpu"):
    """The target in fp32 (CPU) or bf16 (GPU), frozen, in eval mode, with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    target.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"--target {path}: its tokenizer has no chat_template; training formats "
                         "conversations with it: use an instruct/chat model or add a template")
    return target, tokenizer
