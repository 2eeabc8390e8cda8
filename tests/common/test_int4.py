"""Weight-only int4 for draft heads (specplug.common.quantization.int4): quantization within
half a step of each group, the kernel equal to the dequantized matmul, a check that
tells the right weights from others, refusal where the kernel cannot run, the swap of
specplug's own head, and the section's "head_weights"."""

from __future__ import annotations

import pytest
import torch

from specplug.common import head_section
from specplug.common.quantization import head_linears, int4
from tests.common.test_int8 import _head, _logits, weights


def test_quantize_is_within_half_a_step_per_group():
    torch.manual_seed(0)
    w = torch.randn(32, 256) * torch.logspace(-3, 1, 32)[:, None]  # rows of very different magnitude
    w[:, 64:128] += 5.0  # one group far from zero: its zero point carries it
    w[7] = 0.0  # an all-zero row keeps a positive scale
    q = int4.quantize(w)
    assert q.shape == (32, 256) and q.scales_zeros.shape == (256 // int4.GROUP, 32, 2)
    scale = q.scales_zeros[..., 0].float().repeat_interleave(int4.GROUP, 0).T  # [N, K]
    zero = q.scales_zeros[..., 1].float().repeat_interleave(int4.GROUP, 0).T
    slack = zero.abs() * 2 ** -8  # the zero point's bf16 rounding
    assert bool(((int4.dequantize(w) - w).abs() <= scale / 2 + slack + 1e-6).all())
    assert bool((int4.dequantize(w)[7].abs() < 1e-6).all())
    x = torch.randn(5, 256)
    assert head_linears.relative_error(q.apply(x), x.to(torch.bfloat16).float() @ int4.dequantize(w).T) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 300])
def test_int4_linear_equals_the_dequantized_matmul(dtype, rows):
    """Up to rounding x and the output to bf16, any leading shape (300 rows: a prompt's catch-up)."""
    torch.manual_seed(1)
    w = torch.randn(48, 128) / 10
    x = torch.randn(2, rows, 128, dtype=dtype)
    out = int4.quantize(w).apply(x)
    assert out.shape == (2, rows, 48) and out.dtype == dtype
    expected = x.to(torch.bfloat16).float() @ int4.dequantize(w).T
    assert head_linears.relative_error(out, expected) < 1e-2


def test_the_check_tells_the_right_weights_from_others():
    """The engines' check (head_linears.mismatch) with int4's own tolerance: the right weight is
    within it, another weight of the same shape is far outside (negative control)."""
    torch.manual_seed(2)
    w, other = torch.randn(64, 192) / 14, torch.randn(64, 192) / 14
    assert head_linears.mismatch("w", int4.quantize(w), lambda x: x @ w.T, torch.float32) is None
    reason = head_linears.mismatch("w", int4.quantize(other), lambda x: x @ w.T, torch.float32)
    assert reason is not None and "not the same weights" in reason


def test_unsupported_reasons():
    assert int4.unsupported_reason(torch.bfloat16, "cpu", [(960, 576), (8192, 576)]) is None
    assert "CPU only" in int4.unsupported_reason(torch.bfloat16, "cuda")
    assert "bf16 or fp32" in int4.unsupported_reason(torch.float16)
    assert "multiples of 64" in int4.unsupported_reason(torch.float32, "cpu", [(64, 96)])
    assert "multiples of 16" in int4.unsupported_reason(torch.float32, "cpu", [(100, 64)])  # torch's packing refuses it


def test_eagle3_weights_refuse_widths_the_int4_packing_cannot_take():
    """The vLLM path quantizes a checkpoint's linears: an output width torch's int4
    packing refuses (it raises, which at load time would stop the server) is a ValueError
    with the reason before anything is quantized; the same state in int8 quantizes."""
    from tests.common.test_int8 import _eagle3_state

    state = _eagle3_state(vocab=100)  # lm_head N = 100: not a multiple of 16
    with pytest.raises(ValueError, match="multiples of 16"):
        head_linears.eagle3_weights(state, "int4")
    assert head_linears.eagle3_weights(state, "int8")["lm_head"].shape == (100, 64)
    assert isinstance(head_linears.eagle3_weights(_eagle3_state(), "int4")["lm_head"], int4.Int4Weight)


def test_swap_linears_runs_specplugs_own_head_in_int4():
    """SGLang's SPECPLUG_EAGLE3 path with "head_weights": "int4": the head's linears after
    fc carry int4 weights and compute what the same head with the dequantized weights
    computes (this random head's logits move ~40% from int4's error itself), fc stays as
    loaded; a head whose widths the kernel refuses is left as it was."""
    head, reference = _head(), _head()
    with torch.no_grad():
        for name in head_linears.EAGLE3_MODULES:
            linear = reference.get_submodule(name)
            linear.weight.copy_(int4.dequantize(linear.weight))
    assert head_linears.swap_linears(head, head_linears.EAGLE3_MODULES, "int4") is None
    assert isinstance(head.lm_head.quantized, int4.Int4Weight)
    assert isinstance(head.fc, torch.nn.Linear)
    assert head_linears.relative_error(_logits(head), _logits(reference)) < 0.03
    narrow = _head(hidden=32)
    assert "multiples of 64" in head_linears.swap_linears(narrow, head_linears.EAGLE3_MODULES, "int4")
    assert not any(isinstance(m, head_linears.QuantLinear) for m in narrow.modules())


def test_head_weights_setting():
    assert weights({}, {}) == "float"
    assert weights({"head_int8": True}, {}) == "int8"
    assert weights({"head_weights": "int4"}, {}) == "int4"
    assert weights({"head_weights": "int4", "head_int8": True}, {}) == "int4"
    assert weights({"head_weights": "int4"}, {head_section.ENV_HEAD_WEIGHTS: "float"}) == "float"
    # the older switch
    assert weights({"head_weights": "int4"}, {head_section.ENV_HEAD_INT8: "1"}) == "int8"
    with pytest.raises(ValueError, match="head_weights"):
        weights({"head_weights": "fp8"}, {})
    with pytest.raises(ValueError, match=head_section.ENV_HEAD_WEIGHTS):
        weights({}, {head_section.ENV_HEAD_WEIGHTS: "int3"})
