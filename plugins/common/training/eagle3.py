"""EAGLE-3 training: the draft vocabulary, the head's start, the training-time-test loss.

Draft vocabulary invariant (the SpecForge#534 bug made impossible): `install_draft_vocab`
is the ONE place that sets `d2t`, `t2d` and the lm_head rows, all from the same sorted
list of target ids, at head creation (or, with --revocab, when a trained head moves to a
new vocabulary before its first step: `remap_draft_vocab`). Afterwards the mapping only
travels inside the head's state_dict (checkpoint, resume, output); nothing re-derives
it, and the loss reads its labels through the head's own `d2t` (`draft_token_ids`), so
labels and lm_head rows cannot disagree.

Training-time test (EAGLE-3 paper, §3): step j of a batch unrolls the head on its own
output of step j-1. Row i of step j stands for draft position i + j: input token
ids[i+j+1], hidden = step j-1's pre-norm output at row i (step 0: fc(aux) at i), RoPE
position i + j; it predicts token i+j+2 and is scored against the target's
distribution at position i+j+1 (restricted to the draft vocabulary). It attends to
step 0's keys at rows <= i (the verified context) and to its own row in steps 1..j
(its ancestors in a draft chain), exactly what it sees when drafting.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from specplug.common.heads.eagle3 import Eagle3Config, Eagle3Head, Eagle3LaterLayer, default_aux_layer_ids
from specplug.common.training.config import TrainConfig
from specplug.common.training.output import read_checkpoint_state, specplug_section
from specplug.common.training.samples import Batch, shift_left
from specplug.common.training.target import TargetOutput

logger = logging.getLogger(__name__)

INIT_STD = 0.02


def token_counts(samples, vocab_size: int) -> torch.Tensor:
    """Count of each target id among the assistant (loss-masked) tokens: [vocab] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        ids = torch.tensor([t for t, m in zip(s.input_ids, s.loss_mask) if m], dtype=torch.long)
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocab_ids(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent target ids (ties: lower id first), sorted ascending: [size]."""
    if not 1 <= size <= counts.numel():
        raise ValueError(f"draft_vocab_size must be in [1, {counts.numel()}] (the target vocab), got {size}")
    order = torch.argsort(-counts * counts.numel() + torch.arange(counts.numel()), stable=True)
    return order[:size].sort().values


def install_draft_vocab(head: Eagle3Head, token_ids: torch.Tensor, target_lm_head: torch.Tensor) -> None:
    """Set d2t, t2d and the lm_head rows together from ascending target ids [draft_vocab].

    d2t[i] = token_ids[i] - i (target id = i + d2t[i]); t2d[t] = t is in the draft vocab;
    lm_head row i starts as the target's lm_head row token_ids[i].
    """
    draft_vocab = head.config.draft_vocab_size
    if token_ids.shape != (draft_vocab,) or bool((token_ids[1:] <= token_ids[:-1]).any()):
        raise ValueError(f"token_ids must be {draft_vocab} strictly ascending target ids, got shape "
                         f"{tuple(token_ids.shape)}")
    with torch.no_grad():
        head.d2t.copy_(token_ids - torch.arange(draft_vocab))
        head.t2d.zero_()
        head.t2d[token_ids] = True
        head.lm_head.weight.copy_(target_lm_head[token_ids])


def remap_draft_vocab(head: Eagle3Head, token_ids: torch.Tensor, target_lm_head: torch.Tensor) -> int:
    """Move a trained head to the draft vocab `token_ids` (ascending target ids
    [draft_vocab]) through install_draft_vocab; rows of ids it already drafted then get
    their trained weights back, so only new ids start from the target's rows. Returns how
    many rows were kept."""
    old_ids = draft_token_ids(head)  # [draft_vocab], ascending
    old_rows = head.lm_head.weight.detach().clone()  # [draft_vocab, H]
    install_draft_vocab(head, token_ids, target_lm_head)
    at = torch.searchsorted(old_ids, token_ids).clamp(max=old_ids.numel() - 1)  # [draft_vocab]
    kept = old_ids[at] == token_ids
    with torch.no_grad():
        head.lm_head.weight[kept] = old_rows[at[kept]].to(head.lm_head.weight.dtype)
    return int(kept.sum())


def coverage(head: Eagle3Head, counts: torch.Tensor) -> float:
    """Share of the counted tokens (token_counts) that the head's draft vocab holds."""
    return float(counts[draft_token_ids(head)].sum()) / max(1, int(counts.sum()))


def draft_token_ids(head: Eagle3Head) -> torch.Tensor:
    """Target id of each draft-vocab row, read from the head's own d2t: [draft_vocab]."""
    return head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=head.d2t.device))


def aux_ids(head: Eagle3Head, target) -> tuple[int, ...]:
    return head.config.resolved_aux_layer_ids(target.config.num_hidden_layers)


