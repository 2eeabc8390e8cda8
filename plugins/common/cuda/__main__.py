"""``python -m specplug.common.cuda``: build the verify extension ahead of time and say so."""

import argparse
import sys

from specplug.common.cuda.build import EXTENSION_NAME, load_extension


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specplug.common.cuda",
        description="Compile (or find in torch's extension cache) the fused CUDA verify kernels.",
    )
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output (default: off)")
    args = parser.parse_args(argv)
    build = load_extension(verbose=args.verbose)
    if build.module is None:
        print(f"{EXTENSION_NAME}: not built: {build.error}", file=sys.stderr)
        return 1
    print(f"{EXTENSION_NAME}: ready ({build.module.__file__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
