"""Weight-only int8 for draft heads (specplug.common.quantization.int8): quantization within
half a step, the kernel equal to the dequantized matmul, the EAGLE-3 roles in the
engines' fused order, and refusal where the kernel cannot run."""

from __future__ import annotations

import pytest
import torch

from specplug.common import head_section
from specplug.common.quantization import head_linears, int8


def weights(section, environ):
    """The head weights format the head section's schema settles on."""
    return head_section.parse(section, environ).settings.head_weights


def test_quantize_is_within_half_a_step_per_row():
    torch.manual_seed(0)
    w = torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different magnitude
    w[5] = 0.0  # an all-zero row keeps a positive scale
    q = int8.quantize(w)
    assert q.weight.dtype == torch.int8 and q.scale.dtype == torch.bfloat16
    assert int(q.weight.abs().max()) <= int8.QMAX
    step = q.scale.float()[:, None]
    assert bool(((int8.dequantize(q) - w).abs() <= step / 2 + 1e-3 * step).all())
    assert bool((int8.dequantize(q)[5] == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_int8_linear_equals_the_dequantized_matmul(dtype, rows):
    """Up to rounding x to bf16 (the kernel's activations), any leading shape."""
    torch.manual_seed(1)
    q = int8.quantize(torch.randn(40, 128) / 10)
    x = torch.randn(2, rows, 128, dtype=dtype)
    out = int8.int8_linear(x, q)
    assert out.shape == (2, rows, 40) and out.dtype == dtype
    expected = x.to(torch.bfloat16).float() @ int8.dequantize(q).T
    assert head_linears.relative_error(out, expected) < 1e-2


def test_int8_linear_is_close_to_the_float_layer():
    """The negative control of the engines' check: the right weight is within
    MAX_RELATIVE_ERROR of the float layer, another weight of the same shape is not."""
    torch.manual_seed(2)
    w, other = torch.randn(64, 192) / 14, torch.randn(64, 192) / 14
    x = torch.randn(3, 192)
    assert head_linears.relative_error(int8.int8_linear(x, int8.quantize(w)), x @ w.T) < int8.MAX_RELATIVE_ERROR / 2
    assert (head_linears.relative_error(int8.int8_linear(x, int8.quantize(other)), x @ w.T)
            > 10 * int8.MAX_RELATIVE_ERROR)


def _eagle3_state(hidden=64, heads=2, kv_heads=1, inter=128, vocab=96):
    torch.manual_seed(3)
    dim = hidden // heads
    shapes = {"fc.weight": (hidden, 3 * hidden), "lm_head.weight": (vocab, hidden),
              "midlayer.self_attn.q_proj.weight": (heads * dim, 2 * hidden),
              "midlayer.self_attn.k_proj.weight": (kv_heads * dim, 2 * hidden),
              "midlayer.self_attn.v_proj.weight": (kv_heads * dim, 2 * hidden),
              "midlayer.self_attn.o_proj.weight": (hidden, heads * dim),
              "midlayer.mlp.gate_proj.weight": (inter, hidden), "midlayer.mlp.up_proj.weight": (inter, hidden),
              "midlayer.mlp.down_proj.weight": (hidden, inter)}
    return {name: torch.randn(shape) for name, shape in shapes.items()}


def test_eagle3_weights_fuse_in_the_engines_order():
    """q|k|v and gate|up, stacked along the outputs as vLLM's and SGLang's fused linears
    hold them; fc stays as loaded (its outlier weights: see EAGLE3_LINEARS)."""
    state = _eagle3_state()
    weights = head_linears.eagle3_weights(state)
    assert set(weights) == {"qkv", "o", "gate_up", "down", "lm_head"}
    qkv = int8.dequantize(weights["qkv"])
    q, k = state["midlayer.self_attn.q_proj.weight"], state["midlayer.self_attn.k_proj.weight"]
    assert qkv.shape == (q.shape[0] + 2 * k.shape[0], q.shape[1])
    assert torch.allclose(qkv[:q.shape[0]], q, atol=0.02)
    assert torch.allclose(qkv[q.shape[0]:q.shape[0] + k.shape[0]], k, atol=0.02)
    gate_up = int8.dequantize(weights["gate_up"])
    assert torch.allclose(gate_up[128:], state["midlayer.mlp.up_proj.weight"], atol=0.02)


def test_eagle3_weights_name_what_is_missing():
    state = _eagle3_state()
    del state["midlayer.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="up_proj.*formats.load_head"):
        head_linears.eagle3_weights(state)


def test_unsupported_reasons():
    assert int8.unsupported_reason(torch.bfloat16) is None
    assert int8.unsupported_reason(torch.float32, "cpu", [576, 1152]) is None
    assert "CPU only" in int8.unsupported_reason(torch.bfloat16, "cuda")
    assert "bf16 or fp32" in int8.unsupported_reason(torch.float16)
    # the kernel reads K in blocks and crashed on K = 24 and 40: refused before it runs
    assert "multiples of 64" in int8.unsupported_reason(torch.float32, "cpu", [576, 40])


def _head(hidden=64, seed=0):
    from specplug.common.heads import Eagle3Config, Eagle3Head

    torch.manual_seed(seed)
    config = Eagle3Config(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=2,
                          num_key_value_heads=1, vocab_size=100, draft_vocab_size=48, target_hidden_size=hidden)
    head = Eagle3Head(config, own_embedding=True).eval()
    for p in head.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.5, 1.5)
    return head


def _logits(head):
    torch.manual_seed(9)
    ids, hidden = torch.randint(0, 100, (1, 5)), torch.randn(1, 5, head.config.hidden_size)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        return head.compute_logits(head(ids, hidden, torch.arange(5)[None], mask).normed)


def test_swap_linears_runs_specplugs_own_head_in_int8():
    """SGLang's SPECPLUG_EAGLE3 path: the head's linears after fc become QuantLinear, its
    logits stay within a few percent, fc stays as loaded."""
    head = _head()
    before = _logits(head)
    assert head_linears.swap_linears(head, head_linears.EAGLE3_MODULES) is None
    assert isinstance(head.lm_head, head_linears.QuantLinear)
    assert isinstance(head.midlayer.mlp.up_proj, head_linears.QuantLinear)
    assert isinstance(head.fc, torch.nn.Linear)
    assert head_linears.relative_error(_logits(head), before) < 0.03


def test_swap_linears_refuses_and_changes_nothing():
    narrow = _head(hidden=32)  # K = 32: the kernel's block rule
    assert "multiples of 64" in head_linears.swap_linears(narrow, head_linears.EAGLE3_MODULES)
    assert not any(isinstance(m, head_linears.QuantLinear) for m in narrow.modules())


def test_swap_linears_refuses_fc_like_outlier_rows():
    """One huge weight per row (as in an EAGLE-3 fc) leaves the other K - 1 a level or
    two: ~sqrt(K) / (127 * sqrt(12)) relative error, 15% at K = 4096. Refused, the
    module unchanged."""
    torch.manual_seed(4)
    module = torch.nn.Module()
    module.first = torch.nn.Linear(128, 64, bias=False)  # fine on its own
    module.proj = torch.nn.Linear(4096, 16, bias=False)
    module.proj.weight.data[:, 0] = 10.0
    reason = head_linears.swap_linears(module, ["first", "proj"])
    assert reason is not None and "proj" in reason and "outlier" in reason
    assert type(module.first) is torch.nn.Linear and type(module.proj) is torch.nn.Linear


def test_swap_linears_checks_the_weights_not_the_bias():
    """A linear with a bias (e.g. a Qwen head's qkv) is checked on its weights, as the
    int8 kernel runs them (QuantLinear adds the same bias after): swapped, same outputs."""
    torch.manual_seed(5)
    module = torch.nn.Module()
    module.qkv = torch.nn.Linear(128, 64, bias=True)
    module.qkv.bias.data.fill_(3.0)  # large next to x @ W.T: a check that left it out would refuse
    x = torch.randn(4, 128)
    with torch.no_grad():
        before = module.qkv(x)
    assert head_linears.swap_linears(module, ["qkv"]) is None
    assert isinstance(module.qkv, head_linears.QuantLinear)
    with torch.no_grad():
        assert head_linears.relative_error(module.qkv(x), before) < int8.MAX_RELATIVE_ERROR


def test_head_int8_is_the_older_switch_for_int8_head_weights():
    assert weights({}, {}) == "float"
    assert weights({"head_int8": True}, {}) == "int8"
    assert weights({"head_int8": True}, {head_section.ENV_HEAD_INT8: "0"}) == "float"
    assert weights({}, {head_section.ENV_HEAD_INT8: "1"}) == "int8"
    with pytest.raises(ValueError, match=head_section.ENV_HEAD_INT8):
        weights({}, {head_section.ENV_HEAD_INT8: "maybe"})
