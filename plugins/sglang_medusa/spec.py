"""specplug's algorithms as SGLang sees them: registration, scheduler answers, argument checks.

`register_medusa()` and `register_retrieval()` call `SpeculativeAlgorithm.register(NAME,
...)` with `SpecplugSpecAlgo`, a `CustomSpecAlgo` that also answers the questions SGLang
0.5.23's scheduler asks every algorithm (`carries_draft_hidden_states`,
`create_future_map`, `need_topk`, ...). Neither has a draft model or draft KV: MEDUSA's
heads read the target's last hidden state, RETRIEVAL reads tokens only, and the tree
lives only in the verify pass's mask.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

NAME = "MEDUSA"
RETRIEVAL = "RETRIEVAL"


def validate_server_args(server_args) -> None:
    """Reject bad MEDUSA arguments before any model loads (runs in the launching process)."""
    from sglang.srt.arg_groups.overrides import resolving_view

    from specplug.sglang_medusa.settings import settings_from_server_args

    cfg = resolving_view(server_args)
    settings = settings_from_server_args(cfg, adaptive_arg=bool(getattr(server_args, "speculative_adaptive", False)))
    _check_backend(cfg)
    _check_heads_against_target(settings.heads_path, cfg.model_path)
    logger.info("MEDUSA: heads %s, tree %s, %d nodes, %s verification%s", settings.heads_path,
                settings.choices or settings.tree, settings.num_nodes, settings.verification,
                ", adaptive speculation (specplug)" if settings.adaptive else "")


def _check_backend(cfg, algorithm: str = NAME) -> None:
    if cfg.device == "cpu" and (cfg.attention_backend or "torch_native") != "torch_native":
        raise ValueError(
            f"{algorithm} on CPU verifies trees with the torch_native attention backend, got "
            f"--attention-backend {cfg.attention_backend}: pass --attention-backend torch_native")
    if cfg.enable_dp_attention or (cfg.pp_size or 1) > 1:
        raise ValueError(f"{algorithm} does not support data-parallel attention or pipeline parallelism: "
                         "drop --enable-dp-attention / --pp-size")


def _check_heads_against_target(heads_path: str, model_path: str) -> None:
    """Shapes, dtypes and vocab of the heads against the target's config.json (formats.py)."""
    from pathlib import Path

    from specplug.common import formats

    if model_path and (Path(model_path) / "config.json").is_file():
        formats.load_head(heads_path, target_config=model_path)


def handle_server_args(server_args) -> None:
    """Fill the arguments MEDUSA decides: node count from the tree, synchronous schedule."""
    from sglang.srt.arg_groups.overrides import resolving_view

    from specplug.sglang_medusa.settings import settings_from_server_args

    cfg = resolving_view(server_args)
    settings = settings_from_server_args(cfg)
    given = cfg.speculative_num_draft_tokens
    if given is not None and given != settings.num_nodes:
        logger.warning("MEDUSA: --speculative-num-draft-tokens %d replaced by the tree's node count %d "
                       "(the tree cannot hold more nodes)", given, settings.num_nodes)
    server_args.speculative_num_draft_tokens = settings.num_nodes
    server_args.speculative_num_steps = settings.tree.depth
    server_args.speculative_eagle_topk = settings.tree.topk
    _synchronous_cpu_defaults(server_args, cfg)


def validate_retrieval_args(server_args) -> None:
    """Reject bad RETRIEVAL arguments before any model loads (runs in the launching process)."""
    from sglang.srt.arg_groups.overrides import resolving_view

    from specplug.sglang_medusa.settings import retrieval_settings_from_server_args

    cfg = resolving_view(server_args)
    settings = retrieval_settings_from_server_args(cfg)
    _check_backend(cfg, RETRIEVAL)
    logger.info("RETRIEVAL: up to %d draft nodes, depth %d, datastore %s, lossless verification",
                settings.config.budget, settings.config.max_depth, settings.datastore or "none")


