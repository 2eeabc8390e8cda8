"""The verify step SGLang's GPU backends get, run end to end in a CPU engine.

With SPECPLUG_SGLANG_PREFIX_MASKS=1 the workers hand what they hand a GPU backend
(common.sglang_backends.prefix_masks_needed): every request's tree padded to speculative_num_draft_tokens
nodes (tree.pad_batch) and the prefix-included mask (common.sglang_trees), which the
torch_native hook reads too. Greedy output must equal SGLang without speculation
(`baseline`, conftest.py) with drafts accepted: RETRIEVAL (trees of varying size, so
padding nodes every step) and MEDUSA (static trees)."""

import json
import logging

import pytest

from tests.sglang.conftest import GREEDY, PROMPTS, assert_greedy_matches, greedy_run, sglang_engine


# SGLang's processes log errors only, specplug's its INFO lines (the worker names the mask it
# hands), to the process's own stderr (fd 2, which capfd reads; never a closed capture stream).
LOGGING = {"version": 1, "disable_existing_loggers": False,
           "handlers": {"fd2": {"class": "logging.StreamHandler", "stream": "ext://sys.__stderr__"}},
           "root": {"level": "ERROR", "handlers": ["fd2"]}, "loggers": {"specplug": {"level": "INFO"}}}


@pytest.fixture
def specplug_logs(tmp_path, monkeypatch):
    """LOGGING for the engines this test starts; this process's specplug log level restored after."""
    (tmp_path / "logging.json").write_text(json.dumps(LOGGING))
    monkeypatch.setenv("SGLANG_LOGGING_CONFIG_PATH", str(tmp_path / "logging.json"))
    level = logging.getLogger("specplug").level
    yield
    logging.getLogger("specplug").setLevel(level)


@pytest.mark.parametrize("algorithm", ["RETRIEVAL", "MEDUSA"])
def test_padded_prefix_masks_keep_greedy_output(algorithm, sgl_model, medusa_heads, baseline, monkeypatch, capfd,
                                                specplug_logs):
    monkeypatch.setenv("SPECPLUG_SGLANG_PREFIX_MASKS", "1")
    heads = {} if algorithm == "RETRIEVAL" else {"speculative_draft_model_path": str(medusa_heads)}
    with sglang_engine(sgl_model, speculative_algorithm=algorithm, **heads) as engine:
        engine.flush_cache()
        run = greedy_run(engine, PROMPTS, GREEDY)
    assert "verify steps hand SGLang prefix-included tree masks" in capfd.readouterr().err
    assert assert_greedy_matches(run["ids"], baseline["greedy"]["ids"], baseline["greedy"]["gaps"]) == 0
    assert max(m["spec_accept_length"] for m in run["meta"]) > 1.2  # drafts verified and accepted
