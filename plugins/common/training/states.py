"""Cached target states for `specplug train`: the frozen target's states of every training
sample, written once before the loop and read for every batch instead of a target pass.

Folder (`$SPECPLUG_CACHE/states/KEY/`, or `--states-cache PATH`):
  manifest.json     format version, the key (`cache_key`), hidden size, aux layer ids,
                    per-sample [token offset, length], the shard list, `complete`
  shard-00000.bin   samples concatenated along tokens (a sample never straddles two
                    shards), about SHARD_BYTES each: three raw arrays one after the other
                      aux  [n, 3H] bf16 bits  concatenated aux hidden states (EAGLE-3 only)
                      last [n, H]  bf16 bits  final (post-norm) hidden state
                      top1 [n]     int32      the target's full-vocab argmax at each token
Invariants:
  * a folder is read only when its manifest says complete and its key equals the run's
    field for field; another key is refused (ValueError naming the fields and the fix),
    never overwritten;
  * sample i's rows are `target_pass` of the batch that wrote them, cast to bf16 (top1:
    argmax of that pass's fp32 logits), so the loss reads the target's own top-1;
  * a shard file exists only complete (written as NAME.tmp, then renamed) and the
    manifest says complete only after the last shard: an interrupted write resumes at
    the first missing shard, and a half-written cache is never read as complete.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from specplug.common.testbed import file_lock
from specplug.common.training.config import TrainConfig
from specplug.common.training.samples import Batch, Sample, collate
from specplug.common.training.target import TargetOutput, target_pass

logger = logging.getLogger(__name__)

VERSION = 1
FORMAT = "specplug-target-states"
MANIFEST = "manifest.json"
LOCK = ".lock"
SHARD_BYTES = 256 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
FIELDS = {  # key field -> what it stands for, in a refusal
    "version": "the cache format version",
    "target": "the target folder (--target)",
    "target_config_sha256": "the target's config.json",
    "target_weights": "the target's weight files (names, sizes, modification times)",
    "compute_dtype": "the target's compute dtype (--device)",
    "samples_sha256": "the training samples' token ids (--data, --max-samples, --max-length, --seed, --regenerate)",
    "num_samples": "the number of training samples",
    "aux_layer_ids": "the EAGLE-3 aux layers (--aux-layers)",
    "dtype": "the stored dtype",
}


# ---------------------------------------------------------------------------------------
# Key and location
# ---------------------------------------------------------------------------------------
def cache_key(target_dir: str | os.PathLike, samples: list[Sample], aux_layer_ids, compute_dtype) -> dict:
    """Everything the states depend on (JSON types, so a manifest's key compares equal)."""
    path = Path(target_dir).resolve()
    weights = sorted([f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in path.iterdir()
                     if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))
    return {"version": VERSION, "target": str(path),
            "target_config_sha256": hashlib.sha256((path / "config.json").read_bytes()).hexdigest(),
            "target_weights": weights, "compute_dtype": str(compute_dtype).removeprefix("torch."),
            "samples_sha256": samples_digest(samples), "num_samples": len(samples),
            "aux_layer_ids": list(aux_layer_ids) if aux_layer_ids else None, "dtype": "bfloat16"}


def samples_digest(samples: list[Sample]) -> str:
    """sha256 of every sample's input_ids, in order (lengths included)."""
    digest = hashlib.sha256()
    for sample in samples:
        ids = np.asarray(sample.input_ids, dtype=np.int64)
        digest.update(np.int64(len(ids)).tobytes() + ids.tobytes())
    return digest.hexdigest()


def default_dir(key: dict) -> Path:
    """$SPECPLUG_CACHE/states/KEY: KEY = 16 hex digits of the key's sha256."""
    from specplug.common.testbed import cache_root

    return cache_root() / "states" / hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def check_key(folder: Path, cached: dict, key: dict) -> None:
    """ValueError naming each field where the folder's key differs from this run's."""
    differ = [f for f in sorted(set(cached) | set(key)) if cached.get(f) != key.get(f)]
    if differ:
        details = "; ".join(f"{f} = {FIELDS.get(f, f)}: cached {_short(cached.get(f))}, this run {_short(key.get(f))}"
                            for f in differ)
        raise ValueError(f"--states-cache {folder} holds target states for other settings ({details}): pass "
                         f"another --states-cache folder, or delete {folder} to write it anew")


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 72 else text[:69] + "..."


# ---------------------------------------------------------------------------------------
# Layout: the manifest and its shards
# ---------------------------------------------------------------------------------------
class Layout(NamedTuple):
    """Elements per token of the bf16 arrays: aux (3H for EAGLE-3, 0 for Medusa) and last (H)."""

    aux: int
    hidden: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * (self.aux + self.hidden) + 4  # + top1 int32

    def offsets(self, tokens: int) -> tuple[int, int, int]:
        """Byte offsets of aux, last and top1 in a shard of `tokens` tokens."""
        return 0, 2 * self.aux * tokens, 2 * (self.aux + self.hidden) * tokens


def _layout(manifest: dict) -> Layout:
    return Layout(manifest["aux_width"], manifest["hidden_size"])


def plan_shards(lengths: list[int], bytes_per_token: int, shard_bytes: int) -> list[dict]:
    """Consecutive samples grouped into shards of at most shard_bytes (a longer single
    sample gets a shard of its own)."""
    shards: list[dict] = []
    first, start, tokens = 0, 0, 0
    for i, n in enumerate(lengths + [None]):
        if i == len(lengths) or (tokens and (tokens + n) * bytes_per_token > shard_bytes):
            shards.append({"file": f"shard-{len(shards):05d}.bin", "first_sample": first, "num_samples": i - first,
                           "first_token": start, "tokens": tokens, "bytes": tokens * bytes_per_token})
            first, start, tokens = i, start + tokens, 0
        tokens += n or 0
    return shards


def new_manifest(key: dict, samples: list[Sample], hidden_size: int, shard_bytes: int = SHARD_BYTES) -> dict:
    """The manifest of a cache not yet written (complete False): the plan of its shards."""
    aux_width = len(key["aux_layer_ids"] or []) * hidden_size
    layout = Layout(aux_width, hidden_size)
    lengths = [len(s.input_ids) for s in samples]
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    return {"format": FORMAT, "version": VERSION, "key": key, "complete": False, "hidden_size": hidden_size,
            "aux_layer_ids": key["aux_layer_ids"], "aux_width": aux_width,
            "arrays": {"aux": ["bfloat16", aux_width], "last": ["bfloat16", hidden_size], "top1": ["int32", 1]},
            "num_samples": len(samples), "num_tokens": sum(lengths),
            "samples": [[o, n] for o, n in zip(offsets, lengths)], "shard_bytes": shard_bytes,
            "shards": plan_shards(lengths, layout.bytes_per_token, shard_bytes), "write_seconds": None}


class Arrays(NamedTuple):
    aux: np.ndarray | None  # [n, 3H] int16 (bf16 bits); None for Medusa
    last: np.ndarray  # [n, H] int16 (bf16 bits)
    top1: np.ndarray  # [n] int32


def _memmaps(path: Path, layout: Layout, tokens: int, mode: str) -> Arrays:
    """The three arrays of a shard file, memory-mapped (mode "r" or "r+")."""
    at_aux, at_last, at_top1 = layout.offsets(tokens)
    aux = np.memmap(path, np.int16, mode, at_aux, (tokens, layout.aux)) if layout.aux else None
    return Arrays(aux, np.memmap(path, np.int16, mode, at_last, (tokens, layout.hidden)),
                  np.memmap(path, np.int32, mode, at_top1, (tokens,)))


# ---------------------------------------------------------------------------------------
# Open (write when missing)
# ---------------------------------------------------------------------------------------
def open_states(cfg: TrainConfig, target, samples: list[Sample], aux_layer_ids, pad_id: int,
                shard_bytes: int = SHARD_BYTES) -> tuple[StatesReader, dict]:
    """The reader of the run's cached states, written first when missing or incomplete;
    and what happened ({"path", "written", "write_seconds", "tokens", "bytes"})."""
    dtype = next(target.parameters()).dtype
    key = cache_key(cfg.target, samples, aux_layer_ids, dtype)
    folder = Path(cfg.states_cache_dir) if cfg.states_cache_dir else default_dir(key)
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder / LOCK):
        manifest = read_manifest(folder)
        if manifest is None:
            _check_empty(folder)
            manifest = new_manifest(key, samples, target.config.hidden_size, shard_bytes)
        check_key(folder, manifest["key"], key)
        written = not manifest["complete"]
        if written:
            manifest = write_states(target, samples, folder, manifest, cfg.batch_size, pad_id)
        else:
            logger.info("target states: reusing %s (%d samples, %d tokens; written in %.0f s)", folder,
                        manifest["num_samples"], manifest["num_tokens"], manifest["write_seconds"])
    info = {"path": str(folder), "written": written, "write_seconds": manifest["write_seconds"] if written else 0.0,
            "tokens": manifest["num_tokens"], "bytes": sum(s["bytes"] for s in manifest["shards"])}
    return StatesReader(folder, manifest, cfg.device, dtype, target.get_output_embeddings()), info


