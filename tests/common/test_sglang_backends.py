"""Which attention backends specplug's SGLang workers accept for tree verification
(sglang_backends.check_attention_backends), and which mask layout they hand each
(sglang_backends.prefix_masks_needed): refusals checked with made-up devices and backends."""

from types import SimpleNamespace

import pytest

from specplug.common import sglang_backends as ab

GPU = "cuda"


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
def test_proven_backends_start_on_a_gpu(backend):
    ab.check_attention_backends(GPU, {"--attention-backend": backend, "--decode-attention-backend": None})


@pytest.mark.parametrize("option", ["--attention-backend", "--prefill-attention-backend", "--decode-attention-backend"])
@pytest.mark.parametrize("backend", ["flashinfer", "fa3", "trtllm_mha"])
def test_unproven_gpu_backends_are_refused_by_name(option, backend):
    backends = {"--attention-backend": "triton", option: backend}
    with pytest.raises(ValueError) as refused:
        ab.check_attention_backends(GPU, backends, "MEDUSA")
    message = str(refused.value)
    assert "MEDUSA on cuda" in message and f"got {option} {backend}" in message
    assert "pass --attention-backend triton or --attention-backend torch_native" in message
    assert ("drop --prefill-attention-backend" in message) == (option != "--attention-backend")


def test_cpu_accepts_torch_native_only():
    ab.check_attention_backends("cpu", {"--attention-backend": "torch_native", "--prefill-attention-backend": None})
    with pytest.raises(ValueError, match="RETRIEVAL on cpu .* got --attention-backend triton: pass --attention-backend "
                                         "torch_native$"):
        ab.check_attention_backends("cpu", {"--attention-backend": "triton"}, "RETRIEVAL")


def test_server_arguments_are_named_as_sglang_spells_them():
    args = SimpleNamespace(attention_backend="flashinfer", prefill_attention_backend=None)
    assert ab.server_attention_backends(args) == {
        "--attention-backend": "flashinfer", "--prefill-attention-backend": None, "--decode-attention-backend": None}


def test_mask_layout_follows_the_backend(monkeypatch):
    monkeypatch.delenv(ab.ENV_PREFIX_MASKS, raising=False)
    assert not ab.prefix_masks_needed({"--attention-backend": "torch_native", "--decode-attention-backend": None})
    assert ab.prefix_masks_needed({"--attention-backend": "triton"})
    assert ab.prefix_masks_needed({"--attention-backend": "torch_native", "--decode-attention-backend": "triton"})
    monkeypatch.setenv(ab.ENV_PREFIX_MASKS, "1")
    assert ab.prefix_masks_needed({"--attention-backend": "torch_native"})
