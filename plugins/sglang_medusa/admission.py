"""Structured-output requests, which specplug's SGLang workers cannot serve (a grammar
reaching a decode step would stop the scheduler), refused with an HTTP 400 by an AROUND
hook on TokenizerManager._validate_one_request, so the server keeps serving the rest."""

from __future__ import annotations

from specplug.common.request_rules import structured_output_key
from specplug.sglang_medusa.patches import VALIDATE_REQUEST

TARGET = VALIDATE_REQUEST  # hooked AROUND (patches.py)


def validate_one_request(original, manager, obj, *args, **kwargs):
    """AROUND hook: specplug algorithms' servers refuse structured-output requests; the rest as SGLang."""
    from specplug.sglang_medusa.spec import is_specplug_algorithm

    algorithm = getattr(manager.server_args, "speculative_algorithm", None)
    if is_specplug_algorithm(algorithm):
        key = structured_output_key(getattr(obj, "sampling_params", None))
        if key is not None:
            raise ValueError(
                f"structured output ({key}) is not supported with --speculative-algorithm {algorithm} yet: "
                "send this request to a server without speculation, or drop response_format / " + key)
    return original(manager, obj, *args, **kwargs)
