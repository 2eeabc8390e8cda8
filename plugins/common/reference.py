"""The engine-free reference generation loop: any drafter + a Hugging Face causal LM,
verified through specplug.common.tree / sampling. The oracle the adapters are compared to.

One step: the drafter proposes a tree rooted at the last committed token; the target
scores every node in ONE forward (4-D ancestor mask over cache + tree, positions =
root position + depth); `sampling.verify` keeps the longest accepted path plus a
bonus token; the target's KV cache keeps only that path; the drafter commits it.
Greedy output equals `target.generate(do_sample=False)` token for token; at T > 0 the
output follows the target's distribution (lossless rule) and a seed reproduces it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from .attention_masks import additive_mask
from .drafters import Drafter
from .metrics import AcceptanceStats
from .sampling import verify
from .target_probs import SamplingConfig, process_logits
from .tree import DraftTree, TreeConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationResult:
    """tokens: the new tokens (prompt excluded), cut at EOS / max_new_tokens.
    num_accepted: draft tokens accepted at each verify step (root and bonus excluded).
    stats: the same steps as specplug.common.metrics.AcceptanceStats (tau, per-position
    acceptance, draft acceptance rate; definitions in metrics.py).
    tok_per_s: new tokens / wall seconds (prefill included)."""

    tokens: list[int]
    num_accepted: list[int] = field(default_factory=list)
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    wall_s: float = 0.0

    @property
    def steps(self) -> int:
        return self.stats.num_steps

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verify step."""
        return self.stats.tau

    @property
    def acceptance_per_position(self) -> list[float]:
        """[d] = fraction of steps that accepted at least d + 1 draft tokens."""
        return self.stats.acceptance_per_pos

    @property
    def tok_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else float("nan")

    def as_dict(self) -> dict:
        return {"tokens": list(self.tokens), "num_accepted": list(self.num_accepted), "wall_s": self.wall_s,
                "tok_per_s": self.tok_per_s, **self.stats.as_dict()}


def _verify_method(sampling: SamplingConfig, method: str | None) -> str:
    if method == "typical":
        logger.info("typical acceptance is LOSSY: output no longer follows the target's distribution")
    return method or sampling.method


def _target_probs(logits: torch.Tensor, sampling: SamplingConfig, method: str) -> torch.Tensor:
    """[1, N, V] logits -> what verify expects (greedy: logits as they are)."""
    if method == "greedy":
        return logits.float()
    return process_logits(logits.float(), sampling.temperature, sampling.top_k, sampling.top_p)


