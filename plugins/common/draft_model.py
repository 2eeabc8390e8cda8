"""Draft models as drafters: a small causal LM (or the target's own first layers) proposes
trees that the target verifies; with sampled drafting, verification uses the draft's q.

Two ways to get a draft model:

* any Hugging Face causal LM that shares the target's tokenizer (Leviathan et al.,
  Chen et al.); :func:`cut_draft_model` writes one cut out of the target (a subset of
  its layers plus its embedding, final norm and LM head) as an ordinary checkpoint;
* self-speculation (Draft & Verify, LayerSkip, SWIFT): :func:`layer_skip_view` is the
  target itself with layers skipped, sharing the target's weights (no second copy).

:class:`DraftModelDrafter` speaks the drafter protocol of specplug.common.drafters and
drafts either EAGLE-2 dynamic top-k trees (deterministic: verify with the target-only
rule, or greedily) or trees sampled i.i.d. from q at a draft temperature
(specplug.common.dynamic_trees.sampled: verify with ``method="rejection"`` and the returned
``draft_probs``; lossless at any temperature, since acceptance uses q).
:class:`DraftModelTokenDrafter` runs a draft model in the engines (a registered token
drafter, "draft_model").
"""

from __future__ import annotations

import copy
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable, Sequence

import torch
from torch import nn

from . import dynamic_trees
from .attention_masks import additive_mask
from . import tree as tree_lib
from .drafting.engine_layers import cut_config
from .drafting.sampled import SampledDrafts
from .token_drafters import TokenDrafterBase
from .tree import TreeBatch, TreeConfig

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja")


# --------------------------------------------------------------------------- which layers


def parse_layers(spec: str | Sequence[int], num_layers: int) -> tuple[int, ...]:
    """"0-7,28,29" (or a list of ints) -> sorted unique layer ids, validated against
    the target's ``num_layers``. Layer 0 must be kept: it starts the residual stream."""
    if isinstance(spec, str):
        ids: list[int] = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            lo, _, hi = part.partition("-")
            try:
                ids += list(range(int(lo), int(hi or lo) + 1))
            except ValueError:
                raise ValueError(f"layers {spec!r}: {part!r} is not an int or a range a-b; "
                                 "write e.g. \"0-7\" or \"0-5,28,29\"") from None
    else:
        ids = [int(i) for i in spec]
    layers = tuple(sorted(set(ids)))
    if not layers or layers[0] != 0 or layers[-1] >= num_layers:
        raise ValueError(f"layers {spec!r} must be non-empty, include layer 0 and lie in 0..{num_layers - 1} "
                         f"(the target has {num_layers} layers): pick a subset such as \"0-{num_layers // 4}\"")
    return layers


def _decoder(model: nn.Module) -> nn.Module:
    inner = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(inner, "layers", None), nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no .model.layers ModuleList: draft models are cut from "
                        "Llama-style Hugging Face causal LMs (LlamaForCausalLM, Qwen2ForCausalLM, ...)")
    return inner


def layer_skip_view(target: nn.Module, layers: Sequence[int]) -> nn.Module:
    """The target with only ``layers`` run (self-speculation). Shares every weight with
    the target: embedding, kept layers, final norm, LM head. Each kept layer keeps its
    ``layer_idx``, so its KV cache needs as many cache layers as the TARGET has."""
    inner = _decoder(target)
    keep = parse_layers(layers, len(inner.layers))
    view_inner = copy.copy(inner)
    view_inner._modules = dict(inner._modules)  # copy.copy shares the dict: never mutate the target's
    view_inner.layers = nn.ModuleList([inner.layers[i] for i in keep])
    view = copy.copy(target)
    view._modules = dict(target._modules)
    view.model = view_inner
    return view


def cut_draft_model(target_path: str | Path, layers: str | Sequence[int], out: str | Path,
                    *, overwrite: bool = False) -> Path:
    """Write a Hugging Face checkpoint of the target's ``layers`` (plus embedding, final
    norm, LM head and tokenizer files) to ``out``: an ordinary draft model any engine loads."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty: pass overwrite=True (--overwrite) or another --out")
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype="auto")
    inner = _decoder(target)
    num_layers = len(inner.layers)
    keep = parse_layers(layers, num_layers)
    inner.layers = nn.ModuleList([inner.layers[i] for i in keep])
    for new_idx, layer in enumerate(inner.layers):
        layer.self_attn.layer_idx = new_idx
    target.config = cut_config(target.config, keep)
    out.mkdir(parents=True, exist_ok=True)
    target.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(target_path) / name).is_file():
            shutil.copy2(Path(target_path) / name, out / name)
    logger.info("draft model: layers %s of %s (%d of %d) written to %s", list(keep), target_path,
                len(keep), num_layers, out)
    return out


# --------------------------------------------------------------------------- the drafter


@dataclass
class _DraftState:
    """One request: the draft's KV cache over the committed tokens (root included),
    ``length`` entries, and the draft's logits of the token after the root."""

    cache: object
    length: int
    root_token: int
    root_logits: torch.Tensor  # [V] float32


