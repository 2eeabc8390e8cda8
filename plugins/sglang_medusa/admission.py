"""Requests specplug's SGLang algorithms (MEDUSA, RETRIEVAL, any token drafter) cannot serve are refused early.

Their workers do not apply grammars (structured output) to their tree rows; such a
request reaching a decode step would stop the scheduler and with it every request of
the server. An AROUND hook on SGLang's TokenizerManager._validate_one_request (the
check SGLang runs on every request before scheduling; a ValueError there becomes an
HTTP 400) refuses it instead, and the server keeps serving everyone else.
"""

from __future__ import annotations

from specplug.sglang_medusa.patches import VALIDATE_REQUEST

TARGET = VALIDATE_REQUEST  # hooked AROUND (patches.py)

STRUCTURED_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")


def structured_output_key(sampling_params) -> str | None:
    """The structured-output field a request's sampling params (dict or list of dicts) set."""
    for params in sampling_params if isinstance(sampling_params, list) else [sampling_params]:
        for key in STRUCTURED_KEYS:
            if isinstance(params, dict) and params.get(key) is not None:
                return key
    return None


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
