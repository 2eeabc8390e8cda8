"""Medusa training: residual blocks on the frozen target's last hidden state, and the
compact form in which specplug commits Medusa heads.

Head k at position t predicts token t+k+2 and is scored against the target's own
distribution at position t+k+1 (self-distillation: the label is what the target
would generate, not what the data says). Each head's vocab projection is TIED to the
target's lm_head and frozen; only the residual blocks train (zero-initialised, so an
untrained head k repeats the target's next-token guess). After training, each head's
rank accuracies (accuracies[h][r] = P(head h's rank-r token is the target's top-1),
on held-out conversations) go into the `specplug` section as `head_accuracies`, from
which `specplug.common.static_trees.optimal_sparse` builds the verification tree.

Compact form (`compact`, `materialise`): because the vocab projections equal the
target's lm_head, a Medusa head set is fully described by config.json + its residual
blocks (`medusa_resblocks.safetensors`, ~0.7 MB per head in bf16 for a 576-wide
target, against 57 MB per head for the full FasterDecoding file). `materialise`
rebuilds the standard FasterDecoding folder from the compact one and the target.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from specplug.common.heads.medusa import MedusaConfig, MedusaHeads, ResBlock
from specplug.common.training.config import TrainConfig
from specplug.common.training.output import read_checkpoint_state, specplug_section
from specplug.common.training.samples import Batch, batch_at, shift_left
from specplug.common.training.target import TargetOutput, target_pass

logger = logging.getLogger(__name__)

RESBLOCKS_FILE = "medusa_resblocks.safetensors"


def preflight(cfg: TrainConfig, target_config) -> None:
    """Nothing Medusa-specific to check before the target loads."""


def aux_ids(head, target) -> None:
    return None  # Medusa reads only the last hidden state


def build_head(target, samples, cfg: TrainConfig) -> MedusaHeads:
    tconf = target.config
    config = MedusaConfig(medusa_num_heads=cfg.num_heads, medusa_num_layers=cfg.num_layers,
                          hidden_size=tconf.hidden_size, vocab_size=tconf.vocab_size,
                          base_model_name_or_path=str(cfg.target), specplug=specplug_section("medusa"))
    heads = zero_blocks(MedusaHeads(config))
    tie_to_target(heads, target)
    logger.info("Medusa: %d heads x %d residual blocks, vocab projections tied to the target's lm_head",
                cfg.num_heads, cfg.num_layers)
    return heads.to(cfg.device)


def zero_blocks(module: torch.nn.Module) -> torch.nn.Module:
    """Zero every residual block's linear in `module` (Medusa's init): SiLU(0) = 0 makes
    each block the identity, so an untrained head k repeats the target's next-token guess."""
    with torch.no_grad():
        for block in module.modules():
            if isinstance(block, ResBlock):
                block.linear.weight.zero_()
                block.linear.bias.zero_()
    return module


def grown(heads: MedusaHeads, num_layers: int) -> MedusaHeads:
    """`heads`, in place, with zero (identity) residual blocks inserted before each vocab
    projection up to num_layers: they compute exactly what they did, and training moves
    the new blocks from there. (No projection is rebuilt: they stay tied.)"""
    added = num_layers - heads.config.medusa_num_layers
    for head in heads:
        for _ in range(added):
            head.insert(len(head) - 1, zero_blocks(ResBlock(heads.config.hidden_size)))
    heads.config = dataclasses.replace(heads.config, medusa_num_layers=num_layers)
    return heads


def tie_to_target(heads: MedusaHeads, target) -> None:
    """Make every head's vocab projection the target's (frozen) lm_head weight."""
    weight = target.get_output_embeddings().weight
    for head in heads:
        head[-1].weight = weight


def loss(heads: MedusaHeads, tgt: TargetOutput, batch: Batch, cfg: TrainConfig):
    """Weighted soft cross-entropy of each head against the target's distribution
    k+1 positions later. Returns (loss, top-1 accuracy [heads]): the head's top-1 against
    the target's. Needs the target's full-vocab scores (computed once per batch from
    cached states)."""
    target_scores = tgt.scores()  # [B, T, vocab] float32
    target_top1 = tgt.argmax()  # [B, T]
    total, accuracy = 0.0, []
    for k, head in enumerate(heads):
        rows = shift_left(batch.loss_mask, k + 2).bool()  # token t+k+2 is an assistant token
        bi, ti = rows.nonzero(as_tuple=True)
        if len(bi) == 0:
            accuracy.append(torch.tensor(0.0))
            continue
        logq = F.log_softmax(head(tgt.last_hidden[bi, ti]).float(), dim=-1)  # [N, vocab]
        p = F.softmax(target_scores[bi, ti + k + 1], dim=-1)  # [N, vocab]
        total = total + cfg.step_decay ** k * -(p * logq).sum(-1).mean()
        accuracy.append((logq.argmax(-1) == target_top1[bi, ti + k + 1]).float().mean().detach())
    return total, torch.stack(accuracy)


