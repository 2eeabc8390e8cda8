"""The MEDUSA worker's target distribution p is SGLang's own: process_logits(order=
"sglang") keeps exactly what SGLang's torch sampler keeps, with the same weights, for
every mix of top-k, top-p and min-p (vLLM's order, the negative control, does not)."""

import pytest
import torch

pytest.importorskip("sglang", reason="needs the SGLang environment: bash scripts/test.sh sglang")

from specplug.common.target_probs import process_logits


def sglang_p(logits, top_k, top_p, min_p):
    """SGLang's filtered distribution, read from its sampler (return_filtered_probs)."""
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

    probs = torch.softmax(logits, -1)
    rows = logits.shape[0]
    _, kept, index, _ = top_k_top_p_min_p_sampling_from_probs_torch(
        probs.clone(), torch.full((rows,), top_k), torch.full((rows,), top_p), torch.full((rows,), min_p),
        need_min_p_sampling=min_p > 0, sampling_seed=None, positions=None, return_filtered_probs=True)
    p = torch.zeros_like(probs).scatter_(-1, index.long(), kept)
    return p / p.sum(-1, keepdim=True)


@pytest.mark.parametrize("top_k,top_p,min_p", [(20, 1.0, 0.0), (1 << 30, 0.8, 0.0), (5, 0.5, 0.0),
                                               (1 << 30, 0.9, 0.05), (8, 0.7, 0.1), (3, 1.0, 0.2)])
def test_process_logits_sglang_order_is_sglangs_sampler(top_k, top_p, min_p):
    torch.manual_seed(0)
    logits = torch.randn(64, 200) * 2.5
    ours = process_logits(logits, top_k=top_k, top_p=top_p, min_p=min_p, order="sglang")
    torch.testing.assert_close(ours, sglang_p(logits, top_k, top_p, min_p), atol=1e-5, rtol=1e-4)


def test_vllm_order_differs_from_sglangs_sampler():
    """Negative control: with top-k and top-p together vLLM's filter keeps other tokens."""
    torch.manual_seed(0)
    logits = torch.randn(64, 200) * 2.5
    vllm = process_logits(logits, top_k=5, top_p=0.5, min_p=0.0)
    assert not torch.allclose(vllm, sglang_p(logits, 5, 0.5, 0.0), atol=1e-3)
