"""The stage-tree Triton kernel (specplug.common.cuda.tree_attention_triton) equals a float64
torch reference on every query row, engine-free: no vLLM, no SGLang, just torch and Triton.

The passes and the reference are tests/support/tree_attention_cases.py: a paged KV cache in
vLLM's Triton-backend layout with shuffled block tables; chains, a Medusa static tree, an
EAGLE-2 dynamic tree, hand-made and random trees, mixed prefill / decode / tree batches, GQA
4/2 and 6/2, tiles spanning blocks and blocks spanning tiles. Two backends:

- ``cuda`` (marked ``gpu``; skipped without a GPU): the compiled kernel on CUDA tensors, in
  float32 (Triton's default dot is TF32 there, so the tolerance is 5e-3) and bfloat16 (inputs
  rounded to bf16, the reference computed from the rounded values; tolerance 2e-2);
- ``interpreter``: the same passes under Triton's interpreter on CPU tensors, in a process of
  its own (tests/support/triton_tree_attention.py), float32, tolerance 1e-5.

Negative control on each backend: causal masks over the same trees change every branching row
(by more than 1e-2 at its largest element) and leave the other rows as they were.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton (a GPU machine's torch has it, and so does the vLLM environment)",
                allow_module_level=True)

from tests.support.tree_attention_cases import (  # noqa: E402
    KERNEL_ARGUMENTS, branching_rows, cases, paged_inputs, reference)
from tests.support.triton_interpreter import run_interpreted  # noqa: E402

NO_GPU = not torch.cuda.is_available()
# (backend, dtype) -> (atol = rtol, the passes it runs)
RUNS = {
    ("interpreter", torch.float32): (1e-5, ("chains", "shapes", "mixed", "groups 3")),
    ("cuda", torch.float32): (5e-3, ("chains", "shapes", "mixed", "groups 3")),
    ("cuda", torch.bfloat16): (2e-2, ("shapes", "groups 3")),
}
CONTROL = "shapes"  # the pass whose trees the causal control replaces


def _passes(backend: str, dtype: torch.dtype) -> dict[str, dict]:
    device = "cuda" if backend == "cuda" else "cpu"
    specs = cases()
    names = RUNS[backend, dtype][1]
    passes = {name: paged_inputs(specs[name], list(specs).index(name), dtype=dtype, device=device) for name in names}
    passes["control: causal"] = paged_inputs(specs[CONTROL], list(specs).index(CONTROL), causal=True, dtype=dtype,
                                             device=device)
    return passes


def _run(backend: str, passes: dict[str, dict], tmp_path: Path) -> list[torch.Tensor]:
    """The kernel's output of every pass, as CPU tensors."""
    if backend == "interpreter":
        keys = KERNEL_ARGUMENTS + ("tile",)
        return run_interpreted("tests.support.triton_tree_attention", [{k: c[k] for k in keys}
                                                                      for c in passes.values()], tmp_path)
    from specplug.common.cuda.tree_attention_triton import tree_attention

    outputs = [tree_attention(*(case[k] for k in KERNEL_ARGUMENTS), tile=case["tile"]) for case in passes.values()]
    torch.cuda.synchronize()
    return [out.cpu() for out in outputs]


def _param(backend: str, dtype: torch.dtype):
    marks = [pytest.mark.gpu, pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is "
                                                 "False")] if backend == "cuda" else []
    return pytest.param((backend, dtype), marks=marks, id=f"{backend}-{str(dtype).split('.')[-1]}")


@pytest.fixture(scope="module", params=[_param(*run) for run in RUNS])
def verified(request, tmp_path_factory):
    """(backend, dtype, {name: (pass, kernel output)}): every pass of one backend and dtype."""
    backend, dtype = request.param
    passes = _passes(backend, dtype)
    outputs = _run(backend, passes, tmp_path_factory.mktemp("triton"))
    return backend, dtype, {name: (case, out) for (name, case), out in zip(passes.items(), outputs)}


def test_kernel_equals_float64_reference_every_row(verified):
    backend, dtype, outputs = verified
    tol = RUNS[backend, dtype][0]
    for name in RUNS[backend, dtype][1]:
        case, kernel = outputs[name]
        expected = reference(case)
        assert kernel.shape == expected.shape == case["query"].shape, name
        torch.testing.assert_close(kernel.float(), expected, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")


def test_causal_masks_over_the_trees_change_only_the_branching_rows(verified):
    backend, dtype, outputs = verified
    tol = RUNS[backend, dtype][0]
    (case, right), (_, wrong) = outputs[CONTROL], outputs["control: causal"]
    rows = branching_rows(case)
    others = [r for r in range(right.shape[0]) if r not in rows]
    assert len(rows) >= 10  # branching rows of several trees
    assert (right.flatten(1)[rows].float() - wrong.flatten(1)[rows].float()).abs().amax(1).min() > 1e-2
    torch.testing.assert_close(wrong[others].float(), right[others].float(), atol=tol, rtol=tol)
