"""The `specplug` command line: one subcommand per feature, each in its own module.

A command module exposes `add_arguments(parser)` and `run(args) -> int`. Modules are
imported only when their command is chosen, so `specplug --help` stays fast and a
command whose optional dependencies are missing fails with a message, not a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). The single table of commands.
COMMANDS: dict[str, tuple[str, str]] = {
    "testbed": ("specplug.common.testbed", "build or inspect the offline test bed (SmolLM2-135M + prompt sets)"),
    "convert": ("specplug.common.formats.cli", "convert draft heads between checkpoint formats"),
    "train": ("specplug.common.training.cli", "train EAGLE-3 or Medusa heads for a Hugging Face causal LM"),
    "distill": ("specplug.distill",
                "write the target's own replies to a prompt set (self-distilled training data), resumable"),
    "draft-model": ("specplug.common.draft_model_cli",
                    "cut a draft model out of a target; choose self-speculation layers by measured acceptance"),
    "bench": ("specplug.bench", "measure speed-up and acceptance against the engine without speculation"),
    "serve": ("specplug.vllm_eagle3.serve",
              "start vLLM's OpenAI server (`vllm serve ARGS`), also on vLLM's CPU build where `vllm serve` fails"),
    "demo": ("specplug.vllm_eagle3.demo",
             "run vLLM on the test bed without speculation, with specplug and with vLLM's ngram; print one table"),
    "datastore": ("specplug.common.retrieval.cli",
                  "build or inspect a static datastore for the retrieval drafter (REST-style n-gram index)"),
    "soak": ("specplug.soak", "soak and fault test: real servers on loopback under mixed concurrent load, then checks"),
    "doctor": ("specplug.doctor", "what specplug sees here (engines, platform, paths, patches) and a dry run of "
                                  "a head (--head); run it before filing a bug"),
}


def _parser(selected: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specplug",
        description="Lossless speculative decoding for vLLM and SGLang.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        cmd = sub.add_parser(
            name, help=help_text, description=help_text,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        if name == selected:
            importlib.import_module(module).add_arguments(cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    if selected is not None and selected not in COMMANDS:
        selected = None
    try:
        parser = _parser(selected)
    except ImportError as exc:
        print(f"specplug {selected}: missing dependency ({exc}); "
              f"install the matching extra, e.g. pip install 'specplug[train]'", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
