"""Opt-in (SPECPLUG_SGLANG_CPU_LINEAR=onednn): two AROUND hooks (patches.py), in every SGLang
process, that send fp32 CPU calls of SGLang's linear layers and LM head without AMX packing,
quantization or LoRA through specplug.common.cpu_linear.packed_linear; every other call runs
SGLang's own code."""

from __future__ import annotations

import logging
import os

from specplug.common.cpu_linear import ENV, eligible, enabled, not_installed_reason, packed_linear
from specplug.sglang_medusa.patches import LINEAR_APPLY, LM_HEAD

logger = logging.getLogger(__name__)

LINEAR_TARGET, LM_HEAD_TARGET = LINEAR_APPLY, LM_HEAD  # hooked AROUND (patches.py)


def linear_apply(original, method, layer, x, bias=None, *args, **kwargs):
    """AROUND UnquantizedLinearMethod.apply: eligible fp32 CPU calls through packed_linear."""
    if args or kwargs or not eligible(layer, x):
        return original(method, layer, x, bias, *args, **kwargs)
    return packed_linear(layer, x, bias)


def lm_head_logits(original, processor, hidden_states, lm_head, embedding_bias=None, *args, **kwargs):
    """AROUND LogitsProcessor._compute_lm_head: where SGLang would run its plain
    `hidden @ weight.T` on fp32 CPU tensors, packed_linear instead."""
    from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method

    plain = (hasattr(lm_head, "weight") and not hasattr(lm_head, "set_lora")
             and not should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None))
             and not getattr(processor, "use_fp32_lm_head", False)
             and getattr(processor, "rl_on_policy_target", None) is None)
    if (args or kwargs.keys() - {"out"} or embedding_bias is not None or not plain
            or not eligible(lm_head, hidden_states)):
        return original(processor, hidden_states, lm_head, embedding_bias, *args, **kwargs)
    return packed_linear(lm_head, hidden_states)


def announce(installed: bool, environ=os.environ) -> None:
    """One log line once register() applied (or not) the hooks: INFO when installed, a
    WARNING when asked for and not installed."""
    if installed:
        logger.info("specplug: %s=onednn: fp32 CPU linear layers and LM head through oneDNN with packed weights",
                    ENV)
    elif enabled(environ):
        logger.warning("specplug: %s=onednn ignored: %s", ENV, not_installed_reason(environ)
                       or "SGLang's linear methods are not the ones specplug hooks (see the WARNING above)")
