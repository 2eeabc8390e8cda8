"""SGLang runner for `specplug bench`: one in-process sglang.Engine per method, batches
fed in groups of `batch_size` requests that all generate exactly `max_new_tokens` tokens.

Methods: `none` (no speculation), `ngram` (SGLang's NGRAM; on CPU its trees are verified
through specplug's torch_native hook), `retrieval` (specplug's RETRIEVAL: the model-free
retrieval drafter, lossless), `medusa` (specplug MEDUSA, lossless),
`draft-model` (specplug's DRAFT_MODEL with `--draft-model DIR`, lossless), `self-spec`
(specplug's SELF_SPEC with `--self-spec-layers L`: the target's layers L as SGLang loaded
them draft, lossless), `eagle3`
(specplug's SPECPLUG_EAGLE3: an EAGLE-3 head's dynamic trees, hybrid when its section
says so, lossless; the test bed's smollm2-eagle3, or `--head` when it is an EAGLE-3
head), `eagle3-head` (the same head alone: argmax top-k trees, verified with the
target-only rule) and `eagle3-sampled` (the head alone, trees drawn from q at the run's
`--temperature`, verified with q: the acceptance gain of sampled drafts at T > 0),
`medusa-hybrid` (MEDUSA with the heads' trees merged with the retrieval drafter's under
the same node budget: SPECPLUG_RETRIEVAL=1, lossless),
`medusa-typical` (the same heads with typical acceptance, LOSSY), `medusa-adaptive`
(MEDUSA with adaptive speculation: `--speculative-adaptive`) and `medusa-sampled` (MEDUSA
drafting chains from the heads' q at the run's `--temperature`, verified with q). With `--adaptive`, every
MEDUSA method runs adaptive. Acceptance comes from SGLang's per-request meta_info
(specplug.common.metrics.AcceptanceStats.from_histograms).
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from specplug.bench_types import RunResult
from specplug.common.head_section import ENV_DRAFT_TEMPERATURE, ENV_PAYOFF
from specplug.common.metrics import AcceptanceStats
from specplug.common.parallel import threads_bind
from specplug.common.retrieval.config import ENV_RETRIEVAL
from specplug.common.drafter_registry import ENV_DRAFTER

NGRAM_DRAFT_TOKENS = 8
FIXED = "-fixed"  # a specplug method with payoff control off (SPECPLUG_PAYOFF=0): every step verifies its tree
DRAFT_MODEL_TREE = {"speculative_num_draft_tokens": 5, "speculative_num_steps": 4}  # 4 nodes, depth <= 4


@contextlib.contextmanager
def _environment(settings: dict[str, str]):
    """`settings` in os.environ while an engine starts (its scheduler reads them), and
    SPECPLUG_DRAFTER unset unless they set it (only DRAFT_MODEL takes a drafter from the
    bench); every variable touched is restored afterwards. A variable the user set and
    the method does not (e.g. SPECPLUG_RETRIEVAL=0 for `eagle3`) is left as it is."""
    touched = {ENV_DRAFTER, *settings}
    saved = {name: os.environ.pop(name, None) for name in touched}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


TYPICAL = {"speculative_accept_threshold_single": 0.09, "speculative_accept_threshold_acc": 0.3}


def make_runner(args):
    from specplug.common import testbed

    model = args.model or str(testbed.target_dir())
    given = args.head
    eagle3 = given is not None and is_eagle3_head(given)
    return SglangRunner(model, None if eagle3 else (given or default_head()), max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, seed=args.seed,
                        max_batch=max(int(b) for b in args.batch_sizes.split(",") if b),
                        adaptive=getattr(args, "adaptive", False), draft_model=getattr(args, "draft_model", None),
                        self_spec_layers=getattr(args, "self_spec_layers", None),
                        tp_size=getattr(args, "tensor_parallel_size", 1),
                        eagle3_head=given if eagle3 else (None if given else default_head("smollm2-eagle3")))


def default_head(name: str = "smollm2-medusa") -> str | None:
    """A committed test-bed head as a loadable folder, if this checkout has one (a compact
    Medusa head is materialised into the test-bed cache by testbed.head_dir)."""
    from specplug.common import testbed

    try:
        return str(testbed.head_dir(name))
    except ValueError:
        return None


def is_eagle3_head(path: str) -> bool:
    """Whether a head folder's config.json names an EAGLE-3 architecture."""
    from pathlib import Path

    config = Path(path) / "config.json"
    return config.is_file() and any("Eagle3" in a for a in json.loads(config.read_text()).get("architectures", []))


