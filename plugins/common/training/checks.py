"""Up-front checks of `specplug train`: the target, the output folder, an --init head and
the memory a run needs, each failing with a ValueError before any long work.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from specplug.common.training.config import TrainConfig
from specplug.common.training.output import CHECKPOINT


# ---------------------------------------------------------------------------------------
# Up-front checks: every one runs before the target's weights are loaded
# ---------------------------------------------------------------------------------------
def check_target(target: str | os.PathLike):
    """The target's transformers config; ValueError unless it is a causal LM folder."""
    from transformers import AutoConfig

    path = Path(target)
    if not (path / "config.json").is_file():
        raise ValueError(f"--target {target}: no config.json there; expected a Hugging Face model folder "
                         "(e.g. the output of `specplug testbed`)")
    config = AutoConfig.from_pretrained(path)
    archs = getattr(config, "architectures", None) or []
    if not any(a.endswith("ForCausalLM") for a in archs):
        raise ValueError(f"--target {target}: architectures {archs} is not a causal LM "
                         "(expected a *ForCausalLM model): pass the model that generates, not a head or encoder")
    return config


def check_output(cfg: TrainConfig) -> Path:
    """The output folder, after refusing to overwrite a trained head or checkpoint by accident."""
    out = Path(cfg.out)
    ckpt = out / CHECKPOINT
    held = out.is_dir() and (ckpt.is_dir() or (out / "config.json").is_file())
    if cfg.resume and not (ckpt / "state.json").is_file():
        raise ValueError(f"--resume: {ckpt} holds no checkpoint (state.json); drop --resume to start anew")
    if held and not (cfg.resume or cfg.overwrite):
        raise ValueError(f"--out {out} already holds a head or checkpoint: pass --resume to continue it, "
                         "--overwrite to replace it, or choose another folder")
    return out


def check_init(cfg: TrainConfig, target_config) -> dict | None:
    """The --init head's lineage (folder, steps and CPU minutes behind it), after refusing a
    folder that is not a head of cfg.method for this target; None without --init."""
    if not cfg.init:
        return None
    from specplug.common import formats
    from specplug.common.training import medusa

    method = "medusa" if medusa.is_compact(cfg.init) else formats.load_head(cfg.init, target_config).method
    if method != cfg.method:
        raise ValueError(f"--init {cfg.init} holds a {method} head; `specplug train {cfg.method}` needs a "
                         f"{cfg.method} head (or drop --init to start from scratch)")
    return init_lineage(Path(cfg.init))


def init_lineage(head_dir: Path) -> dict:
    """Steps, minutes and sample tokens of training behind a head folder, read from its
    training.json (its own total when it was itself started with --init); zeros when it
    has none."""
    record = head_dir / "training.json"
    prior = json.loads(record.read_text()) if record.is_file() else {}
    tokens = sum(e["tokens"] for e in prior.get("throughput", {}).get("epochs", []))
    total = prior.get("total") or {"steps": prior.get("steps", 0), "minutes": prior.get("minutes", 0.0),
                                   "tokens": tokens}
    return {"head": str(head_dir), "steps": total["steps"], "minutes": total["minutes"], "tokens": total["tokens"]}


def check_memory(cfg: TrainConfig, target_config, available: int | None = None) -> int:
    """Estimated peak bytes; ValueError when it exceeds the memory available now."""
    vocab, hidden = target_config.vocab_size, target_config.hidden_size
    layers = target_config.num_hidden_layers
    params = 12 * layers * hidden * hidden + 2 * vocab * hidden  # rough Llama count
    tokens = cfg.batch_size * cfg.max_length
    per_token_vocab = {"eagle3": 3 + 4 * cfg.ttt_steps, "medusa": 2 + 4 * cfg.num_heads}[cfg.method]
    need = 4 * params + 4 * tokens * (vocab * per_token_vocab + hidden * (layers + 1 + 20 * cfg.ttt_steps))
    available = _available_memory() if available is None else available
    if available is not None and need > 0.9 * available:
        raise ValueError(
            f"training needs about {need / 2**30:.1f} GiB but {available / 2**30:.1f} GiB is available: "
            f"lower --batch-size ({cfg.batch_size}) or --max-length ({cfg.max_length})")
    return need


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