def _crop(cache, length: int) -> None:
    """Drop cache entries from ``length`` on (every filled layer; skipped layers stay empty)."""
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.numel():
            layer.keys, layer.values = keys[:, :, :length], layer.values[:, :, :length]


class DraftModelDrafter:
    """A causal LM drafting for the target (same tokenizer). Needs no target states.

    temperature None: EAGLE-2 dynamic top-k trees (deterministic; TreeBatch.draft_probs
    None). temperature > 0: trees sampled from q = softmax(draft logits / temperature)
    (drafters.SampledDrafts: TreeBatch.draft_probs = q per node; verify with method
    "rejection"); ``seed`` seeds each request's draws so sampled drafts reproduce.

    Invariant: between calls a request's cache holds exactly the committed tokens;
    draft() runs the tree in the same cache and crops it back.
    """

    def __init__(self, model: nn.Module, *, temperature: float | None = None, seed: int | None = None,
                 cache_config=None):
        self.model = model.eval()
        self.sampled = SampledDrafts(temperature, seed)
        self.cache_config = cache_config if cache_config is not None else model.config
        self.states: dict[Hashable, _DraftState] = {}
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype

    @classmethod
    def self_speculative(cls, target: nn.Module, layers: Sequence[int] | str, **kw) -> "DraftModelDrafter":
        """Self-speculation: draft with the target's own ``layers`` (shared weights)."""
        return cls(layer_skip_view(target, layers), cache_config=target.config, **kw)

    def target_hidden_layers(self, num_target_layers: int) -> tuple[int, ...]:
        return ()  # a draft model reads tokens only

    # -- committing ------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, request_ids, prompt_ids, hidden, first_tokens) -> None:
        from transformers import DynamicCache

        self.sampled.start(request_ids, self.device)
        for b, rid in enumerate(request_ids):
            prompt = torch.as_tensor(prompt_ids[b]).long()
            state = _DraftState(DynamicCache(config=self.cache_config), 0, -1, torch.empty(0))
            self.states[rid] = state
            self._extend(state, torch.cat([prompt.cpu(), torch.as_tensor(first_tokens).long().cpu()[b:b + 1]]))

    @torch.no_grad()
    def commit(self, request_ids, accepted_tokens, hidden, bonus) -> None:
        bonus = torch.as_tensor(bonus).long().cpu()
        for b, rid in enumerate(request_ids):
            accepted = torch.as_tensor(accepted_tokens[b]).long().cpu()
            self._extend(self._state(rid), torch.cat([accepted, bonus[b:b + 1]]))

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)
        self.sampled.release(request_ids)

    def _extend(self, state: _DraftState, tokens: torch.Tensor) -> None:
        """Run the committed ``tokens`` [n] causally after the cache; the last one is the new root."""
        positions = torch.arange(state.length, state.length + tokens.shape[0], device=self.device)
        out = self.model(tokens[None].to(self.device), past_key_values=state.cache, use_cache=True,
                         position_ids=positions[None])
        state.length += tokens.shape[0]
        state.root_token = int(tokens[-1])
        state.root_logits = out.logits[0, -1].float()

    def _state(self, rid) -> _DraftState:
        if rid not in self.states:
            raise ValueError(f"request {rid!r} has no draft state: call prefill() for it first")
        return self.states[rid]

    # -- drafting --------------------------------------------------------------------
    @torch.no_grad()
    def draft(self, request_ids, tree: TreeConfig = TreeConfig()) -> TreeBatch:
        """One tree per request (depth, topk, budget from ``tree``), rooted at its last
        committed token. Sampled mode: ``topk`` i.i.d. children of the root, then one
        sampled child per node down to ``depth`` (``budget`` is not used)."""
        trees = [self._draft_one(rid, tree) for rid in request_ids]
        return tree_lib.stack_batches(trees)

    def draft_chain(self, request_ids, k: int) -> TreeBatch:
        return self.draft(request_ids, TreeConfig(depth=k, topk=1, budget=k))

    def _draft_one(self, rid, tree: TreeConfig) -> TreeBatch:
        state = self._state(rid)
        expand = _Expander(self, state)
        root = torch.tensor([state.root_token], device=self.device)
        try:
            return self.sampled.draft(expand, root, state.root_logits.log_softmax(-1)[None], tree, [rid])
        finally:
            _crop(state.cache, state.length)


