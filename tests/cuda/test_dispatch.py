"""try_verify's decisions without a GPU: when the torch path runs, that it says why in
one INFO line, that a failed build never raises, and how the schedule is chosen."""

from __future__ import annotations

import inspect
import logging
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specplug.common import sampling as S
from specplug.common.cuda import build, dispatch, try_verify
from tests.cuda.cases import dyadic_probs, flatten, plant, random_trees, sample_rows
from tests.cuda.emulate import EmulatedExtension, build_emulator

LOGGER = "specplug.common.cuda.dispatch"


@pytest.fixture(autouse=True)
def fresh_log_cache():
    dispatch._announce.cache_clear()
    yield
    dispatch._announce.cache_clear()


def small_inputs(batch=2, nodes=3, vocab=10, dtype=torch.float32):
    candidates = torch.zeros(batch, nodes, dtype=torch.long)
    parents = torch.tensor([[-1] + list(range(nodes - 1))] * batch)
    probs = torch.full((batch, nodes, vocab), 1.0 / vocab, dtype=dtype)
    return candidates, parents, probs


def test_cpu_tensors_take_the_torch_path_with_one_log_line(caplog):
    cand, par, p = small_inputs()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(3):
            assert try_verify(cand, par, p, method="greedy") is None
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines == ["specplug verify: torch path (tensors are on cpu, the kernel needs CUDA)"]


def test_cpu_never_tries_to_build(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("load_extension must not run for CPU tensors")

    monkeypatch.setattr(dispatch, "load_extension", boom)
    cand, par, p = small_inputs()
    assert try_verify(cand, par, p, method="rejection", uniforms=torch.rand(2, 4)) is None
    result = S.verify(cand, par, p, method="rejection", uniforms=torch.rand(2, 4))
    assert result.num_accepted.shape == (2,)


def test_switch_disables_the_kernel(monkeypatch):
    monkeypatch.setenv(dispatch.DISABLE_ENV, "0")
    cand, par, p = small_inputs()
    assert dispatch.unsupported_reason(cand, par, p, None, "greedy", None, None) == "disabled by SPECPLUG_CUDA=0"


def _reason(method="greedy", dtype=torch.float32, nodes=3, vocab=10, flat=False, num_nodes=None,
            uniforms=None, draft=None):
    cand, par, p = small_inputs(nodes=nodes, vocab=vocab, dtype=dtype)
    if flat:
        p = p.reshape(-1, vocab)
    return dispatch.input_reason(cand, par, p, draft, method, num_nodes, uniforms)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(), None),
        (dict(method="rejection", uniforms=torch.rand(2, 4)), None),
        (dict(method="typical"), "method 'typical' has no kernel"),
        (dict(method="coupled", uniforms=torch.rand(2, 4)), None),
        (dict(method="coupled"), "no uniforms given"),
        (dict(method="coupled", uniforms=torch.rand(2, 4), draft=torch.rand(2, 3, 10)),
         "method 'coupled' has no kernel"),  # drafts drawn from q are verified by "rejection"
        (dict(dtype=torch.float64), "dtype torch.float64 has no kernel"),
        (dict(nodes=1025), "exceed the kernel's limits"),
        (dict(vocab=262145), "exceed the kernel's limits"),
        (dict(flat=True), "flattened target_probs without num_nodes"),
        (dict(flat=True, num_nodes=torch.tensor([3, 3])), None),
        (dict(method="rejection"), "no uniforms given"),
        (dict(method="rejection", uniforms=torch.rand(2, 4, dtype=torch.float64)), "uniforms are torch.float64"),
        (dict(method="rejection", uniforms=torch.rand(2, 4), draft=torch.rand(2, 3, 10).double()),
         "draft_probs differs from target_probs"),
        (dict(method="rejection", uniforms=torch.rand(2, 4), draft=torch.rand(2, 3, 10)), None),
    ],
)
def test_input_reasons(kwargs, expected):
    reason = _reason(**kwargs)
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and expected in reason


def test_misaligned_draft_rows_are_declined():
    cand, par, p = small_inputs(vocab=16)
    q = torch.rand(2 * 3 * 16 + 1)[1:].view(2, 3, 16)  # 4 bytes off p's alignment
    assert (q.data_ptr() - p.data_ptr()) % 16
    assert "aligned" in dispatch.input_reason(cand, par, p, q, "rejection", None, torch.rand(2, 4))


def fresh_build() -> build.Build:
    """load_extension() outside its per-process cache (the cache is cleared again after)."""
    build.load_extension.cache_clear()
    try:
        return build.load_extension()
    finally:
        build.load_extension.cache_clear()


