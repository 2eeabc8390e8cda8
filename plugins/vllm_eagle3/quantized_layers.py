"""An EAGLE-3 head's own linears in vLLM with the int8 / int4 weights of its "head_weights"
setting (specplug.common.quantization): vLLM's layers keep their modules, and each layer's
quant_method becomes one that runs the quantized weight (instance patches
"linear.quant_method" and "lm_head.quant_method" in patches.py), all or none, each first
checked against the layer it replaces. Never a layer the target also runs.
"""

from __future__ import annotations

from specplug.common.quantization import head_linears
from specplug.vllm_eagle3.patches import LINEAR_QUANT_METHOD, LM_HEAD_QUANT_METHOD, PATCHES


class _QuantMethod:
    """vLLM's linear-method interface (`apply(layer, x, bias)`, what every vLLM linear
    and the logits processor call) over a core int8 or int4 weight; anything else vLLM
    reads off a layer's quant_method comes from the method it replaced."""

    def __init__(self, weight, replaced):
        self.weight, self.replaced = weight, replaced

    def apply(self, layer, x, bias=None):
        out = self.weight.apply(x)
        return out if bias is None else out + bias

    def __getattr__(self, name):
        return getattr(self.replaced, name)


def eagle3_linears(model) -> dict:
    """The vLLM EAGLE-3 draft model's linear modules by role (head_linears.EAGLE3_LINEARS)."""
    layer = model.model.layers[0]
    return {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj,
            "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj, "lm_head": model.lm_head}


def use_quantized_weights(model, state, fmt: str = "int8", target_model=None) -> str | None:
    """Run the EAGLE-3 draft model's linears after fc with weights of format `fmt` ("int8"
    or "int4") quantized from the head's canonical state dict (vLLM-CPU keeps only its
    packed weights). Never a layer the target also runs (vLLM shares the target's lm_head
    with a head that has none): that would change the target's logits. Each is first
    checked against the layer it replaces on random rows; on any mismatch (or where the
    format cannot run) nothing changes. Returns None when swapped, else why not."""
    modules = eagle3_linears(model)
    ranks = max(getattr(module, "tp_size", 1) for module in modules.values())
    if ranks > 1:
        return f"the head's linears are sharded over {ranks} tensor-parallel ranks; {fmt} weights run on one rank"
    patches = {role: LM_HEAD_QUANT_METHOD if role == "lm_head" else LINEAR_QUANT_METHOD for role in modules}
    refused = next(filter(None, (PATCHES.instance_refusal(patches[r], m) for r, m in modules.items())), None)
    if refused is not None:
        return refused
    if target_model is not None:
        targets = {id(m) for m in target_model.modules()}
        shared = [role for role, module in modules.items() if id(module) in targets]
        if shared:
            return f"the head shares {shared} with the target, whose outputs {fmt} must not touch"
    norm = model.model.layers[0].input_layernorm.weight  # norms are never packed
    dtype = norm.dtype
    try:
        weights = head_linears.eagle3_weights(state, fmt, dtype, norm.device)
    except ValueError as exc:  # e.g. a checkpoint without its own lm_head, or widths the format cannot take
        return str(exc)
    return head_linears.swap_checked({role: lambda x, m=m: m.quant_method.apply(m, x) for role, m in modules.items()},
                                     weights, dtype, lambda role, w: PATCHES.on(patches[role], modules[role], w))


def quantized_method(replaced, weight) -> _QuantMethod:
    """A layer's quant_method with `weight` (instance patches linear.quant_method and
    lm_head.quant_method in patches.py)."""
    return _QuantMethod(weight, replaced)

