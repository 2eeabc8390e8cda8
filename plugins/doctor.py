"""`specplug doctor`: what specplug sees on this machine, to run before filing a bug (in
the spirit of `vllm collect-env`).

Sections: the environment (specplug and where it is imported from, the engines and
whether specplug supports them, Python, torch, CPU ISA, GPUs), the specplug paths this
machine can run, the engine patches (specplug.common.patches) and whether each matches
the installed engine (doctor_env.py), and with --head a dry run of a draft head that
loads no weights (doctor_head.py). --json prints the same report as JSON. Exit status:
0; 1 when the head would be refused; 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specplug import doctor_env, doctor_head

EPILOG = """\
examples:
  specplug doctor
  specplug doctor --head heads/smollm2-eagle3
  specplug doctor --head ./my-eagle3-head --model ./Llama-3.1-8B-Instruct --json

Only config.json files and safetensors headers are read (a pytorch_model.bin head is
read whole): no weights load, no engine starts. Engines are imported only to check
specplug's patch targets (and vLLM-CPU's attention ISA), with their logs silenced.
Exit status 1 names the field when the head would be refused; 2 is a bad argument.
"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in --help, and the epilog kept as written."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _HelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("--head", metavar="DIR", default=None,
                        help="draft head folder to dry-run: format, specplug section, effective settings and their "
                             "sources, target match, what vLLM and SGLang would do with it")
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="target model folder to check --head against (only its config.json is read); unset: "
                             "the test bed's target for the committed heads when it is built, else not checked")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def report(head: str | None = None, model: str | None = None) -> dict:
    """The whole report: the machine's sections, plus "head" when `head` is given."""
    out = doctor_env.machine_report()
    if head is not None:
        out["head"] = doctor_head.head_report(head, model, {e["name"]: e for e in out["engines"]})
    return out


def _argument_error(args: argparse.Namespace) -> str | None:
    if args.model is not None and args.head is None:
        return "--model needs --head: pass the head folder to check against this target"
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        return (f"--model must be a model folder with a config.json, got {args.model!r}: pass the target "
                "model's local folder (a Hugging Face snapshot)")
    return None


def run(args: argparse.Namespace) -> int:
    error = _argument_error(args)
    if error is not None:
        print(f"specplug doctor: {error}", file=sys.stderr)
        return 2
    result = report(args.head, args.model)
    print(json.dumps(result, indent=2) if args.json else render(result))
    refused = (result.get("head") or {}).get("refused")
    if refused:
        print(f"specplug doctor: the head would be refused: {refused['error']}", file=sys.stderr)
        return 1
    return 0


# -- human output --------------------------------------------------------------------------

def render(result: dict) -> str:
    """The report as short aligned sections."""
    parts = [_environment(result), _paths(result["paths"]), _patches(result["patches"])]
    if "head" in result:
        parts.append(_head(result["head"]))
    return "\n\n".join(parts)


def _rows(pairs: list[tuple[str, str]], indent: int = 2, width: int = 0) -> list[str]:
    width = max([width] + [len(key) for key, _ in pairs])
    return [f"{' ' * indent}{key:<{width}}  {value}".rstrip() for key, value in pairs]


def _environment(result: dict) -> str:
    s, p = result["specplug"], result["platform"]
    pairs = [("specplug", f"{s['version']} at {s['location']} ({s['install']})")]
    pairs += [(e["name"], _engine(e)) for e in result["engines"]]
    pairs += [("Python", p["python"]), ("torch", p["torch"]), ("OS", p["os"]),
              ("CPU", f"{p['cpu']}, {p['cpus']} logical CPUs" + (f"; {_isa(p['isa'])}" if p["isa"] else "")),
              ("GPU", _gpus(p["gpus"]))]
    return "\n".join(["Environment"] + _rows(pairs))


def _engine(e: dict) -> str:
    if e["version"] is None:
        return e["reason"]
    state = "supported" if e["supported"] else f"NOT supported ({e['reason']})"
    return f"{e['distribution']} {e['version']}: {state}; {e['plugin']}"


def _isa(isa: dict) -> str:
    return ", ".join(f"{name} {'yes' if present else 'no'}" for name, present in isa.items())


def _gpus(gpus: dict) -> str:
    if not gpus["devices"]:
        return f"none ({gpus['reason']})"
    return "; ".join(f"{d['name']} (compute capability {d['capability']})" for d in gpus["devices"])


