"""GPU kernels: fused CUDA tree verification (the torch code in sampling.py is its
reference) and, in `tree_attention_triton` (imported on its own: it needs Triton), tree
attention over vLLM's GPU paged KV layout.

``try_verify`` (called first by ``specplug.common.sampling.verify`` on CUDA tensors)
returns the kernel's ``VerifyResult`` or None, in which case the torch path runs.
Importing this package needs no GPU and no compiler: the extension is built on first
use (see build.py and docs/cuda.md).
"""

from specplug.common.cuda.build import load_extension
from specplug.common.cuda.dispatch import try_verify, unsupported_reason

__all__ = ["try_verify", "unsupported_reason", "load_extension"]
