"""Every engine patch specplug makes, printed from the adapters' registries (no engine is
imported): `python -m specplug.patch_list` prints the tables of docs/architecture.md,
`--update FILE` rewrites FILE's generated block. `specplug doctor` shows the same patches
with whether each matches the installed engine."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable
from pathlib import Path

from specplug.common.patches import BEGIN, END, PatchSet, markdown, with_block

ADAPTER_PATCHES = ("specplug.vllm_eagle3.patches", "specplug.sglang_medusa.patches")


def adapter_patch_sets(modules: Iterable[str] = ADAPTER_PATCHES) -> list[PatchSet]:
    """The PATCHES of each adapter's declaration module (engine-free: no engine is imported)."""
    return [importlib.import_module(m).PATCHES for m in modules]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specplug.patch_list",
                                     description="specplug's engine patches (no engine is imported).")
    parser.add_argument("--markdown", action="store_true",
                        help="print the tables of docs/architecture.md (default: on unless --update is given)")
    parser.add_argument("--update", metavar="FILE", default=None,
                        help=f"rewrite FILE's block between {BEGIN!r} and {END!r} (default: none)")
    args = parser.parse_args(argv)
    block = markdown(adapter_patch_sets())
    if args.update:
        path = Path(args.update)
        path.write_text(with_block(path.read_text(), block))
    if args.markdown or not args.update:
        print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