@torch.no_grad()
def rank_accuracies(heads: MedusaHeads, target, batches, topk: int) -> list[list[float]]:
    """accuracies[h][r]: fraction of scored positions where head h's rank-r token is the
    target's top-1 token for that position (ranks 0..topk-1)."""
    hits = torch.zeros(len(heads), topk)
    seen = torch.zeros(len(heads))
    for batch in batches:
        tgt = target_pass(target, batch)
        for k, head in enumerate(heads):
            rows = shift_left(batch.loss_mask, k + 2).bool()
            bi, ti = rows.nonzero(as_tuple=True)
            top = head(tgt.last_hidden[bi, ti]).topk(topk, dim=-1).indices  # [N, topk]
            label = tgt.logits[bi, ti + k + 1].argmax(-1)  # [N]
            hits[k] += (top == label[:, None]).float().sum(0)
            seen[k] += len(bi)
    return [[round(float(x), 4) for x in row] for row in hits / seen.clamp(min=1)[:, None]]


def checkpoint_tensors(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    """Only the trained residual blocks (the vocab projections are the target's)."""
    return {k: v.float() for k, v in heads.state_dict().items() if ".linear." in k}


def head_config(heads: MedusaHeads) -> dict:
    return heads.config.to_dict()


def init_head(head_dir: Path, target, cfg: TrainConfig, samples=()) -> MedusaHeads:
    """Trained heads to continue from (--init): their residual blocks, float32, the vocab
    projections tied to the target's lm_head again; a larger --num-layers appends identity
    blocks (`grown`); ValueError when --heads differs or --num-layers is smaller.
    (`samples` is EAGLE-3's, for --revocab; Medusa heads predict the whole vocabulary.)"""
    from specplug.common import formats

    if is_compact(head_dir):  # the committed form: residual blocks only
        heads = load_compact(head_dir)
    else:
        heads = formats.load_head_module(head_dir, target.config, dtype=torch.float32)
    had = heads.config.medusa_num_layers
    if heads.config.medusa_num_heads != cfg.num_heads or had > cfg.num_layers:
        raise ValueError(f"--init {head_dir} has {heads.config.medusa_num_heads} heads x {had} blocks, this run "
                         f"asks for {cfg.num_heads} x {cfg.num_layers}: pass --heads "
                         f"{heads.config.medusa_num_heads} and --num-layers {had} or more (added blocks start "
                         "as the identity)")
    if had < cfg.num_layers:
        heads = grown(heads, cfg.num_layers)
    tie_to_target(heads, target)
    logger.info("Medusa: %d heads x %d residual blocks from %s%s", cfg.num_heads, cfg.num_layers, head_dir,
                f" ({cfg.num_layers - had} added as the identity)" if had < cfg.num_layers else "")
    return heads.to(cfg.device).train()


def is_compact(folder: str | Path) -> bool:
    """A compact Medusa folder (config.json + residual blocks, no vocab projections)."""
    return (Path(folder) / RESBLOCKS_FILE).is_file()


def load_compact(folder: str | Path) -> MedusaHeads:
    """The residual blocks of a compact folder in float32 heads whose vocab projections
    are still untied (tie_to_target gives them the target's); ValueError when a block is missing."""
    from safetensors.torch import load_file

    folder = Path(folder)
    blocks = {k: v.float() for k, v in load_file(str(folder / RESBLOCKS_FILE)).items()}
    heads, missing = heads_with_blocks(json.loads((folder / "config.json").read_text()), blocks)
    if missing:
        raise ValueError(f"{folder / RESBLOCKS_FILE} lacks residual blocks {missing} that its config.json calls "
                         "for: rewrite the folder with `specplug train medusa` or keep the full head")
    return heads


def heads_with_blocks(config: dict, blocks: dict[str, torch.Tensor]) -> tuple[MedusaHeads, list[str]]:
    """Heads built from a config dict with `blocks` loaded into them, and the residual-block
    tensors `blocks` did not hold (the vocab projections are not looked for)."""
    heads = MedusaHeads(MedusaConfig.from_dict(config))
    missing = heads.load_state_dict(blocks, strict=False).missing_keys
    return heads, [k for k in missing if ".linear." in k]


def load_checkpoint(ckpt: Path, target, cfg: TrainConfig):
    state, tensors, config = read_checkpoint_state(ckpt)
    heads, missing = heads_with_blocks(config, tensors)
    tie_to_target(heads, target)
    if missing:
        raise ValueError(f"checkpoint {ckpt} lacks residual blocks {missing}: it was written for other settings")
    logger.info("resuming Medusa training at step %d", state["step"])
    return heads.to(cfg.device), state


def save_output(heads: MedusaHeads, out: Path, cfg: TrainConfig, state: dict, ctx) -> list[str]:
    """Measure rank accuracies on the held-out samples, then write FasterDecoding (default) format."""
    from specplug.common import formats

    count = -(-len(ctx.heldout) // cfg.batch_size)
    batches = [Batch(*(x.to(cfg.device) for x in batch_at(ctx.heldout, i, cfg.batch_size, ctx.pad_id)))
               for i in range(count)]
    accuracies = rank_accuracies(heads, ctx.target, batches, cfg.topk) if batches else None
    config = heads.config.to_dict()
    config["specplug"] = specplug_section("medusa", head_accuracies=accuracies)
    dtype = getattr(torch, cfg.save_dtype)
    tensors = {k: v.detach().to("cpu", dtype) for k, v in heads.state_dict().items()}
    report = formats.save_head((config, tensors), out, cfg.format or "medusa", target_config=cfg.target,
                               overwrite=True)
    state["head_accuracies"] = accuracies
    return report.files


# ---------------------------------------------------------------------------------------
# Compact form: config.json + residual blocks; vocab projections = the target's lm_head
# ---------------------------------------------------------------------------------------
def target_lm_head(target_dir: str | Path) -> torch.Tensor:
    """The target's lm_head weight [vocab, hidden] read from its safetensors (tied -> embedding)."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    names = ["lm_head.weight"] + (["model.embed_tokens.weight"] if config.get("tie_word_embeddings") else [])
    for file in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                if name in f.keys():
                    return f.get_tensor(name)
    raise ValueError(f"{target_dir}: no {names} in its safetensors files; cannot tie Medusa vocab projections")


def compact(full_dir: str | Path, out_dir: str | Path, target_dir: str | Path) -> Path:
    """Write the compact form of a FasterDecoding head whose vocab projections are the target's."""
    from safetensors.torch import save_file

    from specplug.common import formats

    head = formats.load_head(full_dir, target_dir)
    layers = head.config["medusa_num_layers"]
    lm_head = target_lm_head(target_dir)
    for k in range(head.config["medusa_num_heads"]):
        proj = head.state_dict[f"{k}.{layers}.weight"]
        if not torch.equal(proj, lm_head.to(proj.dtype)):
            raise ValueError(f"head {k}'s vocab projection differs from the target's lm_head: "
                             "this head set was not trained tied; keep the full FasterDecoding folder")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    blocks = {k: v.contiguous() for k, v in head.state_dict.items() if ".linear." in k}
    save_file(blocks, str(out / RESBLOCKS_FILE))
    (out / "config.json").write_text(json.dumps(head.config, indent=2, sort_keys=True) + "\n")
    return out


def materialise(compact_dir: str | Path, target_dir: str | Path, out_dir: str | Path,
                *, overwrite: bool = False) -> Path:
    """Rebuild the FasterDecoding folder (validated) from a compact head and its target."""
    from safetensors.torch import load_file

    from specplug.common import formats

    compact_dir = Path(compact_dir)
    config = json.loads((compact_dir / "config.json").read_text())
    blocks = load_file(str(compact_dir / RESBLOCKS_FILE))
    dtype = next(iter(blocks.values())).dtype
    state = with_vocab_projections(config, blocks, target_lm_head(target_dir).to(dtype))
    formats.save_head((config, state), out_dir, "medusa", target_config=str(target_dir), overwrite=overwrite)
    formats.validate(formats.load_head(out_dir), str(target_dir))
    return Path(out_dir)


def with_vocab_projections(config: dict, blocks: dict, lm_head: torch.Tensor) -> dict:
    """A compact head's residual blocks completed to the FasterDecoding state dict: every
    head's vocab projection ({head}.{medusa_num_layers}.weight) is `lm_head`, the target's."""
    state = dict(blocks)
    for k in range(config["medusa_num_heads"]):
        state[f"{k}.{config['medusa_num_layers']}.weight"] = lm_head
    return state


def inspect_compact(compact_dir: str | Path, target_config=None):
    """A dry run of materialise() without the target's weights (`specplug doctor`): the
    FasterDecoding head it would write, validated (against `target_config` too), with its
    residual blocks read from the safetensors header and the target's lm_head as a
    shape-only stand-in [vocab_size, hidden_size] of the compact config.json. Returns the
    formats.LoadedHead (meta tensors); raises formats.CheckpointError naming the field."""
    from specplug.common import formats

    compact_dir = Path(compact_dir)
    config = json.loads((compact_dir / "config.json").read_text())
    blocks = formats.read_header(compact_dir / RESBLOCKS_FILE)
    state = dict(blocks)
    vocab, hidden = config.get("vocab_size"), config.get("hidden_size")
    counts = (config.get("medusa_num_heads"), config.get("medusa_num_layers"))
    if blocks and all(isinstance(v, int) for v in (vocab, hidden, *counts)):  # else validate names the field
        dtype = next(iter(blocks.values())).dtype
        state = with_vocab_projections(config, blocks, torch.empty(vocab, hidden, dtype=dtype, device="meta"))
    head = formats.LoadedHead(method="medusa", format="medusa", config=config, state_dict=state,
                              extra={"format": "medusa", "config": config, "tensors": {}, "compact": True},
                              path=str(compact_dir), tensor_files={name: RESBLOCKS_FILE for name in blocks})
    formats.validate(head, target_config)
    return head
