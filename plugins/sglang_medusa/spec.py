"""specplug's algorithms as SGLang sees them: their names, argument checks, workers and
the hooks on SGLang's config reading (spec_algo.py registers them with SGLang). None has a
draft model in SGLang's sense or draft KV in its pools; the tree lives only in the verify
pass's mask."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

from specplug.common import formats
from specplug.common.heads.medusa import faster_decoding_config
from specplug.common.sglang_backends import check_attention_backends, server_attention_backends
from specplug.sglang_medusa.settings import eagle3_settings, medusa_settings, token_settings

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
    if cfg.model_path and (Path(cfg.model_path) / "config.json").is_file():  # the heads against the target
        formats.load_head(cfg.speculative_draft_model_path, target_config=cfg.model_path)
    logger.info("MEDUSA: heads %s, tree %s, %d nodes, %s verification%s", cfg.speculative_draft_model_path,
                settings.medusa.choices or settings.tree, settings.medusa_nodes, settings.verification.method,
                ", adaptive speculation (specplug)" if settings.adaptive else "")


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


def validate_token_args(server_args) -> None:
    """Reject bad token-drafter arguments before any model loads (runs in the launching process)."""
    cfg = resolving_view(server_args)
    settings = token_settings(str(cfg.speculative_algorithm).lower(), cfg)
    _check_backend(cfg, str(cfg.speculative_algorithm))
    logger.info("%s: drafter %r %s, up to %d draft nodes, depth %d, lossless verification",
                cfg.speculative_algorithm, settings.choice.name, dict(settings.choice.settings),
                settings.budget, settings.max_depth)


def _check_backend(cfg, algorithm: str = NAME) -> None:
    if cfg.device is not None:  # auto-detected later: the worker checks the resolved device (tree_worker)
        check_attention_backends(cfg.device, server_attention_backends(cfg), algorithm)
    if cfg.enable_dp_attention or (cfg.pp_size or 1) > 1:
        raise ValueError(f"{algorithm} does not support data-parallel attention or pipeline parallelism (the "
                         "drafters read the target's hidden states and logits whole, which pipeline stages hold "
                         "apart and attention ranks split by request): drop --enable-dp-attention / --pp-size and "
                         "shard with --tp-size (docs/tensor_parallel.md)")


def handle_args(algorithm: str, server_args) -> None:
    """Fill the tree arguments the algorithm decides (nodes per step, root included; depth;
    topk), then _synchronous_cpu_defaults."""
    cfg = resolving_view(server_args)
    if algorithm == NAME:
        settings = medusa_settings(cfg)
        nodes, depth, topk = settings.medusa_nodes, settings.tree.depth, settings.tree.topk
        if cfg.speculative_num_draft_tokens not in (None, nodes):
            logger.warning("MEDUSA: --speculative-num-draft-tokens %d replaced by the tree's node count %d "
                           "(the tree cannot hold more nodes)", cfg.speculative_num_draft_tokens, nodes)
    elif algorithm == EAGLE3:
        tree = eagle3_settings(cfg).tree
        nodes, depth, topk = tree.budget + 1, tree.depth, tree.topk
    else:
        settings = token_settings(str(cfg.speculative_algorithm).lower(), cfg)
        nodes, depth, topk = settings.num_nodes, settings.max_depth, 1
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


def _worker(module: str, cls: str):
    """A worker factory: SGLang calls it with the server arguments; the worker module is imported then."""

    def factory(server_args):
        return getattr(importlib.import_module(f"specplug.sglang_medusa.{module}"), cls)

    return factory


worker_factory = _worker("worker", "MedusaWorker")
eagle3_worker_factory = _worker("eagle_worker", "Eagle3Worker")
token_worker_factory = _worker("token_worker", "TokenDrafterWorker")


def is_specplug_algorithm(algorithm) -> bool:
    """Whether --speculative-algorithm names one of specplug's algorithms."""
    return algorithm in (NAME, EAGLE3) or algorithm in TOKEN_ALGORITHMS


def config_for_medusa_heads(original, model, *args, **kwargs):
    """AROUND hook on SGLang's get_config, which reads --speculative-draft-model-path as a
    transformers config: a FasterDecoding Medusa folder (no model_type, which AutoConfig
    refuses) answers as a plain PretrainedConfig (architectures ["MedusaHeads"])."""
    config = faster_decoding_config(model)
    if config is None:
        return original(model, *args, **kwargs)
    from transformers import PretrainedConfig

    fields = {k: v for k, v in config.items() if k not in ("specplug", "architectures")}
    return PretrainedConfig(architectures=["MedusaHeads"], **fields)


def skip_draft_config_for_medusa(original, speculative_algorithm, *args, **kwargs):
    """AROUND hook on SGLang's algorithm-alias resolver, which parses the draft path with
    AutoConfig: MEDUSA and SPECPLUG_EAGLE3 are returned as they are (nothing to alias; a
    missing folder then gets specplug's error naming the argument)."""
    if (speculative_algorithm or "").upper() in (NAME, EAGLE3):
        return speculative_algorithm
    return original(speculative_algorithm, *args, **kwargs)