# sglang.Engine arguments SGLang's CPU engine needs (docs/sglang.md); the test suite's engines use them too
CPU_ENGINE_ARGS = dict(device="cpu", dtype="float32", attention_backend="torch_native", disable_cuda_graph=True,
                       disable_overlap_schedule=True, mem_fraction_static=0.5,
                       sleep_on_idle=True)  # an idle scheduler would spin one of the CPU's cores


def engine_args(model: str, seed: int, max_batch: int, tp_size: int = 1) -> dict:
    """sglang.Engine arguments: SGLang's CPU settings when no CUDA device is present."""
    import torch

    args = dict(model_path=model, random_seed=seed, max_running_requests=max_batch, log_level="error",
                tp_size=tp_size)
    if not torch.cuda.is_available():
        args.update(CPU_ENGINE_ARGS, max_total_tokens=65536)
    return args


class SglangRunner:
    engine = "sglang"

    def __init__(self, model: str, head: str | None, *, max_new_tokens: int, temperature: float,
                 seed: int, max_batch: int, adaptive: bool = False, draft_model: str | None = None,
                 eagle3_head: str | None = None, self_spec_layers: str | None = None, tp_size: int = 1):
        import sglang
        from transformers import AutoTokenizer

        self.version = sglang.__version__
        self.model, self.head = model, head
        self.max_new_tokens, self.temperature, self.seed, self.max_batch = max_new_tokens, temperature, seed, max_batch
        self.adaptive, self.draft_model, self.eagle3_head = adaptive, draft_model, eagle3_head
        self.self_spec_layers, self.tp_size = self_spec_layers, tp_size
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self._method, self._engine = None, None

    def methods(self) -> list[str]:
        return (["none", "ngram", "retrieval"] + (["draft-model"] if self.draft_model else [])
                + (["self-spec"] if self.self_spec_layers else [])
                + (["eagle3", "eagle3-head", "eagle3-sampled"] if self.eagle3_head else [])
                + (["medusa", "medusa-hybrid", "medusa-typical", "medusa-adaptive", "medusa-sampled"]
                   if self.head else []))

    def speculative_args(self, method: str) -> dict:
        method = method.removesuffix(FIXED)
        if method == "none":
            return {}
        if method == "ngram":
            return {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": NGRAM_DRAFT_TOKENS}
        if method == "retrieval":
            return {"speculative_algorithm": "RETRIEVAL"}
        if method == "draft-model":
            if self.draft_model is None:
                raise SystemExit("specplug bench: method 'draft-model' needs --draft-model DIR")
            return {"speculative_algorithm": "DRAFT_MODEL", **DRAFT_MODEL_TREE}
        if method == "self-spec":
            if self.self_spec_layers is None:
                raise SystemExit("specplug bench: method 'self-spec' needs --self-spec-layers (e.g. 0-7)")
            return {"speculative_algorithm": "SELF_SPEC", **DRAFT_MODEL_TREE}
        if method in ("eagle3", "eagle3-head", "eagle3-sampled"):
            if self.eagle3_head is None:
                raise SystemExit("specplug bench: method 'eagle3' needs an EAGLE-3 head: --head EAGLE3_HEAD_DIR")
            return {"speculative_algorithm": "SPECPLUG_EAGLE3", "speculative_draft_model_path": self.eagle3_head}
        if self.head is None:
            raise SystemExit(f"specplug bench: method {method!r} needs --head (a Medusa heads folder)")
        medusa = {"speculative_algorithm": "MEDUSA", "speculative_draft_model_path": self.head}
        if self.adaptive or method == "medusa-adaptive":
            medusa["speculative_adaptive"] = True
        if method in ("medusa", "medusa-hybrid", "medusa-adaptive", "medusa-sampled"):
            return medusa
        if method == "medusa-typical":
            return {**medusa, **TYPICAL}
        raise SystemExit(f"specplug bench: unknown SGLang method {method!r}; choose from {self.methods()}")

    def environment(self, method: str) -> dict[str, str]:
        """The specplug variables `method`'s engine starts with (see _environment)."""
        if method.endswith(FIXED):
            return {**self.environment(method.removesuffix(FIXED)), ENV_PAYOFF: "0"}
        if method == "draft-model":
            return {ENV_DRAFTER: json.dumps({"model": self.draft_model})}
        if method == "self-spec":
            return {ENV_DRAFTER: json.dumps({"layers": self.self_spec_layers})}
        if method == "eagle3-head":
            return {ENV_RETRIEVAL: "0"}
        if method == "medusa-hybrid":
            return {ENV_RETRIEVAL: "1"}
        if method in ("eagle3-sampled", "medusa-sampled"):
            if not self.temperature > 0:
                raise SystemExit(f"specplug bench: method {method!r} draws drafts at the run's temperature: "
                                 "pass --temperature > 0 (e.g. 0.7)")
            return {ENV_RETRIEVAL: "0", ENV_DRAFT_TEMPERATURE: str(self.temperature)}
        return {}

    def _engine_for(self, method: str):
        if method != self._method:
            self.close()
            import sglang

            with _environment({**self._threads_bind(), **self.environment(method)}):
                self._engine = sglang.Engine(**engine_args(self.model, self.seed, self.max_batch, self.tp_size),
                                             **self.speculative_args(method))
            self._method = method
            self._engine.generate(["warm up"], {"max_new_tokens": 8, "ignore_eos": True})
        return self._engine

    def _threads_bind(self) -> dict[str, str]:
        """Several ranks on a CPU: each bound to one core, round robin, unless the user set
        SGLANG_CPU_OMP_THREADS_BIND."""
        import torch

        if self.tp_size == 1 or torch.cuda.is_available() or "SGLANG_CPU_OMP_THREADS_BIND" in os.environ:
            return {}
        return {"SGLANG_CPU_OMP_THREADS_BIND": threads_bind(self.tp_size)}

    def run(self, method: str, prompts, batch_size: int, fresh: bool = True) -> RunResult:
        engine = self._engine_for(method)
        # A fresh run starts cold: no radix-cache prefix hits and no NGRAM corpus left from the
        # previous batch size's run over the same prompts (it would inflate tau). Later
        # rounds of an interleaved run (fresh=False) keep what the earlier rounds built.
        if fresh:
            engine.flush_cache()
        params = {"max_new_tokens": self.max_new_tokens, "ignore_eos": True, "temperature": self.temperature}
        outs, start = [], time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            outs += engine.generate(list(prompts[i:i + batch_size]), params)
        seconds = time.perf_counter() - start
        metas = [o["meta_info"] for o in outs]
        stats = AcceptanceStats.from_histograms(m.get("spec_correct_drafts_histogram") for m in metas)
        return RunResult(method=method, batch_size=batch_size, num_prompts=len(prompts),
                         output_tokens=sum(m["completion_tokens"] for m in metas), seconds=seconds,
                         num_drafts=stats.num_steps,
                         num_draft_tokens=sum(m.get("spec_num_proposed_drafts", 0) for m in metas),
                         num_accepted=stats.num_accepted, accepted_per_pos=list(stats.accepted_per_pos),
                         outputs=[o["output_ids"] for o in outs])

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine, self._method = None, None
