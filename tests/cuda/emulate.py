"""Test support (not product code): the CUDA verify kernel run on the CPU.

Compiles plugins/common/cuda/verify_kernels.cu as C++ against the emulator in
tests/cuda/emu (CUDA threads as coroutines with real block / warp barriers), with a
smaller block so that it runs fast, and calls it like ``try_verify`` does. Lets the
kernel's logic be checked against the torch reference on machines without a GPU; it
says nothing about speed or the GPU memory model.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from specplug.common.cuda import build as cuda_build
from specplug.common.cuda import dispatch

EMU_DIR = Path(__file__).resolve().parent / "emu"
LAUNCH = re.compile(r"verify_kernel<T, (\w+)><<<grid, kThreads, 0, stream>>>\(a\);")
THREADS = re.compile(r"constexpr int kThreads = \d+;")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
GXX = shutil.which("g++")


def build_emulator(workdir: Path, threads: int = 64) -> Path:
    """Compiles the kernel + emulator + driver into ``workdir/driver``; returns its path."""
    source = (cuda_build.SOURCE_DIR / "verify_kernels.cu").read_text()
    source, launches = LAUNCH.subn(r"emu::launch(grid, kThreads, [=] { verify_kernel<T, \1>(a); });", source)
    source, sizes = THREADS.subn(f"constexpr int kThreads = {threads};", source)
    if launches != 4 or sizes != 1:
        raise RuntimeError("verify_kernels.cu changed shape: update tests/cuda/emulate.py's rewrites")
    (workdir / "verify_kernels_emu.cpp").write_text(source)
    binary = workdir / "driver"
    cmd = [GXX or "g++", "-std=c++20", "-O1", "-ffp-contract=off", "-I", str(EMU_DIR), "-I",
           str(cuda_build.SOURCE_DIR), str(workdir / "verify_kernels_emu.cpp"), str(EMU_DIR / "driver.cpp"),
           "-o", str(binary)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"emulator build failed:\n{done.stderr[-4000:]}")
    return binary


def _write(path: Path, t: torch.Tensor) -> None:
    t = t.contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    t.numpy().tofile(path)


def run_emulated(binary: Path, candidates, parents, target, draft=None, *, method, num_nodes=None, uniforms=None,
                 mode="rows", splits=3, offset_elems=0):
    """The emulated kernel's VerifyResult fields (accepted_nodes narrowed to D+1, as
    try_verify does). ``offset_elems`` shifts the target's base address off 64 bytes."""
    code = dispatch._method_code(method, draft)
    accepted, num_accepted, bonus, depth = _run(binary, candidates, parents, target, draft, code, num_nodes,
                                                uniforms, dispatch.MODE_CODES[mode], splits, offset_elems)
    return accepted[:, : int(depth.max()) + 1], num_accepted, bonus


def _run(binary, candidates, parents, target, draft, code, num_nodes, uniforms, mode_code, splits, offset_elems=0):
    """Raw outputs (accepted_nodes [B, N], num_accepted, bonus_token, tree_depth)."""
    batch, nodes = candidates.shape
    flat = target.dim() == 2
    vocab = target.shape[-1]
    has_draft = draft is not None and code == dispatch.METHOD_CODES["draft_rejection"]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        _write(d / "target.bin", target)
        _write(d / "candidates.bin", candidates.long())
        _write(d / "parents.bin", parents.long())
        if num_nodes is not None:
            _write(d / "num_nodes.bin", num_nodes.long())
        if uniforms is not None:
            _write(d / "uniforms.bin", uniforms.float())
        if has_draft:
            _write(d / "draft.bin", draft)
        meta = [batch, nodes, vocab, DTYPE_CODES[target.dtype], code, mode_code, splits, int(flat),
                target.shape[0] if flat else batch * nodes, int(num_nodes is not None), int(uniforms is not None),
                int(has_draft), uniforms.shape[1] if uniforms is not None else 0,
                0 if flat else nodes * vocab, vocab, offset_elems * target.element_size()]
        (d / "meta.txt").write_text(" ".join(map(str, meta)))
        done = subprocess.run([str(binary), str(d)], capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"emulated kernel failed ({done.returncode}): {done.stderr[-2000:]}")
        out = torch.from_numpy(np.fromfile(d / "out.bin", dtype=np.int64))
    rest = out[batch * nodes:]
    return out[: batch * nodes].view(batch, nodes), rest[:batch], rest[batch: 2 * batch], rest[2 * batch:]


class EmulatedExtension:
    """Stands in for the built extension on CPU tensors: the binding's argument names
    (verify_binding.cpp's py::arg list), the emulated kernel behind them."""

    def __init__(self, binary: Path):
        self.binary = binary

    @staticmethod
    def workspace_bytes(batch, nodes, splits):
        return 256 + batch * nodes * max(splits, 1) * 8

    def verify(self, target, draft, candidates, parents, num_nodes, uniforms, accepted_nodes, num_accepted,
               bonus_token, tree_depth, workspace, method, mode, splits, stream):
        outs = _run(self.binary, candidates, parents, target, draft, method, num_nodes, uniforms, mode, splits)
        for dst, src in zip((accepted_nodes, num_accepted, bonus_token, tree_depth), outs):
            dst.copy_(src)