def read_manifest(folder: Path) -> dict | None:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"--states-cache {folder}: {MANIFEST} is not a specplug target-states manifest; "
                         "pass another folder")
    return manifest


def _check_empty(folder: Path) -> None:
    others = [p.name for p in folder.iterdir() if p.name != LOCK]
    if others:
        raise ValueError(f"--states-cache {folder} holds files ({', '.join(sorted(others)[:3])}) but no {MANIFEST}: "
                         "pass an empty or new folder, or one that specplug train wrote")


def _write_manifest(folder: Path, manifest: dict) -> None:
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest) + "\n")
    os.replace(tmp, folder / MANIFEST)  # atomic


# ---------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------
def write_states(target, samples: list[Sample], folder: Path, manifest: dict, batch_size: int,
                 pad_id: int) -> dict:
    """Write the shards not on disk yet (tqdm bar: tokens/s, ETA), then mark the manifest
    complete; returns it. The manifest (the plan) is written first, so an interrupted
    write resumes with the same shards."""
    from tqdm.auto import tqdm

    todo = [s for s in manifest["shards"] if not _shard_done(folder, s)]
    _check_disk(folder, sum(s["bytes"] for s in todo))
    _write_manifest(folder, manifest)
    logger.info("target states: writing %d of %d shards (%d samples, %d tokens, %.2f GiB) into %s", len(todo),
                len(manifest["shards"]), manifest["num_samples"], manifest["num_tokens"],
                sum(s["bytes"] for s in manifest["shards"]) / 2**30, folder)
    start = time.perf_counter()
    with tqdm(total=sum(s["tokens"] for s in todo), desc="target states", unit="tok", unit_scale=True,
              dynamic_ncols=True) as bar:
        for shard in todo:
            _write_shard(target, samples, folder, manifest, shard, (batch_size, pad_id), bar)
    seconds = time.perf_counter() - start + (manifest["write_seconds"] or 0.0)
    manifest = dict(manifest, complete=True, write_seconds=round(seconds, 3))
    _write_manifest(folder, manifest)
    logger.info("target states: written in %.1f s", seconds)
    return manifest


