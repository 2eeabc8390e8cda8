"""Test support (not product code): the SGLang launching process of
tests/sglang/test_activation.py, run as `python -m tests.support.activation_sglang` with
tests.support.activation's fakes (which SGLang's spawned processes get too).

In one process (SGLang's plugins load once per process): sglang.Engine is asked for
MEDUSA (with a Medusa head folder, which SGLang's alias resolver reads first) and for
RETRIEVAL (no draft model); both must refuse in this process, before any scheduler (which
loads the model) is started. Then an engine without speculation starts and generates.
Reports what happened, what SGLang's hook registry holds, and specplug's log records.
"""

from __future__ import annotations

import logging
import multiprocessing
import tempfile

from tests.support.activation import Records, report

PROMPT = [5, 6, 7, 8]
MAX_NEW_TOKENS = 8


def asked(model, heads) -> dict:
    """{algorithm: the error sglang.Engine raised (None if it started)}, and the child
    processes alive after the refusals."""
    import sglang

    from tests.sglang.conftest import ENGINE_ARGS

    errors = {}
    for algorithm, extra in (("MEDUSA", {"speculative_draft_model_path": str(heads)}), ("RETRIEVAL", {})):
        try:
            sglang.Engine(model_path=str(model), speculative_algorithm=algorithm, **extra, **ENGINE_ARGS).shutdown()
            errors[algorithm] = None
        except Exception as exc:  # the refusal, reported to the test
            errors[algorithm] = f"{type(exc).__name__}: {exc}"
    return {"errors": errors, "children": len(multiprocessing.active_children())}


def served(model) -> dict:
    """An engine without speculation: its output, and SGLang's hooks and algorithms."""
    import sglang
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.speculative.spec_registry import get_spec

    from tests.sglang.conftest import ENGINE_ARGS

    engine = sglang.Engine(model_path=str(model), **ENGINE_ARGS)
    try:
        out = engine.generate(input_ids=[PROMPT],
                              sampling_params={"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS})
    finally:
        engine.shutdown()
    out = out[0] if isinstance(out, list) else out
    return {"ids": out["output_ids"], "hooked": sorted(HookRegistry._hooks), "patched": sorted(HookRegistry._patched),
            "medusa_spec": type(get_spec("MEDUSA")).__name__}


def main() -> None:
    from tests.support.tiny_llama import tiny_llama_dir
    from tests.support.tiny_medusa import medusa_heads_dir

    ours = Records()
    logging.getLogger("specplug").addHandler(ours)
    model = tiny_llama_dir()
    with tempfile.TemporaryDirectory() as tmp:
        heads = medusa_heads_dir(model, f"{tmp}/heads", fit_steps=0)
        result = {"asked": asked(model, heads), "served": served(model)}
    from specplug import sglang_medusa

    result.update(activation=dict(sglang_medusa.ACTIVATION), records=ours.records)
    report(result)


if __name__ == "__main__":
    main()
