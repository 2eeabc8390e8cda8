"""Stage "tree" on a platform other than vLLM-CPU is refused at start-up with one message
saying what is proven for GPUs (the attention kernel, under Triton's interpreter), what is not,
and the fix, before anything of vLLM's CPU attention backend is
imported (on a GPU build that import may fail and would surface as an ImportError)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from vllm.platforms import current_platform  # noqa: E402

from specplug.vllm_eagle3 import tree_platform  # noqa: E402

pytestmark = pytest.mark.vllm
CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"


@pytest.fixture
def cpu_attention_unimportable(monkeypatch):
    """vLLM's CPU attention module cannot be imported (as on a build without it)."""
    import vllm.v1.attention.backends as backends

    monkeypatch.delattr(backends, "cpu_attn", raising=False)
    monkeypatch.setitem(sys.modules, CPU_ATTN, None)


def test_a_gpu_platform_is_refused_before_the_cpu_backend_is_imported(monkeypatch, cpu_attention_unimportable):
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    with pytest.raises(RuntimeError, match=r"runs on vLLM-CPU only: for GPUs only its tree attention") as refused:
        tree_platform.check_platform(SimpleNamespace())
    message = str(refused.value)  # what is proven, what is not, the fix
    assert "proven, under Triton's interpreter on CPU" in message
    assert "KV compaction on GPU buffers and the hook into vLLM's GPU attention backends are not" in message
    assert message.endswith("use stage \"chain\" (\"stage\": \"chain\" in the head's specplug section, or "
                            "SPECPLUG_STAGE=chain)")


def test_on_vllm_cpu_the_layout_check_does_read_the_cpu_backend(monkeypatch, cpu_attention_unimportable):
    """Negative control: past the platform check, the blocked import is reached."""
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    with pytest.raises(ImportError):
        tree_platform.check_platform(SimpleNamespace())


def test_other_stages_are_not_checked(monkeypatch, cpu_attention_unimportable):
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    tree_platform.check_platform(SimpleNamespace(), "chain")


def test_importing_the_check_imports_no_cpu_attention():
    code = ("import sys, specplug.vllm_eagle3.tree_platform, specplug.vllm_eagle3.proposer; "
            f"print({CPU_ATTN!r} in sys.modules, 'specplug.vllm_eagle3.tree_attention' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.split()[-2:] == ["False", "False"], out.stdout + out.stderr
