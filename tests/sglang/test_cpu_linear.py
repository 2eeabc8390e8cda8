"""SPECPLUG_SGLANG_CPU_LINEAR=onednn: the hooks take over only what they should, and a
RETRIEVAL engine with them matches SGLang with them (greedy); packed_linear itself is tested
in tests/common/test_cpu_linear.py."""

from types import SimpleNamespace

import torch

from specplug.sglang_medusa import cpu_linear
from tests.sglang.conftest import GREEDY, PROMPTS, assert_greedy_matches, greedy_run, sglang_engine


def test_only_plain_fp32_cpu_calls_are_taken_over():
    calls = []

    def original(method, layer, x, bias=None):
        calls.append(layer)
        return torch.zeros(1)

    fp32 = SimpleNamespace(weight=torch.randn(8, 4))
    amx = SimpleNamespace(weight=torch.randn(8, 4), use_intel_amx_backend=True)
    bf16 = SimpleNamespace(weight=torch.randn(8, 4, dtype=torch.bfloat16))
    assert cpu_linear.linear_apply(original, None, fp32, torch.randn(3, 4)).shape == (3, 8)
    cpu_linear.linear_apply(original, None, amx, torch.randn(3, 4))
    cpu_linear.linear_apply(original, None, bf16, torch.randn(3, 4, dtype=torch.bfloat16))
    assert calls == [amx, bf16]


def test_retrieval_with_onednn_linears_matches_no_speculation_with_them(sgl_model, monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV, "onednn")  # read by the plugin in SGLang's scheduler processes
    with sglang_engine(sgl_model) as engine:
        base = greedy_run(engine, PROMPTS, GREEDY)
    with sglang_engine(sgl_model, speculative_algorithm="RETRIEVAL") as engine:
        run = greedy_run(engine, PROMPTS, GREEDY)
    assert assert_greedy_matches(run["ids"], base["ids"], base["gaps"]) == 0
    assert sum(m["spec_num_correct_drafts"] for m in run["meta"]) > 0