def handle_retrieval_args(server_args) -> None:
    """Fill the arguments RETRIEVAL decides: the most nodes a tree may have, synchronous schedule."""
    from sglang.srt.arg_groups.overrides import resolving_view

    from specplug.sglang_medusa.settings import retrieval_settings_from_server_args

    cfg = resolving_view(server_args)
    settings = retrieval_settings_from_server_args(cfg)
    server_args.speculative_num_draft_tokens = settings.num_nodes
    server_args.speculative_num_steps = settings.config.max_depth
    server_args.speculative_eagle_topk = 1
    _synchronous_cpu_defaults(server_args, cfg)


def _synchronous_cpu_defaults(server_args, cfg) -> None:
    """Both algorithms: synchronous worker, torch_native on CPU, no mixed chunks, 48 requests."""
    server_args.disable_overlap_schedule = True
    if cfg.device == "cpu" and cfg.attention_backend is None:
        server_args.attention_backend = "torch_native"  # the CPU backend with tree verification
    server_args.enable_mixed_chunk = False
    if cfg.max_running_requests is None:
        server_args.max_running_requests = 48


def _retrieval_worker_factory(server_args):
    from specplug.sglang_medusa.retrieval_worker import RetrievalWorker

    return RetrievalWorker


def _worker_factory(server_args):
    from specplug.sglang_medusa.worker import MedusaWorker

    return MedusaWorker


def _spec_class():
    """Build the CustomSpecAlgo subclass (SGLang is imported lazily, inside register())."""
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class SpecplugSpecAlgo(CustomSpecAlgo):
        """Answers for the scheduler (MEDUSA and RETRIEVAL): no draft model, no draft KV,
        no hidden-state transfer, no top-k draft chains; the future map is SGLang's default."""

        def has_draft_kv(self) -> bool:
            return False

        def carries_draft_hidden_states(self) -> bool:
            return False

        def need_topk(self) -> bool:
            return False

        def supports_mixed_chunk(self) -> bool:
            return False

        def handle_server_args(self, server_args) -> None:
            (handle_retrieval_args if self.name == RETRIEVAL else handle_server_args)(server_args)

        def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens=True,
                              needs_confidence_relay=False):
            from sglang.srt.managers.overlap_utils import FutureMap

            return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    return SpecplugSpecAlgo


ALIAS_TARGET = "sglang.srt.arg_groups.speculative_hook._resolve_speculative_algorithm_alias"
CONFIG_TARGET = "sglang.srt.utils.hf_transformers.config.get_config"


def _medusa_heads_config(path) -> dict | None:
    """The config.json of a Medusa heads folder (FasterDecoding: no model_type), else None."""
    import json
    from pathlib import Path

    config_file = Path(str(path)) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    return config if "medusa_num_heads" in config and "model_type" not in config else None


def _config_for_medusa_heads(original, model, *args, **kwargs):
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


def _skip_draft_config_for_medusa(original, speculative_algorithm, *args, **kwargs):
    """AROUND hook: SGLang parses --speculative-draft-model-path with transformers'
    AutoConfig to spot Gemma-4 drafts; Medusa heads' config.json has no model_type, so
    for MEDUSA the name is returned as is (there is nothing to alias)."""
    if (speculative_algorithm or "").upper() == NAME:
        return speculative_algorithm
    return original(speculative_algorithm, *args, **kwargs)


def register_medusa() -> None:
    """SpeculativeAlgorithm.register("MEDUSA", ...); a second call in one process is a no-op."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    if get_spec(NAME) is not None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(ALIAS_TARGET, _skip_draft_config_for_medusa, HookType.AROUND)
    HookRegistry.register(CONFIG_TARGET, _config_for_medusa_heads, HookType.AROUND)
    SpeculativeAlgorithm.register(
        NAME, supports_overlap=False, validate_server_args=validate_server_args, spec_class=_spec_class(),
    )(_worker_factory)


def register_retrieval() -> None:
    """SpeculativeAlgorithm.register("RETRIEVAL", ...); a second call in one process is a no-op."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    if get_spec(RETRIEVAL) is not None:
        return
    SpeculativeAlgorithm.register(
        RETRIEVAL, supports_overlap=False, validate_server_args=validate_retrieval_args, spec_class=_spec_class(),
    )(_retrieval_worker_factory)
