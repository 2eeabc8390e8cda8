"""specplug stays out of an SGLang it cannot serve, and never breaks it.

On an unsupported SGLang version, or when one of specplug's modules fails to import,
register() must not raise: an engine that did not ask for a specplug algorithm starts
and generates with none of specplug's hooks, and one WARNING line says why; an engine
asked for one (MEDUSA, RETRIEVAL, ...) refuses at start-up, before any model loads,
naming the installed and supported versions (or the failed import) and the fix. Each
failure kind runs in its own subprocess, whose SGLang children get the same fakes
(plugins load once per process; tests/support/activation_sglang.py), shared by the tests
of that kind.
"""

from __future__ import annotations

import pytest

from specplug import sglang_medusa
from tests.support.activation import BLOCK_IMPORT, SGLANG_VERSION, run_case

UNSUPPORTED = "0.5.22"
BLOCKED = "specplug.sglang_medusa.tree_attention"
CASES = {"unsupported-version": {SGLANG_VERSION: UNSUPPORTED}, "import-failure": {BLOCK_IMPORT: BLOCKED}}
# what the refusal and the log line must name, per case
NAMED = {
    "unsupported-version": [f"found {UNSUPPORTED}", "supports SGLang 0.5.23", "pip install 'specplug[sglang]'"],
    "import-failure": [f"import {BLOCKED} failed", "ImportError", "reinstall specplug"],
}
STAYS_OUT = "specplug stays out of this SGLang process"
CASE_TIMEOUT_S = 300


@pytest.fixture(scope="module", params=list(CASES))
def stayed_out(request):
    """(case name, the subprocess's result, its whole output), once per failure kind."""
    result, output = run_case("tests.support.activation_sglang", CASES[request.param], CASE_TIMEOUT_S)
    return request.param, result, output


@pytest.mark.timeout(2 * CASE_TIMEOUT_S)
def test_an_engine_that_did_not_ask_runs_as_without_specplug(stayed_out):
    case, result, output = stayed_out
    served = result["served"]
    assert len(served["ids"]) == 8
    # the only hook is the refusal on the alias resolver; no tree attention, admission, ...
    assert served["hooked"] == served["patched"] == [sglang_medusa.patches.ALIAS_SITE]
    assert served["medusa_spec"] == "CustomSpecAlgo"  # the refusing stub, not specplug's SpecplugSpecAlgo
    assert "registered speculative algorithms" not in output  # no process of the engine activated specplug
    assert result["activation"]["active"] is False
    assert all(name in result["activation"]["reason"] for name in NAMED[case])
    # one log line in this process, a WARNING, naming the reason and the refused names
    assert [level for level, _ in result["records"]] == ["WARNING"], result["records"]
    message = result["records"][0][1]
    assert message.startswith(STAYS_OUT) and all(name in message for name in NAMED[case]), message
    for algorithm in (*sglang_medusa.patches.ALGORITHMS, "LOOKUP"):  # LOOKUP: tests/support/drafter_plugin
        assert algorithm in message


@pytest.mark.timeout(2 * CASE_TIMEOUT_S)
def test_an_engine_asked_for_a_specplug_algorithm_refuses_at_start_up(stayed_out):
    case, result, _ = stayed_out
    for algorithm, error in result["asked"]["errors"].items():
        assert error is not None and error.startswith("RuntimeError: "), (algorithm, error)
        assert f"--speculative-algorithm {algorithm} is specplug's" in error
        assert all(name in error for name in NAMED[case]), error
    assert result["asked"]["children"] == 0  # refused in the launching process: no scheduler started


def test_algorithm_names_match_what_the_adapter_registers():
    from specplug.common.drafter_registry import token_drafter_names
    from specplug.sglang_medusa import spec

    builtin = {"retrieval", "draft_model", "self_spec"}
    assert builtin <= set(token_drafter_names())
    assert set(sglang_medusa.patches.ALGORITHMS) == {spec.NAME, spec.EAGLE3} | {name.upper() for name in builtin}


def test_patch_sites_name_every_hook_target_and_all_exist():
    from specplug.sglang_medusa import admission, cpu_linear, tree_attention

    targets = {tree_attention.TARGET, admission.TARGET, cpu_linear.LINEAR_TARGET, cpu_linear.LM_HEAD_TARGET,
               sglang_medusa.patches.ALIAS_SITE, sglang_medusa.patches.CONFIG_SITE}
    assert targets <= set(sglang_medusa.PATCH_SITES)
    found = sglang_medusa.patch_sites_found()
    assert list(found) == list(sglang_medusa.PATCH_SITES)
    assert all(found.values()), [site for site, ok in found.items() if not ok]