def _paths(paths: list[dict]) -> str:
    pairs = [(p["name"], f"{'yes' if p['ok'] else 'no '}  {p['reason']}") for p in paths]
    return "\n".join(["Paths this machine can run"] + _rows(pairs))


def _patches(patches: dict) -> str:
    lines = ["Engine patches (targets: --json, docs/architecture.md)"]
    for engine, found in patches.items():
        rows = found["patches"]
        if all(r["matched"] is None and r["reason"] is None for r in rows):  # not checked: --json lists them
            lines.append(f"  {engine}: {found['status']} ({len(rows)} patches)")
            continue
        lines.append(f"  {engine}: {found['status']}")
        kinds, groups = (max(len(r[key]) for r in rows) for key in ("kind", "group"))
        lines += _rows([(r["name"], f"{r['kind']:<{kinds}}  {r['group']:<{groups}}  {_patch_state(r)}")
                        for r in rows], indent=4)
    return "\n".join(lines)


def _patch_state(row: dict) -> str:
    if row["applied"]:
        return "applied"
    if row["matched"]:
        return "matches"
    return f"{'not here' if row['matched'] is None else 'REFUSED'}: {row['reason']}"


HEAD_KEY_WIDTH = len("settings")  # the key column of the head section


def _head(head: dict) -> str:
    compact = ", a compact folder (residual blocks only; the vocab projections are the target's)"
    pairs = [("format", f"{head['format']} (method {head['method']}){compact if head['compact'] else ''}"
              if head["format"] else "-"), ("target", _target(head["target"]))]
    if head["engines"]:  # the head loaded: its section was read
        pairs.append(("section", _brief(head["section"]) if head["section"] is not None else
                      "none: the engines run their own path for this head, specplug changes nothing"))
    lines = [f"Head {head['path']}"] + _rows(pairs, width=HEAD_KEY_WIDTH)
    if head["settings"]:
        values = [json.dumps(r["value"]) for r in head["settings"]]
        width = max(map(len, values))
        lines += ["  settings (effective value, source)"] + _rows(
            [(r["name"], f"{v:<{width}}  {r['source']}") for r, v in zip(head["settings"], values)], indent=4)
    if head["settings_error"]:
        lines += _rows([("settings", head["settings_error"])], width=HEAD_KEY_WIDTH)
    for engine, plan in head["engines"].items():
        lines += _rows([(engine, _plan(plan))], width=HEAD_KEY_WIDTH)
        lines += [f"    {line}" for line in _plan_details(plan)]
    lines += [f"  note: {note}" for note in head["notes"]]
    verdict = f"REFUSED: {head['refused']['error']}" if head["refused"] else _accepted_by(head["engines"])
    lines += _rows([("verdict", verdict)], width=HEAD_KEY_WIDTH)
    return "\n".join(lines)


def _brief(section: dict, longest: int = 40) -> str:
    """The section as JSON, long values elided (--json has them whole)."""
    items = [f"{json.dumps(key)}: {text if len(text) <= longest else text[0] + '...' + text[-1]}"
             for key, text in ((k, json.dumps(v)) for k, v in section.items())]
    return "{" + ", ".join(items) + "}"


def _accepted_by(plans: dict) -> str:
    ok = [name for name, plan in plans.items() if not plan["refused"]]
    refuse = [name for name in plans if name not in ok]
    return f"ok for {' and '.join(ok)}" + (f" ({' and '.join(refuse)} refuses it, above)" if refuse else "")


def _target(target: dict | None) -> str:
    if target is None:
        return "-"
    if not target["checked"]:
        return target["reason"]
    return (f"{target['path']} ({target['source']}): hidden_size {target['hidden_size']}, vocab_size "
            f"{target['vocab_size']}, {target['num_layers']} layers, dtype {target['dtype']}"
            + (": the head matches" if target.get("matches") else ""))


def _plan(plan: dict) -> str:
    if plan["refused"]:
        return f"refuses: {plan['refused']}"
    return f"{plan['option']} {plan['method']}: {plan['path']}"


def _plan_details(plan: dict) -> list[str]:
    if plan["refused"]:
        return []
    lines = []
    if plan["num_speculative_tokens"] is not None:
        lines.append(f"{plan['tokens_option']}: {plan['num_speculative_tokens']}")
    lines += plan["notes"]
    if plan["command"]:
        lines.append(plan["command"])
    return lines
