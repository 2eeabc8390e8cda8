"""specplug's algorithms registered with SGLang (patches.py applies these functions with
SpeculativeAlgorithm.register), each as a `SpecplugSpecAlgo`, which answers the questions
SGLang's scheduler asks every algorithm (spec.py holds their checks and workers)."""

from __future__ import annotations

import logging

from sglang.srt.managers.overlap_utils import FutureMap
from sglang.srt.speculative.spec_registry import CustomSpecAlgo, get_spec

from specplug.common.drafter_registry import token_drafter_names
from specplug.sglang_medusa import spec

logger = logging.getLogger(__name__)


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


def register_medusa(register) -> list[str]:
    """register("MEDUSA", ...); returns what it registered ([] when SGLang has it)."""
    return _register_head_algorithm(register, spec.NAME, spec.validate_server_args, spec.worker_factory)


def register_eagle3(register) -> list[str]:
    """register("SPECPLUG_EAGLE3", ...), as register_medusa."""
    return _register_head_algorithm(register, spec.EAGLE3, spec.validate_eagle3_args, spec.eagle3_worker_factory)


def _register_head_algorithm(register, name: str, validate, worker_factory) -> list[str]:
    if get_spec(name) is not None:
        return []
    register(name, supports_overlap=False, validate_server_args=validate, spec_class=SpecplugSpecAlgo)(worker_factory)
    return [name]


def register_token_drafters(register) -> list[str]:
    """register(NAME.upper(), ...) for every registered token drafter; a name SGLang already
    knows is skipped with a warning. Returns the algorithms this call registered
    (spec.TOKEN_ALGORITHMS: all this process has)."""
    registered = []
    for name in token_drafter_names():
        algorithm = name.upper()
        if algorithm in spec.TOKEN_ALGORITHMS:
            continue
        if get_spec(algorithm) is not None or algorithm in (spec.NAME, spec.EAGLE3):
            logger.warning("specplug: drafter %r not registered as SGLang algorithm %s: SGLang already has one "
                           "by that name (rename the drafter)", name, algorithm)
            continue
        register(algorithm, supports_overlap=False, validate_server_args=spec.validate_token_args,
                 spec_class=SpecplugSpecAlgo)(spec.token_worker_factory)
        spec.TOKEN_ALGORITHMS.add(algorithm)
        registered.append(algorithm)
    return registered
