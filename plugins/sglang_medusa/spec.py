"""specplug's algorithms as SGLang sees them: their names, argument checks, workers and
the hooks on SGLang's config reading (spec_algo.py registers them with SGLang).

MEDUSA's heads read the target's last hidden state; SPECPLUG_EAGLE3's head the target's
aux states (its small KV is specplug's own, dense, outside SGLang's pools); every
registered token drafter (specplug.common.token_drafters: "retrieval" -> RETRIEVAL, and
any a plugin adds under the entry-point group "specplug") reads tokens only. None has a
draft model in SGLang's sense or draft KV in its pools; the tree lives only in the verify
pass's mask.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from specplug.common import formats
from specplug.sglang_medusa.attention_backends import check_attention_backends, server_attention_backends
from specplug.sglang_medusa.settings import eagle3_settings, medusa_nodes, medusa_settings, token_settings

try:  # SGLang is present whenever SGLang's plugin loader or a worker imports this module
    from sglang.srt.arg_groups.overrides import resolving_view
except ImportError as exc:  # pragma: no cover - import-time guard for engine-free installs
    raise ImportError("specplug.sglang_medusa needs SGLang 0.5.23: pip install 'specplug[sglang]'") from exc

logger = logging.getLogger(__name__)

NAME = "MEDUSA"
EAGLE3 = "SPECPLUG_EAGLE3"  # SGLang's own EAGLE3 does not start on a CPU
TOKEN_ALGORITHMS: set[str] = set()  # token drafters registered by this process (upper case)


def validate_server_args(server_args) -> None:
    """Reject bad MEDUSA arguments before any model loads (runs in the launching process)."""
    cfg = resolving_view(server_args)
    settings = medusa_settings(cfg, adaptive_arg=bool(getattr(server_args, "speculative_adaptive", False)))
    _check_backend(cfg)
    _check_heads_against_target(cfg.speculative_draft_model_path, cfg.model_path)
    logger.info("MEDUSA: heads %s, tree %s, %d nodes, %s verification%s", cfg.speculative_draft_model_path,
                settings.medusa.choices or settings.tree, medusa_nodes(settings), settings.verification.method,
                ", adaptive speculation (specplug)" if settings.adaptive else "")


def _check_backend(cfg, algorithm: str = NAME) -> None:
    if cfg.device is not None:  # auto-detected later: the worker checks the resolved device (tree_worker)
        check_attention_backends(cfg.device, server_attention_backends(cfg), algorithm)
    if cfg.enable_dp_attention or (cfg.pp_size or 1) > 1:
        raise ValueError(f"{algorithm} does not support data-parallel attention or pipeline parallelism (the "
                         "drafters read the target's hidden states and logits whole, which pipeline stages hold "
                         "apart and attention ranks split by request): drop --enable-dp-attention / --pp-size and "
                         "shard with --tp-size (docs/tensor_parallel.md)")


def _check_heads_against_target(heads_path: str, model_path: str) -> None:
    """Shapes, dtypes and vocab of the heads against the target's config.json (specplug.common.formats)."""
    if model_path and (Path(model_path) / "config.json").is_file():
        formats.load_head(heads_path, target_config=model_path)


def handle_server_args(server_args) -> None:
    """Fill the arguments MEDUSA decides: node count from the tree, synchronous schedule."""
    cfg = resolving_view(server_args)
    settings = medusa_settings(cfg)
    given, nodes = cfg.speculative_num_draft_tokens, medusa_nodes(settings)
    if given is not None and given != nodes:
        logger.warning("MEDUSA: --speculative-num-draft-tokens %d replaced by the tree's node count %d "
                       "(the tree cannot hold more nodes)", given, nodes)
    _fill(server_args, cfg, nodes, settings.tree.depth, settings.tree.topk)


def validate_eagle3_args(server_args) -> None:
    """Reject bad SPECPLUG_EAGLE3 arguments before any model loads (runs in the launching process)."""
    cfg = resolving_view(server_args)
    settings = eagle3_settings(cfg)
    _check_backend(cfg, EAGLE3)
    path = cfg.speculative_draft_model_path
    head = formats.load_head(path, target_config=cfg.model_path)
    if head.method not in ("eagle3", "eagle1"):
        raise ValueError(f"{EAGLE3}: --speculative-draft-model-path {path} holds a {head.method} "
                         "head, not EAGLE-3 or EAGLE-1: use --speculative-algorithm MEDUSA for Medusa heads")
    logger.info("%s: head %s, dynamic trees %s, lossless verification", EAGLE3, path, settings.tree)


