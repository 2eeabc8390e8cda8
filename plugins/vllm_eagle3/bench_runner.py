"""vLLM runner for `specplug bench`: one in-process engine per method, batches fed in
groups of `batch_size` requests that all generate exactly `max_new_tokens` tokens.

Methods: `none` (no speculation), `ngram` (vLLM's prompt lookup), `suffix` (vLLM's
SuffixDecoding with its defaults, where Arctic Inference imports: scripts/arctic_suffix.sh), `eagle3` (vLLM's
built-in EAGLE-3 chain with the head's weights, the `specplug` config section
stripped), `specplug` (the same head with its `specplug` section, stage
"chain": our proposer, the tree's best path verified as a chain; with `--adaptive` a
copy of the head whose section says `"adaptive": true`) and `specplug-tree` (a
copy whose section says `"stage": "tree"`, the whole tree verified in one target pass,
num_speculative_tokens = the tree budget; `specplug-tree-fixed`: with payoff control off, every
step verifies the whole tree); `specplug-hybrid` and `specplug-hybrid-tree`
are those two with hybrid drafting on; `specplug-hybrid-skip` is `specplug-hybrid` with
retrieval-only steps (RetrievalConfig.head_skip = HEAD_SKIP) (retrieval candidates merged into the head's tree:
the section's "retrieval" settings, or the defaults); `specplug-hybrid-calibrated` is
`specplug-hybrid` ranking the two sources on measured acceptance (`"calibrate": true`);
`specplug-hybrid-lengthen` is `specplug-hybrid` with retrieval scored as growing matches
(RetrievalConfig lengthen, prior LENGTHEN_PRIOR, fitted to own-sequence continuations);
`specplug-hybrid-gated` is `specplug-hybrid` with the draft gate (`"gate": true`: a request's
chain only where its expected accepted length pays for the verify, policy.draft_gate);
`specplug-float-head` is `specplug` with the head's linears as loaded (`"head_weights": "float"`);
`specplug-sampled` is the head's section with `"draft_temperature"` = --temperature:
unseeded sampled requests get chains drawn from q, verified with q (use --unseeded). With
`--draft-model DIR`: `draft_model` (vLLM's built-in draft-model chain, K = DRAFT_MODEL_K)
and `specplug-draft-model` (stage chain, the head's tree merged with the draft model's:
specplug's "draft_model" token drafter). With `--self-spec-layers L`: `specplug-self-spec`
(the same with specplug's "self_spec" drafter on the target's layers L as vLLM loaded them).
With `--medusa-head DIR`: `medusa` (vLLM's own Medusa chain, one token per head, the section
stripped), `specplug-medusa` (stage "chain": the same chain through specplug's sampler) and
`specplug-medusa-tree` (stage "tree": the heads' Medusa tree, num_speculative_tokens = its
nodes). Tree settings come from the head's section with SPECPLUG_TREE applied, exactly as
the proposer reads them. A chain method followed by `:K` (`ngram:8`, `specplug:8`,
`eagle3:6`) is the same method with `num_speculative_tokens` = K: chain lengths compared in
one run (`chain_length`).
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
import time
from pathlib import Path

from specplug.bench_types import RunResult
from specplug.common.metrics import AcceptanceStats
from specplug.common.parallel import threads_bind

SPEC_DECODE_COUNTERS = {"vllm:spec_decode_num_drafts": "num_steps", "vllm:spec_decode_num_accepted_tokens":
                        "num_accepted", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens"}
PER_POSITION_COUNTER = "vllm:spec_decode_num_accepted_tokens_per_pos"
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 4,
                "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SUFFIX_CONFIG = {"method": "suffix"}  # vLLM's defaults: up to 24 tokens a step, as its tree finds them
NO_ARCTIC = ("specplug bench: method 'suffix' needs Arctic Inference (vLLM's SuffixDecoding), which PyPI ships as "
             "source only: build it for this environment with `export PYTHONPATH=$(bash scripts/arctic_suffix.sh "
             "VENV)` (docs/benchmarks.md), or `pip install arctic-inference` where a CUDA toolkit is installed")


def spec_decode_stats(metrics) -> AcceptanceStats:
    """vLLM's cumulative speculation counters from `LLM.get_metrics()` (an engine started
    with disable_log_stats=False; summed over engines and labels): subtract a snapshot
    taken before a run. Counts every proposer's drafts, specplug's included."""
    counts, per_position = dict.fromkeys(SPEC_DECODE_COUNTERS.values(), 0), AcceptanceStats()
    for metric in metrics:
        if metric.name in SPEC_DECODE_COUNTERS:
            counts[SPEC_DECODE_COUNTERS[metric.name]] += int(metric.value)
        elif metric.name == PER_POSITION_COUNTER:  # `+` adds lists of unequal length
            per_position += AcceptanceStats(accepted_per_pos=[int(v) for v in metric.values])
    return AcceptanceStats(**counts) + per_position


def stats_from_outputs(outputs) -> AcceptanceStats:
    """Acceptance summed over `LLM.generate` outputs of an engine started with
    per_request_spec_decode_metrics="summary" (vLLM's per-request histogram: h[j] = verify
    steps that accepted j drafts); right also when several engines share a process."""
    metrics = [c.spec_decode_metrics for o in outputs for c in o.outputs if c.spec_decode_metrics is not None]
    stats = AcceptanceStats.from_histograms(list(m.histogram) for m in metrics)
    stats.num_draft_tokens = sum(m.num_draft_tokens for m in metrics)
    return stats


def has_arctic_inference() -> bool:
    """vLLM's own test for the package its `suffix` method needs (SpeculativeConfig refuses without it)."""
    from vllm.utils.import_utils import has_arctic_inference as installed

    return installed()


