"""SGLang suite: puts the test-support stand-ins on the path and provides engines.

SGLang's CPU engine on a CPU without AMX needs two gaps filled (see docs/sglang.md):
`sgl_kernel` (no CPU build on PyPI) and `torchvision` (PyPI's links CUDA). Both are
stand-in packages under tests/support/sglang_path/. This conftest puts that folder (and
the repository root, which they import from) on sys.path AND on PYTHONPATH before
SGLang is imported, so the scheduler subprocesses SGLang spawns see them too. Nothing
is installed into the virtual environment, and product code never imports them.

Engines are expensive (20-60 s each on 2 busy cores): the no-speculation outputs every
test compares against are produced once per session by one engine that is then shut
down (`baseline`); each speculative engine lives for the module that uses it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUB_PATH = ROOT / "tests" / "support" / "sglang_path"

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]  # not the SGLang environment: scripts/test.sh sglang


def _install_stand_ins() -> None:
    entries = [str(ROOT), str(STUB_PATH)]
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in entries]
    os.environ["PYTHONPATH"] = os.pathsep.join(entries + rest)
    for entry in reversed(entries):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("SGLANG_PLUGINS", "specplug_medusa")
    # Engine tests pin each step's tree so every drafting path runs; payoff control, on by
    # default for users, is tested on its own (test_payoff.py).
    os.environ.setdefault("SPECPLUG_PAYOFF", "0")


_install_stand_ins()

from specplug.sglang_medusa.bench_runner import CPU_ENGINE_ARGS  # noqa: E402 - after the stand-ins

ENGINE_ARGS = dict(CPU_ENGINE_ARGS, max_total_tokens=16384, log_level="error", random_seed=0)

# Mixed prompt lengths (token ids of the tiny Llama's vocabulary), used by several tests.
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8],
    [9, 10, 11],
    list(range(40, 71)),
    [100],
]
GREEDY = {"temperature": 0.0, "max_new_tokens": 48}
# A divergence from the no-speculation output is tolerated only where the baseline's
# top-2 log-probabilities were closer than this (an fp32 near-tie that the verify and
# decode kernels may round differently); anything else fails.
NEAR_TIE_LOGPROB_GAP = 1e-3
# greedy requests with each of SGLang's penalties, beside a plain one
PENALISED = [dict(GREEDY, frequency_penalty=0.8), dict(GREEDY, repetition_penalty=1.4),
             dict(GREEDY, presence_penalty=1.0), dict(GREEDY)]
# More of what SGLang's sampler offers, mixed: logit bias, min-new-tokens (the tiny model's
# EOS banned for the whole answer), penalties together.
RULES = [dict(GREEDY, frequency_penalty=0.5, logit_bias={"5": 2.0}),
         dict(GREEDY, min_new_tokens=48, repetition_penalty=1.2),
         dict(GREEDY, presence_penalty=0.5, frequency_penalty=0.3),
         dict(GREEDY, logit_bias={"100": -5.0, "41": 3.0})]
LONG_GREEDY = {"temperature": 0.0, "max_new_tokens": 96}
# The T = 0.8 test: one prompt, SAMPLES requests, the first generated tokens compared.
SAMPLE_PROMPT = [77, 300, 12, 400]
SAMPLES = 600
SAMPLED = {"temperature": 0.8, "max_new_tokens": 3}


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/sglang/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.sglang)


@contextlib.contextmanager
def sglang_engine(model_path, **kwargs):
    """An in-process sglang.Engine with the CPU test settings, shut down on exit."""
    import sglang

    engine = sglang.Engine(model_path=str(model_path), **{**ENGINE_ARGS, **kwargs})
    try:
        yield engine
    finally:
        engine.shutdown()


def generate_ids(engine, prompts, params, **kwargs) -> list[dict]:
    """engine.generate on token ids; returns the per-request dicts in prompt order."""
    out = engine.generate(input_ids=prompts, sampling_params=params, **kwargs)
    return out if isinstance(out, list) else [out]


def top2_gaps(output: dict) -> list[float]:
    """Per generated position: logprob(top-1) - logprob(top-2) of the engine's output."""
    return [tops[0][0] - tops[1][0] for tops in output["meta_info"]["output_top_logprobs"]]


def greedy_run(engine, prompts, params) -> dict:
    outs = generate_ids(engine, prompts, params, return_logprob=True, top_logprobs_num=2)
    return {"ids": [o["output_ids"] for o in outs], "gaps": [top2_gaps(o) for o in outs],
            "meta": [o["meta_info"] for o in outs]}


def assert_greedy_matches(spec_ids, base_ids, base_gaps, bound=NEAR_TIE_LOGPROB_GAP) -> int:
    """Speculative greedy output == no-speculation output, or its first divergence sits at a
    near-tie of the baseline (top-2 logprob gap < bound). Returns how many diverged."""
    diverged = 0
    for r, (spec, base, gaps) in enumerate(zip(spec_ids, base_ids, base_gaps)):
        if spec == base:
            continue
        i = next((i for i, (a, b) in enumerate(zip(spec, base)) if a != b), min(len(spec), len(base)))
        assert i < len(gaps) and gaps[i] < bound, (
            f"request {r}: speculative output diverges at token {i} where the baseline's top-2 "
            f"logprob gap is {gaps[i] if i < len(gaps) else 'n/a'} (not a near-tie < {bound}):\n"
            f"spec {spec}\nbase {base}")
        diverged += 1
    return diverged


@pytest.fixture(scope="session")
def sgl_model(tiny_llama_path):
    """The tiny random Llama (GQA: 4 query / 2 KV heads)."""
    return tiny_llama_path


@pytest.fixture(scope="session")
def medusa_heads(sgl_model, tmp_path_factory):
    """Three Medusa heads fitted in seconds to the tiny Llama's greedy continuations."""
    from tests.support.tiny_medusa import medusa_heads_dir

    return medusa_heads_dir(sgl_model, tmp_path_factory.mktemp("medusa") / "heads", fit_steps=60)


@pytest.fixture(scope="session")
def baseline(sgl_model):
    """Outputs of SGLang WITHOUT speculation, from one engine that is then shut down:
    greedy (PROMPTS, batch 4), long greedy (PROMPTS), SAMPLES sampled requests, and
    penalised greedy requests (PENALISED)."""
    with sglang_engine(sgl_model) as engine:
        return {
            "penalised": [o["output_ids"] for o in generate_ids(engine, PROMPTS[:4], PENALISED)],
            "rules": [o["output_ids"] for o in generate_ids(engine, PROMPTS[:4], RULES)],
            "greedy": greedy_run(engine, PROMPTS, GREEDY),
            "greedy_bs1": [greedy_run(engine, [p], GREEDY)["ids"][0] for p in PROMPTS[:2]],
            "long": greedy_run(engine, PROMPTS, LONG_GREEDY),
            "sampled": [o["output_ids"] for o in generate_ids(engine, [SAMPLE_PROMPT] * SAMPLES, SAMPLED)],
        }


def pytest_configure(config):
    config.addinivalue_line("filterwarnings", "ignore::UserWarning")
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning")
