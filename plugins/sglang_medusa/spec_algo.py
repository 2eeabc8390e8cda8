"""`SpecplugSpecAlgo`: how specplug's SGLang algorithms answer the questions SGLang 0.5.23's
scheduler asks every algorithm. Imports SGLang, so spec.py imports it inside register()."""

from __future__ import annotations

from sglang.srt.managers.overlap_utils import FutureMap
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from specplug.sglang_medusa import spec


class SpecplugSpecAlgo(CustomSpecAlgo):
    """MEDUSA, SPECPLUG_EAGLE3 and every token drafter: no draft model, no draft KV, no hidden-state
    transfer, no top-k draft chains; the future map is SGLang's default."""

    def has_draft_kv(self) -> bool:
        return False

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def supports_mixed_chunk(self) -> bool:
        return False

    def handle_server_args(self, server_args) -> None:
        spec.handle_args(self.name, server_args)

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens=True,
                          needs_confidence_relay=False):
        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)
