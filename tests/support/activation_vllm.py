"""Test support (not product code): the vLLM process of tests/vllm/test_activation.py,
run as `python -m tests.support.activation_vllm` with tests.support.activation's fakes.

In one process (vLLM's plugins load once per process): vLLM is asked for a specplug
EAGLE-3 head (it must refuse while building its config, before any model loads), then
an engine with a plain EAGLE-3 head (vLLM's own path) starts and generates. Reports what
happened, what vLLM's patch sites hold, and specplug's log records.
"""

from __future__ import annotations

import logging
import os

from tests.support.activation import ASKED_DONE, Records, fake_vllm_version, report

PROMPT = "the cat"
MAX_TOKENS = 8
ENVIRON = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
           "VLLM_LOGGING_STREAM": "ext://sys.stdout"}  # vLLM's log and ASKED_DONE in one stream, in order


def engine_args(target) -> dict:
    return dict(model=str(target), dtype="float32", seed=0, max_model_len=512, enforce_eager=True,
                distributed_executor_backend="uni", kv_cache_memory_bytes=64 << 20)


def asked(target, head) -> str | None:
    """LLM(...) with a specplug head: the error it raised (None if it started). vLLM's log
    lines until then are on stdout before ASKED_DONE (the test looks for model loading)."""
    from vllm import LLM

    try:
        LLM(**engine_args(target), speculative_config={"method": "eagle3", "model": str(head),
                                                        "num_speculative_tokens": 3})
        error = None
    except Exception as exc:  # the refusal, reported to the test
        error = f"{type(exc).__name__}: {exc}"
    print(ASKED_DONE, flush=True)
    return error


def served(target, plain_head) -> dict:
    """An engine with a plain EAGLE-3 head: its output, drafter and vLLM's patch sites."""
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import SamplingParams as VllmSamplingParams
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm.v1.spec_decode.medusa import MedusaProposer
    from vllm.v1.worker import gpu_model_runner

    llm = LLM(**engine_args(target), speculative_config={"method": "eagle3", "model": str(plain_head),
                                                          "num_speculative_tokens": 3})
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
    runner = gpu_model_runner.GPUModelRunner
    return {
        "ids": list(out[0].outputs[0].token_ids),
        "drafter": f"{type(drafter).__module__}.{type(drafter).__qualname__}",
        "eagle_proposer_is_vllms": gpu_model_runner.EagleProposer is EagleProposer,
        "medusa_proposer_is_vllms": gpu_model_runner.MedusaProposer is MedusaProposer,
        "cpu_attn_backend": AttentionBackendEnum.CPU_ATTN.get_path(),
        "not_vllms": [f"{cls.__name__}.{name}" for cls, name in (
            (runner, "__init__"), (runner, "_bookkeeping_sync"), (runner, "_prepare_inputs"),
            (runner, "_build_attention_metadata"), (VllmSamplingParams, "_validate_spec_decode"))
            if not _is_vllms(getattr(cls, name))],
    }


def _is_vllms(function) -> bool:
    """Whether a function's code lives in the vllm package (functools.wraps copies names, not code)."""
    import vllm

    return function.__code__.co_filename.startswith(os.path.dirname(vllm.__file__))


def main() -> None:
    os.environ.update(ENVIRON)  # before vLLM is imported
    from tests.support.tiny_eagle3 import tiny_head_dir, tiny_target_dir
    from tests.vllm.conftest import SPECPLUG_TREE

    ours = Records()
    logging.getLogger("specplug").addHandler(ours)
    target = tiny_target_dir()
    fake_vllm_version()
    result = {"asked": asked(target, tiny_head_dir(target, specplug=SPECPLUG_TREE)),
              "served": served(target, tiny_head_dir(target))}
    from specplug import vllm_eagle3

    result.update(activation=dict(vllm_eagle3.ACTIVATION), records=ours.records)
    report(result)
    os._exit(0)  # no engine teardown (a garbage collection per engine): the process ends here


if __name__ == "__main__":
    main()