def preflight(cfg: TrainConfig, target_config) -> tuple[int, ...]:
    """The aux layer ids to train with; ValueError unless 3 distinct ascending ids < L."""
    num_layers = target_config.num_hidden_layers
    layers = tuple(cfg.aux_layer_ids or default_aux_layer_ids(num_layers))
    if len(layers) != 3 or list(layers) != sorted(set(layers)) or not 0 <= layers[0] < layers[-1] < num_layers:
        raise ValueError(f"EAGLE-3 aux layer ids {list(layers)} must be 3 distinct ascending ids in "
                         f"[0, {num_layers}) (engines concatenate them in ascending order): "
                         "pass --aux-layers, e.g. --aux-layers 1,2,3 for a 4-layer target")
    return layers


def build_head(target, samples, cfg: TrainConfig) -> Eagle3Head:
    """A new head shaped like the target, with the draft vocab from the samples' token counts.

    Start: lm_head rows and final norm copied from the target, fc passing the HIGH aux
    state through (fc = [0, 0, I]), the decoder layers N(0, 0.02) — so the untrained
    head already reads the target's own late features through the target's own output
    layer, and training learns the one-token shift.
    """
    tconf = target.config
    vocab = tconf.vocab_size
    size = min(cfg.draft_vocab_size, vocab)
    counts = token_counts(samples, vocab)
    ids = draft_vocab_ids(counts, size)
    layers = preflight(cfg, tconf)
    config = Eagle3Config.for_target(tconf, draft_vocab_size=size, aux_layer_ids=tuple(layers),
                                     num_hidden_layers=cfg.num_layers, specplug=specplug_section("eagle3"))
    head = Eagle3Head(config)
    _init_weights(head, target)
    install_draft_vocab(head, ids, target.get_output_embeddings().weight.detach().float())
    head.set_target_embedding(target.get_input_embeddings())
    logger.info("EAGLE-3 head: %d decoder layer(s), draft vocab %d of %d (covers %.1f%% of assistant tokens), "
                "aux layers %s", cfg.num_layers, size, vocab, 100 * coverage(head, counts), list(layers))
    return head.to(cfg.device)


