"""Chooses between the fused CUDA verify kernel and the torch path, and launches it.

:func:`try_verify` is what ``specplug.common.sampling.verify`` calls first on CUDA
tensors: it returns a ``VerifyResult`` from the kernel, or None when the torch path
must run (CPU tensors, an unsupported method or input, a failed build, or the switch
``SPECPLUG_CUDA=0``). Each distinct decision is logged once at INFO.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass

import torch

from specplug.common.cuda.build import load_extension

logger = logging.getLogger(__name__)

# Mirrors verify.h (SPECPLUG_MAX_NODES / SPECPLUG_MAX_VOCAB); larger inputs take the torch path.
MAX_NODES = 1024
MAX_VOCAB = 262144
MAX_BATCH = 65535
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
METHOD_CODES = {"greedy": 0, "target_only": 1, "draft_rejection": 2, "coupled": 3}  # SpecplugMethod
MODE_CODES = {"rows": 0, "path": 1}  # SpecplugMode
DISABLE_ENV = "SPECPLUG_CUDA"  # "0" forces the torch path
MODE_ENV = "SPECPLUG_CUDA_MODE"  # "rows" or "path" forces a schedule (benchmarks)


@dataclass(frozen=True)
class ScheduleConfig:
    """How the kernel spreads the work (see docs/cuda.md).

    path_min_rows: from this many tree rows per batch (B * N) on, one block per request
        reduces only the rows it visits ("path"); below it every row is reduced in
        parallel first ("rows").
    blocks_per_sm: "rows" aims for this many blocks per multiprocessor.
    min_split_bytes: "rows" splits a row across blocks only into parts this large.
    """

    path_min_rows: int = 1024
    blocks_per_sm: int = 4
    min_split_bytes: int = 16384


SCHEDULE = ScheduleConfig()


@functools.lru_cache(maxsize=None)
def _announce(path: str, reason: str) -> None:
    """One INFO line per distinct (path, reason): which verify path runs and why."""
    logger.info("specplug verify: %s path (%s)", path, reason)


def _method_code(method: str, draft_probs) -> int | None:
    if method == "greedy":
        return METHOD_CODES["greedy"]
    if method == "rejection":
        return METHOD_CODES["target_only" if draft_probs is None else "draft_rejection"]
    if method == "coupled" and draft_probs is None:
        return METHOD_CODES["coupled"]
    return None


def unsupported_reason(candidates, parents, target_probs, draft_probs, method, num_nodes, uniforms) -> str | None:
    """Why the kernel cannot take this call (None: it can). Reads shapes only: no sync."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return f"disabled by {DISABLE_ENV}=0"
    if not isinstance(target_probs, torch.Tensor) or not target_probs.is_cuda:
        device = target_probs.device if isinstance(target_probs, torch.Tensor) else type(target_probs).__name__
        return f"tensors are on {device}, the kernel needs CUDA"
    return input_reason(candidates, parents, target_probs, draft_probs, method, num_nodes, uniforms)


def kernel_ready(tensor: torch.Tensor) -> bool:
    """Whether ``sampling.verify`` on ``tensor``'s device reaches the kernel: CUDA, not
    switched off by ``SPECPLUG_CUDA=0``, and the extension built (the first call builds it)."""
    if not tensor.is_cuda or os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    return load_extension().module is not None


def input_reason(candidates, parents, target_probs, draft_probs, method, num_nodes, uniforms) -> str | None:
    """Why the kernel cannot take these inputs wherever they live (None: it can)."""
    code = _method_code(method, draft_probs)
    if code is None:
        return f"method {method!r} has no kernel"
    if target_probs.dtype not in DTYPES:
        return f"target_probs dtype {target_probs.dtype} has no kernel (float32, bfloat16, float16)"
    if candidates.dim() != 2 or parents.shape != candidates.shape:
        return f"candidates/parents shapes {tuple(candidates.shape)}/{tuple(parents.shape)} are not [B, N]"
    batch, nodes = candidates.shape
    vocab = target_probs.shape[-1]
    if batch > MAX_BATCH or nodes > MAX_NODES or vocab > MAX_VOCAB:
        return f"B={batch}, N={nodes}, V={vocab} exceed the kernel's limits ({MAX_BATCH}, {MAX_NODES}, {MAX_VOCAB})"
    if target_probs.dim() == 2 and num_nodes is None:
        return "flattened target_probs without num_nodes"
    if target_probs.dim() not in (2, 3) or target_probs.stride(-1) != 1:
        return "target_probs is not [B, N, V] / [rows, V] with contiguous rows"
    if code != METHOD_CODES["greedy"]:
        if uniforms is None:
            return "no uniforms given (sampling.verify draws them before calling the kernel)"
        if uniforms.dtype != torch.float32:
            return f"uniforms are {uniforms.dtype}; the kernel reproduces the torch path for float32 uniforms"
    if code == METHOD_CODES["draft_rejection"]:
        same = (draft_probs.dtype, draft_probs.shape, draft_probs.stride()) == (
            target_probs.dtype, target_probs.shape, target_probs.stride())
        if not same or draft_probs.device != target_probs.device:
            return "draft_probs differs from target_probs in dtype, shape, strides or device"
        if (draft_probs.data_ptr() - target_probs.data_ptr()) % 16:
            return "draft_probs and target_probs rows are not equally aligned to 16 bytes"
    return None