def _shard_done(folder: Path, shard: dict) -> bool:
    path = folder / shard["file"]
    return path.is_file() and path.stat().st_size == shard["bytes"]


def _check_disk(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if need > 0.95 * free:
        raise ValueError(f"the target states need {need / 2**30:.2f} GiB at {folder} but {free / 2**30:.2f} GiB "
                         "is free: pass --states-cache PATH on a bigger disk, lower --max-samples, "
                         "or --no-states-cache")


@torch.no_grad()
def _write_shard(target, samples: list[Sample], folder: Path, manifest: dict, shard: dict,
                 batching: tuple[int, int], bar) -> None:
    """Target passes over the shard's samples (batch_size at a time, right-padded by
    `collate`) into SHARD.tmp, then renamed into place."""
    batch_size, pad_id = batching
    layout = _layout(manifest)
    aux_ids = tuple(manifest["aux_layer_ids"]) if manifest["aux_layer_ids"] else None
    tmp = folder / (shard["file"] + ".tmp")
    with open(tmp, "wb") as handle:
        handle.truncate(shard["bytes"])
    arrays = _memmaps(tmp, layout, shard["tokens"], "r+")
    device = next(target.parameters()).device
    row, end = 0, shard["first_sample"] + shard["num_samples"]
    for first in range(shard["first_sample"], end, batch_size):
        chunk = samples[first:min(first + batch_size, end)]
        batch = Batch(*(t.to(device) for t in collate(chunk, pad_id)))
        tgt = target_pass(target, batch, aux_ids)
        top1 = tgt.logits.argmax(-1)  # [b, T]
        for i, sample in enumerate(chunk):
            n = len(sample.input_ids)
            if arrays.aux is not None:
                arrays.aux[row:row + n] = _bits(tgt.aux[i, :n])
            arrays.last[row:row + n] = _bits(tgt.last_hidden[i, :n])
            arrays.top1[row:row + n] = top1[i, :n].cpu().numpy()
            row += n
        bar.update(int(batch.attention_mask.sum()))
    for array in arrays:
        if array is not None:
            array.flush()
    del arrays
    os.replace(tmp, folder / shard["file"])


def _bits(x: torch.Tensor) -> np.ndarray:
    """bf16 bits of x as int16 [..]."""
    return x.detach().to("cpu", torch.bfloat16).view(torch.int16).numpy()


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------
class StatesReader:
    """`TargetOutput`s of batches from a complete cache folder: right-padded like
    `collate` (zeros on the padding, which no scored row reads), on `device` in `dtype`
    (the target's), with logits None: `TargetOutput.scores` computes them from `last` and
    the target's lm_head, `argmax` returns the cached top1."""

    def __init__(self, folder: str | os.PathLike, manifest: dict, device: str, dtype: torch.dtype, lm_head):
        if not manifest["complete"]:
            raise ValueError(f"{folder}: the target states are incomplete (an interrupted write); "
                             "rerun training to finish them")
        self.folder, self.manifest, self.layout = Path(folder), manifest, _layout(manifest)
        self.device, self.dtype, self.lm_head = device, dtype, lm_head
        self._firsts = [s["first_sample"] for s in manifest["shards"]]
        self._maps: dict[int, Arrays] = {}

    def sample(self, index: int) -> Arrays:
        """Sample `index`'s rows, memory-mapped: aux [n, 3H], last [n, H] (bf16 bits), top1 [n]."""
        k = bisect.bisect_right(self._firsts, index) - 1
        shard = self.manifest["shards"][k]
        if k not in self._maps:
            self._maps[k] = _memmaps(self.folder / shard["file"], self.layout, shard["tokens"], "r")
        offset, length = self.manifest["samples"][index]
        at = offset - shard["first_token"]
        maps = self._maps[k]
        return Arrays(maps.aux[at:at + length] if maps.aux is not None else None, maps.last[at:at + length],
                      maps.top1[at:at + length])

    def target_output(self, indices: list[int], width: int) -> TargetOutput:
        """The target's states for the samples `indices`, right-padded to `width` tokens."""
        aux = np.zeros((len(indices), width, self.layout.aux), np.int16) if self.layout.aux else None
        last = np.zeros((len(indices), width, self.layout.hidden), np.int16)  # [B, T, H]
        top1 = np.zeros((len(indices), width), np.int64)  # [B, T]
        for row, index in enumerate(indices):
            arrays = self.sample(index)
            n = len(arrays.last)
            if aux is not None:
                aux[row, :n] = arrays.aux
            last[row, :n] = arrays.last
            top1[row, :n] = arrays.top1
        return TargetOutput(self._tensor(last), None, self._tensor(aux) if aux is not None else None,
                            torch.from_numpy(top1).to(self.device), self.lm_head)

    def _tensor(self, bits: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(bits).view(torch.bfloat16).to(self.device).to(self.dtype)
