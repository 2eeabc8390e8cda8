"""`specplug convert`: convert a draft head between checkpoint formats of the same method.

Thin command-line edge over specplug.common.formats (which owns the formats).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

from specplug.common.formats import FORMATS, convert

EPILOG = """\
formats (auto-detected on input; --to picks the output):
  eagle3        EAGLE / SpecForge LlamaForCausalLMEagle3 (midlayer.*, fc, d2t/t2d);
                loads in vLLM's and SGLang's built-in eagle3. Canonical EAGLE-3 form.
  speculators   vllm speculators EAGLE-3 (speculators_model_type "eagle3", layers.0.*,
                transformer_layer_config / speculators_config).
  eagle1        the EAGLE repo's EAGLE-1 heads (Llama config.json, fc.weight [H, 2H],
                layers.0.* without input_layernorm, optional embed_tokens / fc.bias;
                pytorch_model.bin or safetensors). Canonical EAGLE-1 form: --to eagle1
                re-writes it as model.safetensors after validation.
  medusa        FasterDecoding Medusa (medusa_lm_head.safetensors or .pt,
                medusa_num_heads / medusa_num_layers). Canonical Medusa form.
  vllm-medusa   vLLM MedusaModel (blocks.{i}.layers.{j}, lm_heads.{i}, num_heads,
                truncated_vocab_size, optional token_map).

A compact Medusa folder (config.json + medusa_resblocks.safetensors, how specplug
commits heads: the vocab projections are the target's lm_head) is read with --target.

eagle3 <-> speculators and medusa <-> vllm-medusa convert bit-exactly (tensor bytes
unchanged), and so does eagle1 -> eagle1; heads of different methods never convert.
What the destination cannot carry is printed as "dropped"; what had to be assumed as
"note". Weights are read only with safetensors or
torch.load(weights_only=True). See docs/formats.md.

examples:
  specplug convert ./eagle3-head ./head-speculators --to speculators --target ./target-model
  specplug convert ./medusa-head ./head-vllm --to vllm-medusa --json
  specplug convert heads/smollm2-medusa ./head-vllm --to vllm-medusa --target ./smollm2  # compact form
  specplug convert ./EAGLE-LLaMA3-Instruct-8B ./eagle1-head --to eagle1 --target ./llama3-8b
  specplug convert heads/smollm2-eagle3 ./head-tp3 --to eagle3 --tensor-parallel-size 3  # 8192 -> 8256
"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in --help, and the epilog's table kept as written."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _HelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("src", metavar="SRC", help="head checkpoint directory to read (format auto-detected)")
    parser.add_argument("dst", metavar="DST", help="directory to write the converted head to")
    parser.add_argument("--to", required=True, choices=FORMATS, metavar="FORMAT",
                        help=f"output format, one of: {', '.join(FORMATS)}")
    parser.add_argument("--target", metavar="MODEL_DIR", default=None,
                        help="target model directory: validate the head against its config.json "
                             "(hidden size, vocab, d2t range, aux layer ids) and record it as the "
                             "speculators verifier")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="EAGLE-3: pad the draft vocabulary (zero lm_head rows standing for target tokens "
                             "outside it) so that N tensor-parallel ranks can shard the head, e.g. 8192 -> 8256 "
                             "for N = 3; other dimensions that do not divide by N are refused")
    parser.add_argument("--overwrite", action="store_true", help="replace a head already in DST")
    parser.add_argument("--json", action="store_true", help="print a machine-readable JSON summary")


def _print_summary(summary: dict) -> None:
    print(f"converted {summary['method']} head: {summary['source']} ({summary['source_format']}) -> "
          f"{summary['destination']} ({summary['format']}), {summary['tensors']} tensors, "
          f"files {', '.join(summary['files'])}")
    for line in summary["dropped"]:
        print(f"dropped: {line}")
    for line in summary["notes"]:
        print(f"note: {line}")
    if not summary["dropped"]:
        print("dropped: nothing")


def _full_source(src: str, target: str | None, scratch: str) -> str:
    """SRC, or for a compact Medusa folder (residual blocks only, the vocab projections are
    the target's lm_head: how specplug commits heads) its FasterDecoding form rebuilt in
    `scratch` from --target."""
    from specplug.common.training import medusa

    if not medusa.is_compact(src):
        return src
    if target is None:
        raise ValueError(f"{src} is a compact Medusa folder ({medusa.RESBLOCKS_FILE}: residual blocks only, the "
                         "vocab projections are the target's lm_head): pass --target MODEL_DIR, the target it was "
                         "trained for")
    return str(medusa.materialise(src, target, Path(scratch) / "full"))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO if not args.json else logging.ERROR,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        with tempfile.TemporaryDirectory(prefix="specplug-convert-") as scratch:
            src = _full_source(args.src, args.target, scratch)
            summary = convert(src, args.dst, args.to, target_config=args.target, overwrite=args.overwrite,
                              tensor_parallel_size=getattr(args, "tensor_parallel_size", 1))
            summary["source"] = str(args.src)
    except ValueError as exc:  # CheckpointError (bad checkpoint) or a bad --to for this head
        if args.json:
            print(json.dumps({"error": str(exc), "field": getattr(exc, "field", None),
                              "fix": getattr(exc, "fix", None)}))
        print(f"specplug convert: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
    return 0
