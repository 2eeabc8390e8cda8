"""`specplug soak` on SGLang, short: a real `python -m sglang.launch_server
--speculative-algorithm MEDUSA` with the test-bed heads on loopback, 8 clients for half a
minute of mixed requests (streaming, disconnects, n > 1, penalties, stop strings, long
prompts over chunked prefill, a small KV cache), then every check of the harness passes.
The stand-ins SGLang needs on this CPU reach the server through PYTHONPATH (conftest,
and the harness itself when run from the repository).

The mix leaves out two kinds (docs/reliability.md, "Known failures"): "json-schema" (the
MEDUSA worker does not apply grammars; such requests are refused with a 400 when they
arrive, tests/sglang/test_server.py, which the harness would count as errors) and
"seeded" (SGLang 0.5.23 on CPU did not reproduce seeded requests even without
speculation: 8 of 8 pairs differed).
"""

from __future__ import annotations

import pytest

from tests.support.soak import assert_short_soak_passes

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

LIMIT_S = 900  # two server starts (20-60 s each when quiet, minutes when busy) + load + drain


def test_short_soak_passes_every_check(tmp_path):
    # 8 clients, one request of each kind at a time: MEDUSA serves ~8 requests a minute
    # here, so the drain after 16 clients' load took longer than the load itself
    assert_short_soak_passes(tmp_path, "sglang", "medusa", "json-schema,seeded", LIMIT_S, clients=8)