def _init_weights(head: Eagle3Head, target) -> None:
    h = head.config.hidden_size
    with torch.no_grad():
        for layer in [head.midlayer, *head.later_layers()]:
            _normal_linears(layer)
        head.fc.weight.zero_()
        if head.config.target_hidden_size == h:
            head.fc.weight[:, 2 * h:] = torch.eye(h)
        norm = getattr(target.base_model, "norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.shape == (h,):
            head.norm.weight.copy_(norm.weight.float())


def _normal_linears(module: torch.nn.Module) -> torch.nn.Module:
    """Every linear in `module` drawn from N(0, INIT_STD), biases zero."""
    with torch.no_grad():
        for linear in module.modules():
            if isinstance(linear, torch.nn.Linear):
                linear.weight.normal_(0.0, INIT_STD)
                if linear.bias is not None:
                    linear.bias.zero_()
    return module


def identity_layer(config: Eagle3Config) -> Eagle3LaterLayer:
    """A later decoder layer that is the identity: o_proj and down_proj zero (both
    residual branches add 0), the other linears N(0, INIT_STD) so that training moves
    them once o_proj and down_proj leave zero."""
    layer = _normal_linears(Eagle3LaterLayer(config))
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    return layer


def grown(head: Eagle3Head, num_layers: int) -> Eagle3Head:
    """`head`, in place, with identity decoder layers (identity_layer) appended up to
    num_layers: it computes exactly what it did, and training moves the new layers from
    there."""
    had = head.config.num_hidden_layers
    config = dataclasses.replace(head.config, num_hidden_layers=num_layers)
    for i in range(had, num_layers):
        head.layers[str(i)] = identity_layer(config).to(head.fc.weight)
    head.config = config
    return head


def ttt_mask(attention_mask: torch.Tensor, step: int) -> torch.Tensor:
    """Bool [B, T, (step+1)*T]: causal over step 0's keys (real tokens only), then the
    diagonal for each of steps 1..step (a row's own ancestors)."""
    b, t = attention_mask.shape
    causal = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril()
    blocks = [causal[None] & attention_mask[:, None, :].bool()]
    eye = torch.eye(t, dtype=torch.bool, device=attention_mask.device)[None].expand(b, t, t)
    return torch.cat(blocks + [eye] * step, dim=-1)


def loss(head: Eagle3Head, tgt: TargetOutput, batch: Batch, cfg: TrainConfig):
    """Weighted soft cross-entropy over cfg.ttt_steps unrolled steps.

    Returns (loss, accuracy [ttt_steps]) where accuracy[j] is the fraction of scored rows
    whose draft top-1 (mapped to a target id) equals the target's top-1 (over its full
    vocab). Reads the target's scores on the draft vocab only (`TargetOutput.scores`), so
    cached states need no full-vocab matmul.
    """
    b, t = batch.input_ids.shape
    vocab_ids = draft_token_ids(head)  # [draft_vocab]
    target_scores = tgt.scores(vocab_ids)  # [B, T, draft_vocab] float32
    target_top1 = tgt.argmax()  # [B, T] target ids
    hidden = head.combine(tgt.aux)  # [B, T, H]
    base = torch.arange(t, device=hidden.device)[None].expand(b, t)  # [B, T]
    past, total, accuracy = None, 0.0, []
    for j in range(cfg.ttt_steps):
        inputs = shift_left(batch.input_ids, j + 1)  # token i+j+1
        out = head(inputs, hidden, base + j, ttt_mask(batch.attention_mask, j), past)
        logits = head.compute_logits(out.normed)  # [B, T, draft_vocab]
        rows = shift_left(batch.loss_mask, j + 2).bool()  # token i+j+2 is an assistant token
        bi, ti = rows.nonzero(as_tuple=True)
        p = F.softmax(target_scores[bi, ti + j + 1], dim=-1)  # [N, draft_vocab] target probs of token i+j+2
        logq = F.log_softmax(logits[bi, ti].float(), dim=-1)  # [N, draft_vocab]
        step_loss = -(p * logq).sum(-1).mean() if len(bi) else logits.sum() * 0.0
        total = total + cfg.step_decay ** j * step_loss
        hit = vocab_ids[logq.argmax(-1)] == target_top1[bi, ti + j + 1]
        accuracy.append(hit.float().mean() if len(bi) else torch.tensor(0.0))
        k, v = out.kv
        past = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        hidden = out.hidden
    return total, torch.stack([a.detach() for a in accuracy])


def checkpoint_tensors(head: Eagle3Head) -> dict[str, torch.Tensor]:
    return {k: v.float() if v.is_floating_point() else v for k, v in head.state_dict().items()}


def head_config(head: Eagle3Head) -> dict:
    return head.config.to_dict()


def load_checkpoint(ckpt: Path, target, cfg: TrainConfig):
    """Head and loop state from a checkpoint; d2t/t2d come from it, never re-derived."""
    state, tensors, config = read_checkpoint_state(ckpt)
    head = Eagle3Head.from_state_dict(Eagle3Config.from_dict(config), tensors,
                                      target_embedding=target.get_input_embeddings())
    logger.info("resuming EAGLE-3 training at step %d", state["step"])
    return head.to(cfg.device), state


def init_head(head_dir: Path, target, cfg: TrainConfig, samples=()) -> Eagle3Head:
    """A trained head to continue from (--init): its weights, draft vocabulary and aux
    layers, float32 and trainable; ValueError when --aux-layers asks for others. With
    --revocab the draft vocabulary is rebuilt from `samples` (remap_draft_vocab)."""
    from specplug.common import formats

    head = formats.load_head_module(head_dir, target.config, dtype=torch.float32)
    layers = head.config.resolved_aux_layer_ids(target.config.num_hidden_layers)
    if cfg.aux_layer_ids and tuple(cfg.aux_layer_ids) != tuple(layers):
        raise ValueError(f"--aux-layers {list(cfg.aux_layer_ids)} differs from --init {head_dir}'s aux layers "
                         f"{list(layers)}: drop --aux-layers (a trained head keeps its layers)")
    had = head.config.num_hidden_layers
    if had > cfg.num_layers:
        raise ValueError(f"--init {head_dir} has {had} decoder layers, this run asks for {cfg.num_layers}: pass "
                         f"--num-layers {had} or more (added layers start as the identity)")
    head.set_target_embedding(target.get_input_embeddings())
    if had < cfg.num_layers:
        grown(head, cfg.num_layers)
    logger.info("EAGLE-3 head from %s: %d decoder layer(s)%s, draft vocab %d, aux layers %s", head_dir,
                cfg.num_layers, f" ({cfg.num_layers - had} added as the identity)" if had < cfg.num_layers else "",
                head.config.draft_vocab_size, list(layers))
    if cfg.revocab:
        _revocab(head, target, samples)
    elif samples:
        logger.info("its draft vocab covers %.1f%% of this data's reply tokens (--revocab rebuilds it from the "
                    "data)", 100 * coverage(head, token_counts(samples, target.config.vocab_size)))
    return head.to(cfg.device).train()


def _revocab(head: Eagle3Head, target, samples) -> None:
    """--revocab: the draft vocab of the samples' most frequent reply tokens, logged with
    the share of reply tokens it covers before and after."""
    counts = token_counts(samples, target.config.vocab_size)
    before = coverage(head, counts)
    ids = draft_vocab_ids(counts, head.config.draft_vocab_size)
    kept = remap_draft_vocab(head, ids, target.get_output_embeddings().weight.detach().float())
    logger.info("--revocab: draft vocab rebuilt from the data: covers %.1f%% of reply tokens (was %.1f%%); "
                "%d of %d rows kept their trained weights", 100 * coverage(head, counts), 100 * before, kept,
                ids.numel())


def save_output(head: Eagle3Head, out: Path, cfg: TrainConfig, state: dict, ctx) -> list[str]:
    """Write the head (EAGLE/SpecForge format by default) in cfg.save_dtype."""
    from specplug.common import formats

    dtype = getattr(torch, cfg.save_dtype)
    tensors = {k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu())
               for k, v in head.state_dict().items()}
    config = head.config.to_dict()
    report = formats.save_head((config, tensors), out, cfg.format or "eagle3", target_config=cfg.target,
                               overwrite=True)
    return report.files