def test_failed_build_is_reported_not_raised(monkeypatch):
    from torch.utils import cpp_extension

    def failing_load(*a, **k):
        raise RuntimeError("Error building extension 'specplug_verify_v1': nvcc exploded")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setattr(cpp_extension, "load", failing_load)
    result = fresh_build()
    assert result.module is None
    assert result.error.startswith("RuntimeError: Error building extension")


def test_no_gpu_build_says_why(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the build is exercised by test_parity.py")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    result = fresh_build()
    assert result.module is None
    assert "without CUDA" in result.error or "sees no CUDA device" in result.error


def test_schedule_choice(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    monkeypatch.delenv(dispatch.MODE_ENV, raising=False)
    rows, path = dispatch.MODE_CODES["rows"], dispatch.MODE_CODES["path"]
    greedy, draft = dispatch.METHOD_CODES["greedy"], dispatch.METHOD_CODES["draft_rejection"]
    mode, splits = dispatch.schedule(greedy, 1, 8, 128256, 2, "cuda")
    assert mode == rows and splits == 15  # wants 4 x 132 / 8 = 66, but parts stay >= 16 KB
    assert dispatch.schedule(greedy, 1, 8, 1000, 2, "cuda") == (rows, 1)  # a row too small to split
    assert dispatch.schedule(greedy, 64, 64, 128256, 2, "cuda") == (path, 1)
    assert dispatch.schedule(draft, 1, 8, 128256, 2, "cuda") == (path, 1)
    monkeypatch.setenv(dispatch.MODE_ENV, "rows")  # "coupled" has no "rows" form, whatever is asked
    assert dispatch.schedule(dispatch.METHOD_CODES["coupled"], 1, 8, 128256, 2, "cuda") == (path, 1)
    monkeypatch.setenv(dispatch.MODE_ENV, "path")
    assert dispatch.schedule(greedy, 1, 8, 128256, 2, "cuda") == (path, 1)


def test_sources_ship_with_the_package():
    for name in build.SOURCES + build.HEADERS:
        assert (build.SOURCE_DIR / name).is_file(), name
    assert build.SOURCE_DIR == Path(dispatch.__file__).resolve().parent


def test_limits_match_the_header():
    header = (build.SOURCE_DIR / "verify.h").read_text()
    assert f"SPECPLUG_MAX_NODES = {dispatch.MAX_NODES}" in header
    assert f"SPECPLUG_MAX_VOCAB = {dispatch.MAX_VOCAB}" in header


def test_the_stand_in_has_the_bindings_argument_names():
    names = re.findall(r'py::arg\("(\w+)"\)', (build.SOURCE_DIR / "verify_binding.cpp").read_text())
    verify = list(inspect.signature(EmulatedExtension.verify).parameters)[1:]
    workspace = list(inspect.signature(EmulatedExtension.workspace_bytes).parameters)
    assert names == verify + workspace


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="the CPU emulator needs g++")
def test_launch_end_to_end_through_the_binding_interface(monkeypatch, tmp_path):
    """dispatch.launch -> (binding's named arguments) -> emulated kernel == sampling.verify,
    for each rule, both layouts and both schedules."""
    ext = EmulatedExtension(build_emulator(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=2))
    monkeypatch.setattr(dispatch, "_stream_handle", lambda device: 0)
    gen = torch.Generator().manual_seed(21)
    trees = random_trees(gen, 4, 9, 301)
    logits = torch.randn(4, 9, 301, generator=gen) * 6
    p = dyadic_probs(logits, torch.float32)
    q = dyadic_probs(logits + torch.randn(4, 9, 301, generator=gen), torch.float32)
    trees = plant(gen, trees, sample_rows(gen, q), rate=0.8)
    u = torch.rand(4, 10, generator=gen)
    for mode in ("rows", "path"):
        monkeypatch.setenv(dispatch.MODE_ENV, mode)
        for flat in (False, True):
            shape = (lambda x: flatten(x, trees.num_nodes)) if flat else (lambda x: x)  # noqa: E731
            for method, target, draft, uniforms in (("greedy", logits, None, None), ("rejection", p, None, u),
                                                     ("rejection", p, q, u)):
                args = (trees.candidates, trees.parents, shape(target), None if draft is None else shape(draft))
                ref = S.verify(*args, method=method, num_nodes=trees.num_nodes, uniforms=uniforms)
                code = dispatch._method_code(method, draft)
                got = dispatch.launch(ext, *args, code, trees.num_nodes, uniforms)
                for g, r in zip(got, ref):
                    assert torch.equal(g, r), (mode, flat, method, draft is not None)
