"""Acceptance of a trained head in the reference loop on held-out prompts (tau, per position).

`evaluate` drives `specplug.common.reference.generate` over prompts of a prompt set
(MT-bench and HumanEval are never in the training data, which is ShareGPT) and pools
the steps of all prompts into one `metrics.AcceptanceStats`: tau = tokens emitted per
verify step over all steps, per-position acceptance = fraction of steps that accepted
at least d+1 draft tokens.

    python -m specplug.common.training.evaluate --head HEAD_DIR --target TARGET_DIR \
        --set mtbench --prompts 8 --tokens 64 [--temperature 0.7] [--depth 4 --topk 4 --budget 15]
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalConfig:
    """Which prompts, how many tokens, which tree, which temperature (0 = greedy)."""

    prompt_set: str = "mtbench"
    prompts: int = 8
    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    depth: int | None = None  # None: specplug.common.tree.TreeConfig's default
    topk: int | None = None
    budget: int | None = None
    retrieval: bool = False  # merge the head's trees with retrieval drafts, as a head section's "retrieval": true does

    def tree(self):
        from specplug.common.tree import TreeConfig

        given = {k: v for k, v in (("depth", self.depth), ("topk", self.topk), ("budget", self.budget))
                 if v is not None}
        return TreeConfig(**given)


def load_drafter(head_dir, target):
    """The drafter for a head folder (any format specplug.common.formats reads), validated against the target."""
    from specplug.common import formats
    from specplug.common.drafters import Eagle3Drafter, MedusaDrafter

    loaded = formats.load_head(head_dir, target.config)
    module = formats.load_head_module(head_dir, target.config, dtype=torch.float32)
    if loaded.method == "eagle3":
        if not hasattr(module, "embed_tokens"):
            module.set_target_embedding(target.get_input_embeddings())
        return Eagle3Drafter(module.eval())
    accuracies = (loaded.config.get("specplug") or {}).get("head_accuracies")
    return MedusaDrafter(module.eval(), head_accuracies=accuracies)


def with_retrieval(drafter):
    """The head's drafter merged with the retrieval drafter (the engines' hybrid trees:
    retrieval's own defaults, its chains as deep as its max_depth, one cache over all prompts)."""
    from specplug.common.merge import MergedDrafter
    from specplug.common.retrieval.config import RetrievalConfig
    from specplug.common.retrieval.drafter import ReferenceDrafter

    return MergedDrafter([drafter, ReferenceDrafter(depth=RetrievalConfig().max_depth)])


def pick_prompts(name: str, tokenizer, count: int):
    """`count` prompts spread evenly over the set (so MT-bench's 8 categories all appear)."""
    from specplug.common.training.data import prompts

    items = prompts(name, tokenizer)
    stride = max(1, len(items) // max(1, count))
    return items[::stride][:count]


@torch.no_grad()
def evaluate(target, tokenizer, drafter, cfg: EvalConfig) -> dict:
    """Pooled acceptance of `drafter` over cfg.prompts prompts of cfg.prompt_set."""
    from specplug.common.metrics import AcceptanceStats
    from specplug.common.reference import generate
    from specplug.common.target_probs import SamplingConfig

    stats, tokens, seconds = AcceptanceStats(), 0, 0.0
    drafter = with_retrieval(drafter) if cfg.retrieval else drafter
    sampling = SamplingConfig(temperature=cfg.temperature, seed=cfg.seed)
    for i, prompt in enumerate(pick_prompts(cfg.prompt_set, tokenizer, cfg.prompts)):
        ids = tokenizer(prompt.text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        result = generate(target, drafter, ids, cfg.max_new_tokens, tree=cfg.tree(), sampling=sampling)
        stats = stats + result.stats
        tokens, seconds = tokens + len(result.tokens), seconds + result.wall_s
        logger.info("%s %s: tau %.2f over %d steps", cfg.prompt_set, prompt.id, result.tau, result.steps)
    return {"eval": asdict(cfg), "tree": cfg.tree().to_dict(), "tau": round(stats.tau, 3),
            "acceptance_per_position": [round(a, 3) for a in stats.acceptance_per_pos],
            "steps": stats.num_steps, "new_tokens": tokens,
            "tok_per_s": round(tokens / seconds, 2) if seconds else None}


def main(argv: list[str] | None = None) -> int:
    d = EvalConfig()
    parser = argparse.ArgumentParser(prog="python -m specplug.common.training.evaluate",
                                     description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--head", required=True, help="trained head folder")
    parser.add_argument("--target", required=True, help="target model folder")
    parser.add_argument("--set", default=d.prompt_set, choices=("mtbench", "humaneval", "sharegpt"))
    parser.add_argument("--prompts", type=int, default=d.prompts)
    parser.add_argument("--tokens", type=int, default=d.max_new_tokens, help="new tokens per prompt")
    parser.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--depth", type=int, default=None, help="tree depth (default: TreeConfig's)")
    parser.add_argument("--topk", type=int, default=None, help="tree top-k (default: TreeConfig's)")
    parser.add_argument("--budget", type=int, default=None, help="draft nodes (default: TreeConfig's)")
    parser.add_argument("--retrieval", action="store_true",
                        help="merge the head's trees with retrieval drafts under the same budget "
                             "(what a head section's \"retrieval\": true does in vLLM and SGLang)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="specplug eval: %(message)s")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    cfg = EvalConfig(args.set, args.prompts, args.tokens, args.temperature, args.seed, args.depth, args.topk,
                     args.budget, args.retrieval)
    print(json.dumps(evaluate(target, tokenizer, load_drafter(args.head, target), cfg), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