# methods whose draft count is not a chain length: no speculation, tree stages, vLLM's Medusa (K = its heads)
NO_CHAIN_LENGTH = ("none", "specplug-tree", "specplug-tree-fixed", "specplug-hybrid-tree", "specplug-medusa-tree",
                   "medusa")


def chain_length(method: str) -> tuple[str, int | None]:
    """"ngram:8" -> ("ngram", 8): a chain method with its num_speculative_tokens set to K;
    "ngram" -> ("ngram", None). SystemExit on a K that is not an int >= 1, or on a method
    whose draft count is not a chain length (none, the tree stages, vLLM's Medusa)."""
    base, sep, k = method.partition(":")
    if not sep:
        return base, None
    if not k.isdigit() or int(k) < 1:
        raise SystemExit(f"specplug bench: {method!r}: the number after ':' is the chain length K, an int >= 1 "
                         f"(e.g. {base}:8)")
    if base in NO_CHAIN_LENGTH:
        raise SystemExit(f"specplug bench: {method!r}: {base!r} takes no chain length (':K' applies to chain "
                         f"methods such as ngram, eagle3, specplug)")
    return base, int(k)


def make_runner(args):
    from specplug.common import testbed

    model = args.model or str(testbed.target_dir())
    head = args.head or default_head()
    return VllmRunner(model, head, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, seed=args.seed,
                      max_batch=max(int(b) for b in args.batch_sizes.split(",") if b),
                      adaptive=getattr(args, "adaptive", False), draft_model=getattr(args, "draft_model", None),
                      self_spec_layers=getattr(args, "self_spec_layers", None),
                      seeded=not getattr(args, "unseeded", False),
                      medusa_head=vllm_medusa_head(getattr(args, "medusa_head", None), model),
                      tensor_parallel_size=getattr(args, "tensor_parallel_size", 1))


def vllm_medusa_head(given: str | None, target: str) -> str | None:
    """Medusa heads (`given`; "testbed" = the committed heads/smollm2-medusa) in vLLM's
    MedusaModel format, converted once into a temporary folder (None: not given)."""
    if given is None:
        return None
    from specplug.common import formats, testbed

    source = str(testbed.head_dir("smollm2-medusa", target=target)) if given == "testbed" else given
    if formats.load_head(source).format == "vllm-medusa":
        return source
    out = Path(tempfile.mkdtemp(prefix="specplug-vllm-medusa-")) / "heads"
    formats.convert(source, out, "vllm-medusa")
    return str(out)


def default_head() -> str | None:
    """The committed test-bed EAGLE-3 head (smollm2-eagle3 in specplug.testbed_heads)."""
    from specplug.common import testbed

    try:
        return str(testbed.head_dir("smollm2-eagle3"))
    except ValueError:
        return None


def engine_drafter(llm):
    """The drafter (proposer) of an in-process vLLM engine, or None without speculation."""
    return getattr(llm.llm_engine.model_executor.driver_worker.worker.model_runner, "drafter", None)


def forget_finished_requests(worker) -> None:
    """On one vLLM worker (through LLM.collective_rpc, so on every tensor-parallel rank):
    the caches of finished requests that drafting reuses emptied, namely specplug's token
    drafter's (retrieval: recent requests) and vLLM suffix decoding's global tree."""
    proposer = getattr(getattr(worker, "worker", worker).model_runner, "drafter", None)
    session = getattr(proposer, "session", None)  # specplug's proposer: its drafting session
    if getattr(session, "token_drafter", None) is not None:
        session.token_drafter.clear_cache()
    suffix_cache = getattr(proposer, "suffix_cache", None)
    if suffix_cache is not None:
        for request in set(suffix_cache.cached_requests) - set(suffix_cache.active_requests):
            suffix_cache.evict_cached_response(request)