def _tree_mask(tree: DraftTree, past_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive 4-D mask [1, 1, N, past + N]: the whole cache plus the node's ancestors."""
    allowed = torch.cat([torch.ones(tree.num_nodes, past_len, dtype=torch.bool), tree.attention_mask()], 1)
    return additive_mask(allowed, dtype).to(device)


def _keep_cache(cache, past_len: int, path: torch.Tensor) -> None:
    """Keep cache entries [0, past_len) and the tree nodes on `path`, in that order."""
    keep = torch.cat([torch.arange(past_len), past_len + path.cpu()])
    for layer in cache.layers:
        if type(layer).__name__ != "DynamicLayer":
            raise TypeError(
                f"reference loop needs a full-attention DynamicCache, got a {type(layer).__name__} layer: "
                "sliding-window / linear-attention targets are not supported here"
            )
        idx = keep.to(layer.keys.device)
        layer.keys = layer.keys.index_select(2, idx)
        layer.values = layer.values.index_select(2, idx)


def _hidden(out, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """Concatenate the requested Hugging Face hidden_states entries: -> [T, Hc] of batch row 0
    (Hc = 0 for drafters that read no target states)."""
    if not layer_ids:
        return out.logits.new_zeros(out.logits.shape[1], 0)
    return torch.cat([out.hidden_states[i][0] for i in layer_ids], -1)


class _Loop:
    """State of one reference generation (single request)."""

    def __init__(self, target, drafter: Drafter, sampling: SamplingConfig, method: str):
        self.target, self.drafter, self.sampling, self.method = target, drafter, sampling, method
        self.rid = ("specplug.reference", id(self))  # never collides with a caller's request ids
        self.device = next(target.parameters()).device
        self.dtype = next(target.parameters()).dtype
        self.layer_ids = drafter.target_hidden_layers(target.config.num_hidden_layers)
        self.generators = None if sampling.seed is None else [sampling.generator()]
        from transformers import DynamicCache
        self.cache = DynamicCache(config=target.config)
        self.past_len = 0

    def forward(self, input_ids, **kw):
        return self.target(input_ids[None].to(self.device), past_key_values=self.cache, use_cache=True,
                           output_hidden_states=True, **kw)

    def prefill(self, prompt: torch.Tensor) -> int:
        out = self.forward(prompt)
        self.past_len = prompt.shape[0]
        root = prompt[-1:]
        # the first token: a root-only tree, so the one sampler of sampling.verify draws it
        first = self.verify(DraftTree(root, torch.tensor([-1])), out.logits[:, -1:]).bonus_token
        self.drafter.prefill([self.rid], [prompt], [_hidden(out, self.layer_ids)], first)
        return int(first[0])

    def verify(self, tree: DraftTree, logits: torch.Tensor, q: torch.Tensor | None = None):
        """q: the draft's [1, N, V] when the tree was sampled from it (used by "rejection")."""
        p = _target_probs(logits, self.sampling, self.method)  # [1, N, V]
        q = q.to(self.device) if q is not None and self.method == "rejection" else None
        return verify(tree.tokens[None].to(self.device), tree.parents[None].to(self.device), p, q,
                      method=self.method, generators=self.generators)

    def score(self, tree: DraftTree):
        """The target's ONE forward over every tree node (appends N entries to the cache)."""
        return self.forward(tree.tokens, attention_mask=_tree_mask(tree, self.past_len, self.dtype, self.device),
                            position_ids=tree.positions(self.past_len)[None].to(self.device))

    def step(self, tree: DraftTree, q: torch.Tensor | None = None) -> tuple[list[int], int]:
        """Verify one tree (q: see verify); returns (emitted tokens, draft tokens accepted)."""
        out = self.score(tree)
        result = self.verify(tree, out.logits, q)
        path = result.accepted_nodes[0]
        path = path[path >= 0].cpu()  # root..last accepted node
        _keep_cache(self.cache, self.past_len, path)
        self.past_len += path.shape[0]
        accepted = tree.tokens[path[1:]]
        self.drafter.commit([self.rid], [accepted], [_hidden(out, self.layer_ids)[path.to(self.device)]],
                            result.bonus_token)
        return accepted.tolist() + [int(result.bonus_token[0])], path.shape[0] - 1


@torch.no_grad()
def generate(target, drafter: Drafter, prompt_ids, max_new_tokens: int, *, tree: TreeConfig = TreeConfig(),
             sampling: SamplingConfig | None = None, method: str | None = None,
             eos_token_id: int | list[int] | None = None) -> GenerationResult:
    """Speculative generation for one prompt on a Hugging Face causal LM.

    prompt_ids: Long [n] or [1, n]. tree: the drafter's tree settings (topk 1 = chain
    of `depth`). sampling: None = greedy; temperature 0 = greedy; otherwise the lossless
    rejection rule (target-only, or with the draft's q when the drafter returns
    draft_probs), reproducible with sampling.seed. method overrides the verify rule
    ("greedy" | "rejection" | "typical" (lossy)). eos_token_id defaults to the target's
    generation_config; generation stops after it, like `target.generate`.
    """
    prompt = torch.as_tensor(prompt_ids).long().cpu()
    if prompt.dim() == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError(f"prompt_ids must be Long [n] or [1, n] with n >= 1, got shape {tuple(prompt.shape)}: "
                         "the reference loop runs one request")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos = _eos_ids(target, eos_token_id)
    sampling = sampling or SamplingConfig(temperature=0.0)
    start = time.perf_counter()
    loop = _Loop(target, drafter, sampling, _verify_method(sampling, method))
    tokens = [loop.prefill(prompt)]
    num_accepted: list[int] = []
    stats = AcceptanceStats()
    try:
        while len(tokens) < max_new_tokens and tokens[-1] not in eos:
            batch = drafter.draft([loop.rid], tree)
            draft_tree = batch.unbind()[0]
            q = None if batch.draft_probs is None else batch.draft_probs[:, : draft_tree.num_nodes]
            emitted, accepted = loop.step(draft_tree, q)
            tokens += emitted
            num_accepted.append(accepted)
            stats.update(torch.tensor([accepted]), draft_tree.num_nodes - 1)
    finally:
        drafter.release([loop.rid])
    tokens = _cut(tokens, eos, max_new_tokens)
    result = GenerationResult(tokens, num_accepted, stats, time.perf_counter() - start)
    logger.debug("reference loop: %d tokens, %d steps, tau %.2f", len(tokens), result.steps, result.tau)
    return result


def _eos_ids(target, eos_token_id) -> set[int]:
    if eos_token_id is None:
        gen = getattr(target, "generation_config", None)
        eos_token_id = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos_token_id is None:
        return set()
    return {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)


def _cut(tokens: list[int], eos: set[int], max_new_tokens: int) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: min(i + 1, max_new_tokens)]
    return tokens[:max_new_tokens]
