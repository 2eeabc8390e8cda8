"""`specplug draft-model`: cut a draft model out of a target, and choose self-speculation
layers by measured acceptance and cost.

    specplug draft-model cut --target MODEL --layers 0-7 --out DRAFT_DIR
    specplug draft-model layers --target MODEL [--prompts 4] [--tokens 96] [--rounds 12]

`layers` measures, on the target's own greedy replies to MT-bench prompts, how often a
layer subset's top-1 token equals the target's (alpha, about the per-token chain
acceptance), prices a draft token at the subset's share of the target's weights (kept
layers + LM head, over all layers + LM head) and models a chain of k drafts as
E[tokens] / (1 + k * cost) (a k+1-token verify costs about one decode step). Subsets:
every early exit (first K layers) and a greedy search that drops, one at a time, the
layer whose removal keeps alpha highest.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass

import torch

from .policy.cost import chain_expected_tokens
from .draft_model import _decoder, cut_draft_model, layer_skip_view, parse_layers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerChoice:
    layers: tuple[int, ...]
    alpha: float  # top-1 agreement with the target
    cost: float  # a draft token's cost relative to a target decode step
    depth: int  # best chain length for the model
    modelled_speedup: float

    def row(self) -> str:
        kept = _ranges(self.layers)
        return (f"| {kept} | {len(self.layers)} | {self.alpha:.3f} | {self.cost:.2f} | {self.depth} "
                f"| {self.modelled_speedup:.2f}x |")


def _ranges(layers) -> str:
    out, start = [], layers[0]
    for a, b in zip(layers, list(layers[1:]) + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def draft_cost(target, layers) -> float:
    """Share of the target's per-token weights a draft over ``layers`` reads."""
    blocks = _decoder(target).layers
    per_layer = [sum(p.numel() for p in b.parameters()) for b in blocks]
    head = target.get_output_embeddings().weight.numel()
    return (sum(per_layer[i] for i in layers) + head) / (sum(per_layer) + head)


def best_chain(alpha: float, cost: float, max_depth: int) -> tuple[int, float]:
    """(k, modelled speed-up) of the best chain length 1..max_depth."""
    options = [(k, chain_expected_tokens([alpha], k) / (1 + k * cost)) for k in range(1, max_depth + 1)]
    return max(options, key=lambda o: o[1])


class AgreementProbe:
    """Top-1 agreement of layer subsets with the target on fixed sequences."""

    def __init__(self, target, sequences: list[tuple[torch.Tensor, int]]):
        self.target, self.sequences = target, sequences  # (ids [n], reply start)
        self.reference = [self._top1(target, ids) for ids, _ in sequences]

    @torch.no_grad()
    def _top1(self, model, ids):
        return model(ids[None]).logits[0].argmax(-1)

    def alpha(self, layers) -> float:
        view = layer_skip_view(self.target, layers)
        agree = total = 0
        for (ids, start), ref in zip(self.sequences, self.reference):
            got = self._top1(view, ids)[start - 1:-1]
            agree += int((got == ref[start - 1:-1]).sum())
            total += got.numel()
        return agree / total

    def choice(self, layers, max_depth: int) -> LayerChoice:
        alpha = self.alpha(layers)
        cost = draft_cost(self.target, layers)
        return LayerChoice(tuple(layers), alpha, cost, *best_chain(alpha, cost, max_depth))


def search(probe: AgreementProbe, num_layers: int, rounds: int, max_depth: int) -> list[LayerChoice]:
    """Early exits (first K layers, K = 1 .. L-1) and greedy single-layer drops."""
    from tqdm.auto import tqdm

    total = (num_layers - 1) + sum(num_layers - 1 - r for r in range(rounds))
    with tqdm(total=total, desc="layer subsets", unit="subset", dynamic_ncols=True) as bar:
        def choice(layers):
            bar.update()
            return probe.choice(layers, max_depth)

        found = [choice(range(k)) for k in range(1, num_layers)]
        kept = list(range(num_layers))
        for _ in range(rounds):
            best = max((choice([i for i in kept if i != drop]) for drop in kept[1:]), key=lambda c: c.alpha)
            found.append(best)
            kept = list(best.layers)
            logger.info("dropped to %d layers: alpha %.3f, modelled %.2fx", len(kept), best.alpha,
                        best.modelled_speedup)
    return found


def reply_sequences(target, tokenizer, prompts: int, tokens: int) -> list[tuple[torch.Tensor, int]]:
    from .training.evaluate import pick_prompts

    out = []
    for p in pick_prompts("mtbench", tokenizer, prompts):
        ids = tokenizer(p.text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        full = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False)
        out.append((full[0], ids.shape[1]))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    cut = sub.add_parser("cut", help="write a checkpoint of a subset of the target's layers (a draft model)",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cut.add_argument("--target", required=True, help="Hugging Face model folder of the target")
    cut.add_argument("--layers", required=True, help='layers to keep, e.g. "0-7" or "0-5,28,29" (must include 0)')
    cut.add_argument("--out", required=True, help="output folder (config, weights, tokenizer files)")
    cut.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    lay = sub.add_parser("layers", help="measure alpha and modelled speed-up of self-speculation layer subsets",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    lay.add_argument("--target", required=True, help="Hugging Face model folder of the target")
    lay.add_argument("--prompts", type=int, default=4, help="MT-bench prompts whose greedy replies are probed")
    lay.add_argument("--tokens", type=int, default=96, help="reply tokens per prompt")
    lay.add_argument("--rounds", type=int, default=8, help="greedy layer-drop rounds")
    lay.add_argument("--max-depth", type=int, default=5, help="longest chain considered")
    lay.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")


def run(args: argparse.Namespace) -> int:
    if args.action == "cut":
        out = cut_draft_model(args.target, args.layers, args.out, overwrite=args.overwrite)
        print(f"draft model written to {out}")
        return 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    num_layers = len(_decoder(target).layers)
    parse_layers([0], num_layers)
    probe = AgreementProbe(target, reply_sequences(target, tokenizer, args.prompts, args.tokens))
    found = search(probe, num_layers, args.rounds, args.max_depth)
    best = max(found, key=lambda c: c.modelled_speedup)
    if args.json:
        print(json.dumps({"choices": [asdict(c) for c in found], "best": asdict(best)}, indent=2))
        return 0
    print("| layers kept | count | alpha | draft cost | chain | modelled speed-up |\n|---|---|---|---|---|---|")
    print("\n".join(c.row() for c in sorted(found, key=lambda c: -c.modelled_speedup)))
    verdict = (f"self-speculate with layers {_ranges(best.layers)}, chain {best.depth}"
               if best.modelled_speedup > 1.0
               else "no subset is modelled faster than the target alone: do not self-speculate")
    print(f"\nbest: {_ranges(best.layers)} ({best.modelled_speedup:.2f}x modelled): {verdict}")
    return 0