def strip_specplug_section(head: str) -> str:
    """A folder with the same weights and a config.json without the `specplug` section,
    so vLLM's built-in EAGLE-3 path runs on exactly the same head."""
    return _head_copy(head, "specplug-builtin-head-", lambda config: config.pop("specplug", None))


def adaptive_head(head: str) -> str:
    """A folder with the same weights whose `specplug` section says `"adaptive": true` (on
    stage "chain": adaptive speculation chooses chain depths)."""
    return _head_copy(head, "specplug-adaptive-head-",
                      lambda config: config.setdefault("specplug", {}).update(adaptive=True, stage="chain"))


def staged_head(head: str, stage: str) -> str:
    """A folder with the same weights whose `specplug` section says `"stage": stage`."""
    return _head_copy(head, f"specplug-{stage}-head-",
                      lambda config: config.setdefault("specplug", {}).update(stage=stage))


DRAFT_MODEL_K = 4  # draft_model: vLLM's chain length
HEAD_SKIP = 1.0  # specplug-hybrid-skip: retrieval-only steps when it expects >= 1 accepted token
LENGTHEN_PRIOR = 1.7  # specplug-hybrid-lengthen: own-sequence continuations of the target's replies (docs/retrieval.md)


def hybrid_head(head: str, stage: str, fields: dict | None = None, **retrieval) -> str:
    """A folder with the same weights whose `specplug` section says `"stage": stage` and
    turns hybrid drafting on (its own "retrieval" settings, else the defaults), with
    `retrieval` fields set on top and the section's `fields` (e.g. {"gate": True}) set."""
    def edit(config):
        section = config.setdefault("specplug", {})
        settings = section.get("retrieval") or True
        if retrieval:
            settings = {**(settings if isinstance(settings, dict) else {}), **retrieval}
        section.update(stage=stage, retrieval=settings, **(fields or {}))
    return _head_copy(head, f"specplug-hybrid-{stage}-head-", edit)


def drafter_head(head: str, drafter: dict) -> str:
    """A folder with the same weights whose `specplug` section says stage "chain" and merges
    the token drafter `drafter` ({"name": ..., fields}) into the head's trees."""
    def edit(config):
        section = config.setdefault("specplug", {})
        section.pop("retrieval", None)
        section.update(stage="chain", drafter=drafter)
    return _head_copy(head, f"specplug-{drafter['name']}-head-", edit)


def head_settings(head: str):
    """The HeadSettings the proposer will read from this head (SPECPLUG_TREE applied)."""
    from specplug.vllm_eagle3.settings import adapter_settings

    config = json.loads((Path(head) / "config.json").read_text())
    return adapter_settings(config.get("specplug") or {})


def _head_copy(head: str, prefix: str, edit) -> str:
    """Symlinks to `head`'s files in a new folder, with config.json changed by edit(config)."""
    src = Path(head)
    dst = Path(tempfile.mkdtemp(prefix=prefix))
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return str(dst)