class _Expander:
    """The expand callback for one request's draft(): runs the draft model on each
    frontier with tree attention, appending the frontier to the (scratch) cache."""

    def __init__(self, drafter: DraftModelDrafter, state: _DraftState):
        self.model, self.state, self.dtype = drafter.model, state, drafter.dtype

    def __call__(self, frontier: dynamic_trees.Frontier) -> torch.Tensor:
        """-> [1, F, V] draft log-probs of the token after each frontier node."""
        dev = frontier.tokens.device
        width = frontier.tokens.shape[1]
        context = torch.ones(width, self.state.length, dtype=torch.bool, device=dev)  # root included
        allowed = torch.cat([context, frontier.expanded_mask[0, :, 1:]], 1)  # [F, S + run so far]
        positions = self.state.length - 1 + frontier.positions  # [1, F]
        out = self.model(frontier.tokens, past_key_values=self.state.cache, use_cache=True,
                         position_ids=positions, attention_mask=additive_mask(allowed, self.dtype))
        return out.logits.float().log_softmax(-1)


# --------------------------------------------------------------------------- in the engines


class DraftModelTokenDrafter(TokenDrafterBase):
    """A draft model as a token drafter (specplug.common.token_drafters, registered as
    "draft_model"): vLLM merges its trees with the head's, SGLang runs it alone
    (--speculative-algorithm DRAFT_MODEL). The base keeps each request's committed
    tokens; before drafting, the draft model's cache is brought to them (cropped to the
    common prefix, the rest run causally), so rollback and preemption cost nothing until
    the next draft. Without `temperature`: deterministic top-k trees, verified with the
    target-only rule. With it: `topk` chains of `max_depth` sampled from q = softmax(draft
    logits / temperature), TreeBatch.draft_probs = q (SGLang verifies with q; vLLM's merge
    with the head keeps the tokens and verifies with the target-only rule, also lossless),
    `seed` seeding each request's draws."""

    def __init__(self, model: str, budget: int = 8, max_depth: int = 4, topk: int = 4, dtype: str = "float32",
                 temperature: float | None = None, seed: int | None = None):
        super().__init__(budget, max_depth)
        self.path, self.topk, self.dtype = model, topk, dtype
        self.temperature, self.seed = temperature, seed
        self.drafter: DraftModelDrafter | None = None  # built by from_settings
        self.valid: dict[Hashable, int] = {}  # leading committed tokens whose KV the draft cache holds

    @classmethod
    def check_settings(cls, settings) -> None:
        super().check_settings(settings)
        cls.check_source(settings)
        if not isinstance(settings.get("topk", 4), int) or settings.get("topk", 4) < 1:
            raise ValueError(f"\"topk\" must be an int >= 1, got {settings.get('topk')!r}")
        SampledDrafts(settings.get("temperature"))  # > 0 or None, else a ValueError naming it

    @classmethod
    def check_source(cls, settings) -> None:
        """The draft model's own field: "model", a Hugging Face folder."""
        path = settings.get("model")
        if not isinstance(path, str) or not (Path(path) / "config.json").is_file():
            raise ValueError(f"draft_model \"model\" must be a Hugging Face model folder, got {path!r}: cut one "
                             "with `specplug draft-model cut` or pass a small causal LM with the target's tokenizer")

    @classmethod
    def from_settings(cls, settings, vocab_size: int) -> "DraftModelTokenDrafter":
        from transformers import AutoModelForCausalLM

        cls.check_settings(settings)
        self = cls(**settings)
        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=getattr(torch, self.dtype))
        if model.config.vocab_size != vocab_size:
            raise ValueError(f"draft model {self.path} has vocab_size {model.config.vocab_size}, the target "
                             f"{vocab_size}: a draft model must share the target's tokenizer")
        self.drafter = DraftModelDrafter(model, temperature=self.temperature, seed=self.seed)
        return self

    def bind_target(self, target) -> None:
        """The engine's target has loaded: the draft model moves to the target's device
        (it loads on the CPU), so it drafts where the engine runs."""
        device = next(target.model.parameters()).device
        if device != self.drafter.device:
            self.drafter.model.to(device)
            self.drafter.device = device
            logger.info("draft model %s moved to %s, the target's device", self.path, device)

    def rollback(self, request_id: Hashable, length: int) -> None:
        super().rollback(request_id, length)
        if request_id in self.valid:
            self.valid[request_id] = min(self.valid[request_id], length)

    def free(self, request_id: Hashable) -> None:
        super().free(request_id)
        self.valid.pop(request_id, None)
        self.drafter.release([request_id])

    @torch.no_grad()
    def draft(self, request_ids, root_tokens=None, *, budget=None, max_depth=None, min_prob=None) -> TreeBatch:
        """Each request's tree from the draft model (EAGLE-2 top-k, or sampled from q);
        scores = the draft's path log-probs (its estimate of acceptance). min_prob is not used."""
        tree = TreeConfig(depth=max_depth or self.max_depth, topk=self.topk, budget=budget or self.budget)
        for rid in request_ids:
            self._catch_up(rid)
        return self.drafter.draft(list(request_ids), tree)

    def _catch_up(self, rid) -> None:
        """Bring the draft cache to the committed tokens: keep the tokens no rollback has
        touched since the last catch-up (at least one token is run again unless the cache
        holds exactly the committed tokens, so the root's logits are fresh), run the rest.
        Tokens only change by appending or by rollback, so that count is the common prefix."""
        committed, state = self.live[rid], self.drafter.states.get(rid)
        valid = self.valid.get(rid, 0)
        if state is not None and valid == state.length == len(committed):
            return
        if state is None:
            from transformers import DynamicCache

            state = self.drafter.states[rid] = _DraftState(DynamicCache(config=self.drafter.cache_config), 0, -1,
                                                           torch.empty(0))
            self.drafter.sampled.start([rid], self.drafter.device)
        keep = min(valid, len(committed) - 1)
        _crop(state.cache, keep)
        state.length = keep
        self.drafter._extend(state, torch.tensor(committed[keep:], dtype=torch.long))
        self.valid[rid] = len(committed)


