"""specplug's SGLang algorithms check their server arguments' attention backends where the
device is known (spec._check_backend; the allow-lists and their tests are the core's:
specplug.common.sglang_backends, tests/common/test_sglang_backends.py)."""

from types import SimpleNamespace

import pytest

from specplug.sglang_medusa import spec


def test_server_arguments_are_checked_where_the_device_is_known():
    args = dict(attention_backend="flashinfer", prefill_attention_backend=None, decode_attention_backend=None,
                enable_dp_attention=False, pp_size=1)
    with pytest.raises(ValueError, match="MEDUSA on cuda verifies trees only with the attention backends proven to "
                                         r"read its tree mask \(triton, torch_native\), got --attention-backend "
                                         "flashinfer: pass --attention-backend triton or --attention-backend "
                                         "torch_native$"):
        spec._check_backend(SimpleNamespace(device="cuda", **args))
    spec._check_backend(SimpleNamespace(device=None, **args))  # auto-detected: the worker checks it at start-up
