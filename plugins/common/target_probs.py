"""The target's distribution p: logits -> probabilities after temperature, min-p, top-k and
top-p (:func:`process_logits`, in vLLM's or SGLang's filter order), a request's sampling
settings (:class:`SamplingConfig`) and an exact argmax that is fast on a CPU
(:func:`first_argmax`). Verification (:mod:`specplug.common.sampling`) reads p from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["SamplingConfig", "process_logits", "sampling_tensors"]


# --------------------------------------------------------------------------- settings and logits


@dataclass(frozen=True)
class SamplingConfig:
    """A request's sampling settings; the project's one set of defaults.

    temperature: 0 means greedy. top_k: 0 or -1 = off. top_p: 1.0 = off.
    seed: per-request seed for a reproducible ``torch.Generator`` (None = global RNG).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and self.temperature != float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1] (1 = off), got {self.top_p!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def method(self) -> str:
        """The lossless verify method for this request alone."""
        return "greedy" if self.is_greedy else "rejection"

    def generator(self, device: str | torch.device = "cpu") -> torch.Generator | None:
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def sampling_tensors(configs: Sequence[SamplingConfig], device=None):
    """Per-request settings as tensors for :func:`process_logits`:
    (temperature Float [B], top_k Long [B], top_p Float [B])."""
    t = torch.tensor([c.temperature for c in configs], dtype=torch.float32, device=device)
    k = torch.tensor([c.top_k for c in configs], dtype=torch.long, device=device)
    p = torch.tensor([c.top_p for c in configs], dtype=torch.float32, device=device)
    return t, k, p


def _per_row(value, like: torch.Tensor, dtype) -> torch.Tensor:
    """Scalar or [R] tensor -> [R, 1, ..., 1] broadcastable against ``like`` [R, ..., V]."""
    t = torch.as_tensor(value, dtype=dtype, device=like.device)
    if t.dim() == 0:
        t = t.expand(like.shape[0])
    if t.shape != like.shape[:1]:
        raise ValueError(
            f"per-request sampling setting must be a scalar or shape [{like.shape[0]}], got "
            f"{tuple(t.shape)}: for flattened logits repeat it with repeat_interleave(num_nodes)"
        )
    return t.view(-1, *([1] * (like.dim() - 1)))


ORDERS = ("vllm", "sglang")


def process_logits(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                   order: str = "vllm") -> torch.Tensor:
    """Target logits [R, ..., V] -> probabilities p (float32), the ONE place this happens.

    temperature/top_k/top_p/min_p: scalars or per-request tensors [R]. Rows with
    temperature 0 get a one-hot p at the argmax, so greedy and sampled requests share
    one "rejection" batch and the greedy rows behave exactly like greedy verify.
    Order as vLLM's sampler: temperature, then min-p drops tokens whose probability is
    below min_p x the row's largest, then top-k keeps the k largest logits (ties by
    sort order), then top-p keeps the smallest prefix of the sorted distribution whose
    mass reaches top_p. Penalties, bans and bias come before, in request_rules.
    ``order="sglang"``: SGLang's sampler instead (sampler.py, the torch path): top-p
    keeps the tokens whose mass before them in the FULL distribution is <= top_p, top-k
    the k largest, then min-p drops what is below min_p x the largest. The two engines'
    filters differ when top-k or min-p is combined with top-p; each engine's requests
    must get its own, or verification would match the other engine's distribution.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS} (whose sampler's filter order to follow), got {order!r}")
    temp = _per_row(temperature, logits, torch.float32)
    k = _per_row(top_k, logits, torch.long)
    top_p = _per_row(top_p, logits, torch.float32)
    min_p = _per_row(min_p, logits, torch.float32)
    if bool((temp < 0).any()) or bool((top_p <= 0).any()) or bool((top_p > 1).any()) \
            or bool((min_p < 0).any()) or bool((min_p > 1).any()):
        raise ValueError("temperature must be >= 0, top_p in (0, 1] and min_p in [0, 1]: "
                         "check the request's sampling settings")
    vocab = logits.shape[-1]
    x = logits.float() / torch.where(temp > 0, temp, torch.ones_like(temp))
    use_min_p, sglang = bool((min_p > 0).any()), order == "sglang"
    if use_min_p and not sglang:
        x = _filter_min_p(x, min_p)
    use_k = (k > 0) & (k < vocab)
    use_p = top_p < 1.0
    if bool(use_k.any()) or bool(use_p.any()):
        x = _filter_top_k_top_p(x, torch.where(use_k, k, vocab), torch.where(use_p, top_p, 2.0), full_mass=sglang)
    if use_min_p and sglang:
        x = _filter_min_p(x, min_p)
    probs = torch.softmax(x, dim=-1)
    greedy = temp == 0
    if bool(greedy.any()):
        top = first_argmax(logits.reshape(-1, vocab)).view(*logits.shape[:-1], 1)
        onehot = torch.zeros_like(probs).scatter_(-1, top, 1.0)
        probs = torch.where(greedy, onehot, probs)
    return probs


ARGMAX_CHUNK = 1024  # first_argmax: columns per chunk
NUMPY_ARGMAX_DTYPES = (torch.float32, torch.float64, torch.float16)  # first_argmax: numpy's own argmax


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), exactly (first maximal index; a NaN counts as the maximum), for
    x Float [R, V] -> Long [R]. torch's CPU argmax is not vectorised (126 us over 5 rows
    of a 49k vocabulary, 2 threads): on a CPU numpy's argmax, which is (18 us; the same
    rule for ties and NaN), for dtypes numpy has; elsewhere rows of more than 4 chunks
    find the first chunk holding the row's max with amax, then argmax inside that chunk."""
    rows, vocab = x.shape
    if x.device.type == "cpu" and x.dtype in NUMPY_ARGMAX_DTYPES and vocab:
        return torch.from_numpy(x.detach().numpy().argmax(-1).astype("int64", copy=False))
    if vocab <= 4 * ARGMAX_CHUNK:
        return x.argmax(-1)
    whole = vocab // ARGMAX_CHUNK * ARGMAX_CHUNK
    chunk_max = x[:, :whole].reshape(rows, -1, ARGMAX_CHUNK).amax(-1)  # [R, C]
    if whole < vocab:
        chunk_max = torch.cat([chunk_max, x[:, whole:].amax(-1, keepdim=True)], 1)
    peak = chunk_max.amax(-1, keepdim=True)  # [R, 1]; NaN where the row holds one
    if bool(peak.isnan().any()):
        return x.argmax(-1)
    chunk = (chunk_max == peak).int().argmax(-1)  # [R] the first chunk holding the max
    columns = (chunk[:, None] * ARGMAX_CHUNK + torch.arange(ARGMAX_CHUNK, device=x.device)).clamp(max=vocab - 1)
    return chunk * ARGMAX_CHUNK + x.gather(1, columns).argmax(-1)  # a clamped column repeats V - 1 after it


def _filter_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set logits whose probability is below min_p x the row's largest to -inf."""
    probs = torch.softmax(x, dim=-1)
    return x.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))


def _filter_top_k_top_p(x: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, full_mass: bool = False) -> torch.Tensor:
    """Set logits outside top-k / top-p to -inf (k = V and top_p = 2 mean off). Top-p
    counts the mass before a token after top-k (vLLM: dropped at >= top_p), or with
    ``full_mass`` in the whole distribution (SGLang: dropped at > top_p)."""
    sorted_x, order = x.sort(dim=-1, descending=True)  # [..., V]
    pos = torch.arange(x.shape[-1], device=x.device)
    p_full = torch.softmax(sorted_x, dim=-1) if full_mass else None
    sorted_x = sorted_x.masked_fill(pos >= k, float("-inf"))
    p_sorted = p_full if full_mass else torch.softmax(sorted_x, dim=-1)
    mass_before = p_sorted.cumsum(-1) - p_sorted
    drop = ((mass_before > top_p) if full_mass else (mass_before >= top_p)) & (pos > 0)
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)