def schedule(method_code: int, batch: int, nodes: int, vocab: int, elem_bytes: int, device) -> tuple[int, int]:
    """(mode code, splits) for one launch; ``SPECPLUG_CUDA_MODE`` overrides the mode."""
    forced = os.environ.get(MODE_ENV, "")
    if method_code in (METHOD_CODES["draft_rejection"], METHOD_CODES["coupled"]):  # no "rows" form
        mode = "path"
    elif forced in MODE_CODES:
        mode = forced
    else:
        mode = "path" if batch * nodes >= SCHEDULE.path_min_rows else "rows"
    if mode == "path":
        return MODE_CODES["path"], 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = math.ceil(SCHEDULE.blocks_per_sm * sms / (batch * nodes))
    largest = max(1, vocab * elem_bytes // SCHEDULE.min_split_bytes)
    return MODE_CODES["rows"], max(1, min(wanted, largest))


def _stream_handle(device) -> int:
    """The current CUDA stream of ``device`` as an integer (a cudaStream_t)."""
    return torch.cuda.current_stream(device).cuda_stream


def _long(x: torch.Tensor, device) -> torch.Tensor:
    return x.to(device=device, dtype=torch.long).contiguous()


def launch(ext, candidates, parents, target_probs, draft_probs, method_code, num_nodes, uniforms, max_depth=None):
    """Runs the kernel; returns (accepted_nodes [B, D+1], num_accepted [B], bonus_token [B]).

    The kernel itself never synchronises; D (the batch's deepest tree) is read back with
    one host sync unless ``max_depth`` is given.
    """
    device = target_probs.device
    batch, nodes = candidates.shape
    mode, splits = schedule(method_code, batch, nodes, target_probs.shape[-1], target_probs.element_size(), device)
    out = dict(
        accepted_nodes=torch.empty(batch, nodes, dtype=torch.long, device=device),
        num_accepted=torch.empty(batch, dtype=torch.long, device=device),
        bonus_token=torch.empty(batch, dtype=torch.long, device=device),
        tree_depth=torch.empty(batch, dtype=torch.long, device=device),
    )
    workspace = torch.empty(ext.workspace_bytes(batch=batch, nodes=nodes, splits=splits), dtype=torch.uint8,
                            device=device)
    ext.verify(
        target=target_probs,
        draft=draft_probs if method_code == METHOD_CODES["draft_rejection"] else None,
        candidates=_long(candidates, device),
        parents=_long(parents, device),
        num_nodes=None if num_nodes is None else _long(num_nodes, device),
        uniforms=None if uniforms is None else uniforms.to(device).contiguous(),
        workspace=workspace,
        method=method_code,
        mode=mode,
        splits=splits,
        stream=_stream_handle(device),
        **out,
    )
    depth = int(out["tree_depth"].max()) if max_depth is None else int(max_depth)
    return out["accepted_nodes"][:, : depth + 1], out["num_accepted"], out["bonus_token"]


def try_verify(
    candidates,
    parents,
    target_probs,
    draft_probs=None,
    *,
    method="greedy",
    num_nodes=None,
    uniforms=None,
    max_depth=None,
):
    """The kernel's answer to ``sampling.verify`` (same arguments, same result), or None.

    None means "run the torch path": tensors not on CUDA, a method without a kernel
    ("typical"), inputs beyond the kernel's limits, no float32 uniforms for "rejection" or "coupled",
    ``SPECPLUG_CUDA=0``, or a failed build. Inputs are assumed already validated by
    ``sampling.verify`` (parents[i] < i, 1 <= num_nodes <= N, probabilities). ``max_depth``
    (the batch's deepest tree) saves one host sync when the caller knows it.
    """
    reason = unsupported_reason(candidates, parents, target_probs, draft_probs, method, num_nodes, uniforms)
    if reason is not None:
        _announce("torch", reason)
        return None
    build = load_extension()
    if build.module is None:
        _announce("torch", f"the CUDA kernel is unavailable: {build.error}")
        return None
    code = _method_code(method, draft_probs)
    _announce("CUDA kernel", f"method {method!r}{' with draft_probs' if draft_probs is not None else ''} "
              f"on {target_probs.device}")
    from specplug.common.verify_result import VerifyResult

    return VerifyResult(*launch(build.module, candidates, parents, target_probs, draft_probs, code, num_nodes,
                                uniforms, max_depth))