def handle_eagle3_args(server_args) -> None:
    """Fill the arguments the tree decides: the most nodes a step verifies, synchronous schedule."""
    cfg = resolving_view(server_args)
    tree = eagle3_settings(cfg).tree
    _fill(server_args, cfg, tree.budget + 1, tree.depth, tree.topk)


def validate_token_args(server_args) -> None:
    """Reject bad token-drafter arguments before any model loads (runs in the launching process)."""
    cfg = resolving_view(server_args)
    settings = _token_settings(cfg)
    _check_backend(cfg, str(cfg.speculative_algorithm))
    logger.info("%s: drafter %r %s, up to %d draft nodes, depth %d, lossless verification",
                cfg.speculative_algorithm, settings.choice.name, dict(settings.choice.settings),
                settings.budget, settings.max_depth)


def handle_token_args(server_args) -> None:
    """Fill the arguments a token drafter decides: the most nodes a tree may have, synchronous schedule."""
    cfg = resolving_view(server_args)
    settings = _token_settings(cfg)
    _fill(server_args, cfg, settings.num_nodes, settings.max_depth, 1)


def _token_settings(cfg):
    return token_settings(str(cfg.speculative_algorithm).lower(), cfg)


def _fill(server_args, cfg, nodes: int, depth: int, topk: int) -> None:
    """The tree arguments the algorithm decided (nodes per step, root included; depth;
    topk), then _synchronous_cpu_defaults."""
    server_args.speculative_num_draft_tokens = nodes
    server_args.speculative_num_steps = depth
    server_args.speculative_eagle_topk = topk
    _synchronous_cpu_defaults(server_args, cfg)


def _synchronous_cpu_defaults(server_args, cfg) -> None:
    """Every specplug algorithm: synchronous worker, torch_native on CPU, no mixed chunks, 48 requests."""
    server_args.disable_overlap_schedule = True
    if cfg.device == "cpu" and cfg.attention_backend is None:
        server_args.attention_backend = "torch_native"  # the CPU backend with tree verification
    server_args.enable_mixed_chunk = False
    if cfg.max_running_requests is None:
        server_args.max_running_requests = 48


def token_worker_factory(server_args):
    from specplug.sglang_medusa.token_worker import TokenDrafterWorker

    return TokenDrafterWorker


def worker_factory(server_args):
    from specplug.sglang_medusa.worker import MedusaWorker

    return MedusaWorker


def eagle3_worker_factory(server_args):
    from specplug.sglang_medusa.eagle_worker import Eagle3Worker

    return Eagle3Worker


def is_specplug_algorithm(algorithm) -> bool:
    """Whether --speculative-algorithm names one of specplug's algorithms."""
    return algorithm in (NAME, EAGLE3) or algorithm in TOKEN_ALGORITHMS


def handle_args(algorithm: str, server_args) -> None:
    """The server-argument handler of a specplug algorithm."""
    handlers = {NAME: handle_server_args, EAGLE3: handle_eagle3_args}
    handlers.get(algorithm, handle_token_args)(server_args)


def _medusa_heads_config(path) -> dict | None:
    """The config.json of a Medusa heads folder (FasterDecoding: no model_type), else None."""
    config_file = Path(str(path)) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    return config if "medusa_num_heads" in config and "model_type" not in config else None


def config_for_medusa_heads(original, model, *args, **kwargs):
    """AROUND hook on SGLang's get_config: SGLang reads --speculative-draft-model-path as a
    transformers config in several places (algorithm aliases, collective defaults).
    FasterDecoding Medusa configs have no model_type, so AutoConfig rejects them; answer
    with a plain PretrainedConfig (architectures ["MedusaHeads"]) for exactly those folders."""
    config = _medusa_heads_config(model)
    if config is None:
        return original(model, *args, **kwargs)
    from transformers import PretrainedConfig

    fields = {k: v for k, v in config.items() if k not in ("specplug", "architectures")}
    return PretrainedConfig(architectures=["MedusaHeads"], **fields)


def skip_draft_config_for_medusa(original, speculative_algorithm, *args, **kwargs):
    """AROUND hook: SGLang parses --speculative-draft-model-path with transformers'
    AutoConfig to spot Gemma-4 drafts; Medusa heads' config.json has no model_type, so
    for MEDUSA and SPECPLUG_EAGLE3 the name is returned as is (there is nothing to alias,
    and a missing folder then gets specplug's error naming the argument, not a Hub one)."""
    if (speculative_algorithm or "").upper() in (NAME, EAGLE3):
        return speculative_algorithm
    return original(speculative_algorithm, *args, **kwargs)
