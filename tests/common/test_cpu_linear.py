"""specplug.common.cpu_linear: packed oneDNN linears equal F.linear, packed once; the
setting is checked."""

from types import SimpleNamespace

import pytest
import torch

from specplug.common import cpu_linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 3, 9])
def test_packed_linear_equals_f_linear(rows):
    torch.manual_seed(rows)
    layer = SimpleNamespace(weight=torch.randn(96, 64))
    x, bias = torch.randn(2, rows, 64), torch.randn(96)
    torch.testing.assert_close(cpu_linear.packed_linear(layer, x, bias),
                               torch.nn.functional.linear(x, layer.weight, bias), rtol=1e-5, atol=1e-5)
    assert cpu_linear.PACKED in vars(layer)  # packed once, reused


def test_the_setting_is_checked():
    assert not cpu_linear.enabled({}) and cpu_linear.enabled({cpu_linear.ENV: "onednn"})
    with pytest.raises(ValueError, match="SPECPLUG_SGLANG_CPU_LINEAR must be 'onednn' or unset"):
        cpu_linear.enabled({cpu_linear.ENV: "mkl"})