class VllmRunner:
    engine = "vllm"
    run_last = ("ngram",)

    def __init__(self, model: str, head: str | None, *, max_new_tokens: int,
                 temperature: float, seed: int, max_batch: int, adaptive: bool = False,
                 draft_model: str | None = None, self_spec_layers: str | None = None, seeded: bool = True,
                 medusa_head: str | None = None, tensor_parallel_size: int = 1):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM-CPU needs it set
        if tensor_parallel_size > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", threads_bind(tensor_parallel_size))
        self.tensor_parallel_size = tensor_parallel_size
        import vllm
        from transformers import AutoTokenizer

        self.version = vllm.__version__
        self.model, self.head = model, head
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.max_batch, self.adaptive, self.draft_model = max_batch, adaptive, draft_model
        self.self_spec_layers, self.seeded, self.medusa_head = self_spec_layers, seeded, medusa_head
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self._method, self._llm = None, None

    def methods(self) -> list[str]:
        specplug = ["eagle3", "specplug", "specplug-fixed", "specplug-tree", "specplug-tree-fixed", "specplug-adaptive",
                    "specplug-hybrid", "specplug-hybrid-tree", "specplug-hybrid-skip", "specplug-hybrid-calibrated",
                    "specplug-sampled", "specplug-hybrid-lengthen", "specplug-hybrid-gated", "specplug-float-head"]
        drafts = ["draft_model"] + (["specplug-draft-model"] if self.head else []) if self.draft_model else []
        drafts += ["specplug-self-spec"] if self.self_spec_layers and self.head else []
        medusa = ["medusa", "specplug-medusa", "specplug-medusa-tree"] if self.medusa_head else []
        suffix = ["suffix"] if has_arctic_inference() else []
        return ["none", "ngram"] + suffix + drafts + (specplug if self.head else []) + medusa

    def check_method(self, method: str) -> None:
        """SystemExit, before any engine starts, for a method this Python cannot run."""
        base, _ = chain_length(method)
        if base == "suffix" and not has_arctic_inference():
            raise SystemExit(NO_ARCTIC)

    def speculative_config(self, method: str) -> dict | None:
        base, k = chain_length(method)
        config = self._base_config(base)
        if k is not None:
            config = dict(config, num_speculative_tokens=k)
        return config

    def _base_config(self, method: str) -> dict | None:
        if method == "none":
            return None
        if method == "ngram":
            return dict(NGRAM_CONFIG)
        if method == "suffix":
            if not has_arctic_inference():
                raise SystemExit(NO_ARCTIC)
            return dict(SUFFIX_CONFIG)
        if method == "draft_model":
            return {"method": "draft_model", "model": self._draft_model(), "num_speculative_tokens": DRAFT_MODEL_K}
        if method in ("medusa", "specplug-medusa", "specplug-medusa-tree"):
            return self._medusa_config(method)
        if self.head is None:
            raise SystemExit(f"specplug bench: method {method!r} needs --head (an EAGLE-3 head folder)")
        tree = head_settings(self.head).tree
        if method == "eagle3":
            return {"method": "eagle3", "model": strip_specplug_section(self.head),
                    "num_speculative_tokens": tree.depth}
        if method == "specplug":
            head = adaptive_head(self.head) if self.adaptive else staged_head(self.head, "chain")
            return {"method": "eagle3", "model": head, "num_speculative_tokens": tree.depth}
        if method == "specplug-fixed":  # payoff control off: every step drafts num_speculative_tokens
            head = _head_copy(self.head, "specplug-fixed-head-", lambda config: config.setdefault(
                "specplug", {}).update(stage="chain", payoff=False))
            return {"method": "eagle3", "model": head, "num_speculative_tokens": tree.depth}
        if method == "specplug-tree-fixed":  # payoff control off: every step verifies the whole tree
            head = _head_copy(self.head, "specplug-tree-fixed-head-", lambda config: config.setdefault(
                "specplug", {}).update(stage="tree", payoff=False))
            return {"method": "eagle3", "model": head, "num_speculative_tokens": tree.budget}
        if method == "specplug-adaptive":
            return {"method": "eagle3", "model": adaptive_head(self.head), "num_speculative_tokens": tree.depth}
        if method == "specplug-tree":
            return {"method": "eagle3", "model": staged_head(self.head, "tree"),
                    "num_speculative_tokens": tree.budget}
        if method == "specplug-hybrid":
            return {"method": "eagle3", "model": hybrid_head(self.head, "chain"), "num_speculative_tokens": tree.depth}
        if method == "specplug-hybrid-lengthen":
            head = hybrid_head(self.head, "chain", lengthen=True, prior=LENGTHEN_PRIOR)
            return {"method": "eagle3", "model": head, "num_speculative_tokens": tree.depth}
        if method == "specplug-hybrid-calibrated":
            head = hybrid_head(self.head, "chain", {"calibrate": True})
            return {"method": "eagle3", "model": head, "num_speculative_tokens": tree.depth}
        if method == "specplug-hybrid-gated":
            head = hybrid_head(self.head, "chain", {"gate": True})
            return {"method": "eagle3", "model": head, "num_speculative_tokens": tree.depth}
        if method == "specplug-float-head":  # the head's section with its linears as loaded
            head = _head_copy(self.head, "specplug-float-head-", lambda config: config.setdefault(
                "specplug", {}).update(stage="chain", head_weights="float"))
            return {"method": "eagle3", "model": head, "num_speculative_tokens": tree.depth}
        if method == "specplug-sampled":
            if self.temperature <= 0:
                raise SystemExit("specplug bench: method 'specplug-sampled' drafts from q at the sampling "
                                 "temperature: pass --temperature > 0 (and --unseeded)")
            head = _head_copy(self.head, "specplug-sampled-head-", lambda config: config.setdefault(
                "specplug", {}).update(stage="chain", draft_temperature=self.temperature))
            return {"method": "eagle3", "model": head, "num_speculative_tokens": tree.depth}
        if method == "specplug-hybrid-skip":
            head = hybrid_head(self.head, "chain", head_skip=HEAD_SKIP)
            return {"method": "eagle3", "model": head, "num_speculative_tokens": tree.depth}
        if method == "specplug-draft-model":
            drafter = {"name": "draft_model", "model": self._draft_model(), "max_depth": tree.depth}
            return {"method": "eagle3", "model": drafter_head(self.head, drafter), "num_speculative_tokens": tree.depth}
        if method == "specplug-self-spec":
            if self.self_spec_layers is None:
                raise SystemExit("specplug bench: method 'specplug-self-spec' needs --self-spec-layers (e.g. 0-7)")
            drafter = {"name": "self_spec", "layers": self.self_spec_layers, "max_depth": tree.depth}
            return {"method": "eagle3", "model": drafter_head(self.head, drafter), "num_speculative_tokens": tree.depth}
        if method == "specplug-hybrid-tree":
            return {"method": "eagle3", "model": hybrid_head(self.head, "tree"),
                    "num_speculative_tokens": tree.budget}
        raise SystemExit(f"specplug bench: unknown vLLM method {method!r}; choose from {self.methods()}")

    def _medusa_config(self, method: str) -> dict:
        """vLLM's own Medusa chain, or specplug's in stage chain / tree, on the same heads."""
        from specplug.common.heads.medusa import medusa_head_count
        from specplug.vllm_eagle3.medusa_settings import tree_nodes

        if self.medusa_head is None:
            raise SystemExit(f"specplug bench: method {method!r} needs --medusa-head DIR (or 'testbed')")
        heads = medusa_head_count(self.medusa_head)
        if method == "medusa":
            return {"method": "medusa", "model": strip_specplug_section(self.medusa_head),
                    "num_speculative_tokens": heads}
        stage = "tree" if method == "specplug-medusa-tree" else "chain"
        head = staged_head(self.medusa_head, stage)
        k = tree_nodes(head) if stage == "tree" else heads
        return {"method": "medusa", "model": head, "num_speculative_tokens": k}

    def _draft_model(self) -> str:
        if self.draft_model is None:
            raise SystemExit("specplug bench: the draft-model methods need --draft-model DIR")
        return self.draft_model

    def _engine(self, method: str):
        if method != self._method:
            self.close()
            from vllm import LLM

            self._llm = LLM(
                model=self.model, dtype="float32", enforce_eager=True, seed=self.seed,
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_executor_backend="uni" if self.tensor_parallel_size == 1 else "mp",
                disable_log_stats=False,
                max_num_seqs=self.max_batch, max_model_len=2048,
                speculative_config=self.speculative_config(method))
            self._method = method
            self._warm_up()
        return self._llm

    def _warm_up(self) -> None:
        """One short request first, so JIT compilation (numba for ngram) isn't timed."""
        from vllm import SamplingParams

        self._llm.generate(["warm up"], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)

    def run(self, method: str, prompts, batch_size: int, fresh: bool = True) -> RunResult:
        from vllm import SamplingParams

        llm = self._engine(method)
        params = [SamplingParams(max_tokens=self.max_new_tokens, ignore_eos=True,
                                 temperature=self.temperature, seed=self.seed + i if self.seeded else None)
                  for i in range(len(prompts))]
        if fresh:
            self._forget_earlier_runs(llm)
        before = spec_decode_stats(llm.get_metrics())
        outputs, start = [], time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            outs = llm.generate(list(prompts[i:i + batch_size]), params[i:i + batch_size], use_tqdm=False)
            outputs += [list(o.outputs[0].token_ids) for o in outs]
        seconds = time.perf_counter() - start
        run = spec_decode_stats(llm.get_metrics()) - before
        return RunResult(method=method, batch_size=batch_size, num_prompts=len(prompts),
                         output_tokens=sum(map(len, outputs)), seconds=seconds,
                         num_drafts=run.num_steps, num_draft_tokens=run.num_draft_tokens,
                         num_accepted=run.num_accepted, accepted_per_pos=list(run.accepted_per_pos),
                         outputs=outputs)

    @staticmethod
    def _forget_earlier_runs(llm) -> None:
        """Every run starts from cold caches: an earlier run of the same engine (another
        batch size) generated the same prompts, whose KV blocks vLLM's prefix cache and
        whose outputs drafting (forget_finished_requests) would reuse.
        (vLLM's EAGLE path recomputes a prompt's last cached block, so a warm prefix
        cache favoured `none` over every EAGLE method.)"""
        llm.reset_prefix_cache()
        llm.collective_rpc(forget_finished_requests)

    def close(self) -> None:
        if self._llm is not None:
            del self._llm
            self._llm, self._method = None, None
            gc.collect()