class SelfSpecTokenDrafter(DraftModelTokenDrafter):
    """Self-speculation in the engines (a registered token drafter, "self_spec"): the
    target's own `layers` (default the first quarter; an int K means layers 0..K-1)
    draft, run on the modules the engine loaded (drafting.engine_layers.EngineLayerSkip:
    no second copy of the weights), with the draft-model drafter's trees, cache and
    sampled mode. The engine adapter calls bind_target once its target has loaded."""

    def __init__(self, layers: str | int | None = None, budget: int = 8, max_depth: int = 4, topk: int = 4,
                 temperature: float | None = None, seed: int | None = None):
        super().__init__("", budget, max_depth, topk, temperature=temperature, seed=seed)
        self.layers = layers

    @classmethod
    def check_source(cls, settings) -> None:
        """self_spec's own field: "layers", a layer list or a count."""
        layers = settings.get("layers")
        if layers is not None and not (isinstance(layers, str) or (isinstance(layers, int) and layers >= 1)):
            raise ValueError(f"self_spec \"layers\" must be a layer list such as \"0-7\" or a count K >= 1 "
                             f"(the first K layers), got {layers!r}")
        if isinstance(layers, str):
            parse_layers(layers, 1 << 30)  # syntax now; the range once the target's layer count is known

    @classmethod
    def from_settings(cls, settings, vocab_size: int) -> "SelfSpecTokenDrafter":
        cls.check_settings(settings)
        return cls(**settings)

    def bind_target(self, target) -> None:
        """Draft with `target`'s (a drafting.engine_layers.EngineTarget) kept layers."""
        from .drafting.engine_layers import EngineLayerSkip

        num_layers = len(target.model.model.layers)
        spec = self.layers if self.layers is not None else max(1, num_layers // 4)
        keep = parse_layers(f"0-{spec - 1}" if isinstance(spec, int) else spec, num_layers)
        model = EngineLayerSkip(target, keep)
        self.drafter = DraftModelDrafter(model, temperature=self.temperature, seed=self.seed,
                                         cache_config=model.cache_config)
        logger.info("self_spec: drafting with the target's layers %s of %d (the engine's own modules)",
                    list(keep), num_layers)

    def draft(self, request_ids, root_tokens=None, *, budget=None, max_depth=None, min_prob=None) -> TreeBatch:
        if self.drafter is None:
            raise RuntimeError("self_spec drafts only after the engine adapter called bind_target(EngineTarget)")
        return super().draft(request_ids, root_tokens, budget=budget, max_depth=max_depth, min_prob=min_prob)
