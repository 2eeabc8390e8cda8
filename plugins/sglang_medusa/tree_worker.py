"""Tree verification in SGLang 0.5.23's scheduler: `TreeVerifyWorker`, the synchronous
speculative worker shell; a drafter's worker (worker.py, eagle_worker.py, token_worker.py)
supplies `_draft`, `_prefilled`, `_commit`, `note_request_finished` and `clear_cache_pool`.

A decode step for B requests: the trees, candidates [B, n] with node 0 the root (the last
committed token, its KV not yet cached), n <= num_nodes; ONE TARGET_VERIFY forward of the
B*n nodes at positions seq_len + depth under the tree mask (tree-only for the torch_native
hook, prefix-included for triton: common.sglang_backends); each node's row processed by
the request's rules along its path (common.request_rules), then common.verify_step; SGLang
moves the accepted path's KV to the front of the verify window and frees the rest.
SGLang reserves num_nodes KV slots per request (speculative_num_draft_tokens): a smaller
tree uses the first n and its outputs are padded to width num_nodes; with prefix-included
masks the trees themselves are padded (tree.pad_batch), never accepted. Prefill batches
run the plain target forward (_seeded_first_tokens).
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from specplug.common import sampling
from specplug.common.drafting.session import DraftingSession
from specplug.common.metrics import AcceptanceStats
from specplug.common.policy.step_policy import payoff_clock
from specplug.common.policy.throughput import CycleClock
from specplug.common.request_rules import apply_rules
from specplug.common.sglang_trees import (
    ROOT_ONLY, accepted_outputs, batch_layout, full_width, prefill_outputs, prefix_included_masks, root_only_batch,
    verify_q,
)
from specplug.common.tree import TreeBatch, pad_batch
from specplug.common.verify_result import VerifyResult
from specplug.common.verify_step import verify_step
from specplug.sglang_medusa import batch_view as view
from specplug.sglang_medusa.ranks import tp_ranks
from specplug.sglang_medusa.request_rules import rules_of
from specplug.common.sglang_backends import check_attention_backends, prefix_masks_needed, server_attention_backends

logger = logging.getLogger(__name__)

try:  # SGLang is present whenever this module is imported by a worker factory
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
    from sglang.srt.speculative.ngram_info import NgramVerifyInput
    from sglang.srt.speculative.spec_utils import move_accept_tokens_to_target_kvcache
except ImportError as exc:  # pragma: no cover - import-time guard for engine-free installs
    raise ImportError("specplug.sglang_medusa needs SGLang 0.5.23: pip install 'specplug[sglang]'") from exc


# SGLang 0.5.23 sampling backends whose sampler refuses per-request seeds (layers/sampler.py)
SEEDLESS_SAMPLING_BACKENDS = ("flashinfer", "intel_xpu", "ascend")


class TreeVerifyWorker(BaseSpecWorker):
    """Built by SGLang's scheduler as `Worker(server_args=, gpu_id=, nccl_port=,
    target_worker=)`; drives the target worker, owns no model runner of its own.
    Subclasses set `num_nodes` (the largest tree, root included), `method`
    (Verification.rule), the hidden states their drafter reads (`prefill_capture` /
    `verify_capture`) and `times_verify` (whether `_verified` needs the verify pass's
    time: on a GPU timing synchronises)."""

    prefill_capture = CaptureHiddenMode.NULL
    verify_capture = CaptureHiddenMode.NULL
    method = "rejection"
    typical_epsilon = sampling.TYPICAL_EPSILON
    typical_delta = sampling.TYPICAL_DELTA
    times_verify = False
    token_drafts = None  # a drafting.session.SyncedTokenDrafter (token drafters; hybrid head workers) or None
    session: DraftingSession | None = None  # a head worker's per-request drafting (sampled drafts, hybrid)
    payoff: CycleClock | None = None  # payoff control: each step drafts the tree, or verifies the roots alone

    def __init__(self, server_args, target_worker, num_nodes: int):
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None
        self.model_runner = target_worker.model_runner
        self.device = self.model_runner.device
        self.num_nodes = num_nodes
        self.prefix_masks = self._check_attention(server_args)
        self.stats = AcceptanceStats()  # this worker's verify steps, all requests
        # the same seed on every TP rank, drawn from in the same order: the same uniforms on every rank
        self.generator = torch.Generator(device="cpu").manual_seed(int(server_args.random_seed or 0))
        self.ranks = tp_ranks()  # rank-local measurements are decided on rank 0 and broadcast (common.parallel)
        self.steps = 0  # decode steps, the rank check's step number
        self._unseeded_first_token_reasons: set[str] = set()

    @property
    def draft_worker(self):
        return None

    def _check_attention(self, server_args) -> bool:
        """Refuse an attention backend not proven to verify trees on this device; True when
        verify steps hand the prefix-included mask (common.sglang_backends)."""
        from sglang.srt.arg_groups.overrides import resolving_view

        backends = server_attention_backends(resolving_view(server_args))
        check_attention_backends(str(self.device), backends, str(server_args.speculative_algorithm))
        prefix = prefix_masks_needed(backends)
        if prefix:
            logger.info("specplug: verify steps hand SGLang prefix-included tree masks, %d nodes per request",
                        self.num_nodes)
        return prefix

    # ------------------------------------------------------------------ drafter hooks

    def _draft(self, batch) -> tuple[TreeBatch, dict]:
        """(the step's trees, candidates [B, n] with the roots in column 0, and their
        layout: tree_layout / batch_layout)."""
        raise NotImplementedError

    def _prefilled(self, batch, result) -> None:
        """A prefill (extend) batch ran; result.logits_output holds `prefill_capture`."""

    def _commit(self, batch, tree: TreeBatch, verdict: VerifyResult, hidden) -> None:
        """A verify step was accepted; hidden = `verify_capture` of every node or None."""

    def _verified(self, tree: TreeBatch, verdict: VerifyResult, seconds: float | None) -> None:
        """A step's result and its verify forward's seconds (None unless `times_verify`)."""

    # ------------------------------------------------------------------ payoff control

    def _start_payoff(self, depth: int, on: bool) -> None:
        """Payoff control (policy.throughput) between this worker's trees (`depth` deep) and the
        roots alone, per batch size, when `on` (the settings' "payoff")."""
        if on:
            self.payoff = payoff_clock(depth, self.ranks, all_or_none=True, drafts="drafted trees")

    def _planned_draft(self, batch) -> tuple[TreeBatch, dict]:
        """The step's trees: the drafter's, or the roots alone where payoff control runs a plain step."""
        if self.payoff is not None and self.payoff.step(len(view.requests(batch))) == 0:
            return root_only_batch(torch.tensor(view.last_tokens(batch), dtype=torch.long)), ROOT_ONLY
        return self._draft(batch)

    def _free_token_drafts(self, rid: str | None = None) -> None:
        """A finished request's token-drafter copy (None: everything, SGLang's flush_cache)."""
        if self.token_drafts is None:
            return
        if rid is None:
            self.token_drafts.clear()
        else:
            self.token_drafts.free(rid)

    # ------------------------------------------------------------------ one scheduler step

    @torch.no_grad()
    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None):
        if view.is_decode(batch):
            return self._decode_step(batch, on_publish, pp_proxy_tensors)
        return self._extend_step(batch, on_publish, pp_proxy_tensors)

    def _extend_step(self, batch, on_publish, pp_proxy_tensors):
        """Plain target forward (prefill / idle); the drafter sees it through _prefilled."""
        with self._seeded_first_tokens(batch):
            result = self.target_worker.forward_batch_generation(
                batch, pp_proxy_tensors=pp_proxy_tensors, capture_hidden_mode=self.prefill_capture)
        if self.payoff is not None:
            self.payoff.disturbed()
        bs = len(view.requests(batch))
        if bs:
            self._prefilled(batch, result)
            result.logits_output.hidden_states = None
        accept_tokens, accept_lens = prefill_outputs(result.next_token_ids, bs, self.num_nodes, self.device)
        new_seq_lens = view.seq_lens(batch).clone()
        if on_publish is not None:
            on_publish(new_seq_lens)
        return self._result(result, result.next_token_ids, accept_tokens, accept_lens, new_seq_lens)

    @contextlib.contextmanager
    def _seeded_first_tokens(self, batch):
        """For an extend batch with a seeded sampled request, SGLang's sampler gets
        per-request seeds for the one forward (the request's sampling_seed, a fresh draw of
        self.generator for the others), so a seeded request's first token does not depend
        on its batch companions; not where SGLang's seeded sampler cannot serve the batch
        (SEEDLESS_SAMPLING_BACKENDS, or a min-p request)."""
        info = batch.sampling_info
        settings = view.request_sampling(batch)
        if info is None or info.sampling_seed is not None or not any(
                p.seed is not None and p.temperature > 0 for p in settings):
            yield
            return
        backend = get_exec().kernel.sampling_backend
        reason = (f"SGLang's sampling backend {backend!r} takes no per-request seeds (--sampling-backend pytorch "
                  "does)" if backend in SEEDLESS_SAMPLING_BACKENDS else
                  "SGLang's seeded sampler refuses min-p, which a request of the batch uses"
                  if info.need_min_p_sampling else None)
        if reason is not None:
            if reason not in self._unseeded_first_token_reasons:
                self._unseeded_first_token_reasons.add(reason)
                logger.info("specplug: the first token of a request with sampling_seed is drawn unseeded when %s; "
                            "its later tokens are seeded", reason)
            yield
            return
        fresh = torch.randint(-(1 << 62), 1 << 62, (len(settings),), generator=self.generator).tolist()
        seeds = [p.seed if p.seed is not None else f for p, f in zip(settings, fresh)]
        info.sampling_seed = torch.tensor(seeds, dtype=torch.int64, device=info.temperatures.device)
        try:
            yield
        finally:
            info.sampling_seed = None

    def _decode_step(self, batch, on_publish, pp_proxy_tensors):
        if batch.has_grammar:
            raise NotImplementedError("specplug's SGLang workers do not support structured output (grammar) "
                                      "requests yet")
        tree, layout = self._planned_draft(batch)
        if self.prefix_masks:  # SGLang's GPU verify reads num_nodes nodes per request
            tree = pad_batch(tree, self.num_nodes)
            layout = batch_layout(tree)
        self._prepare_verify(batch, tree, layout)
        started = time.perf_counter()
        result = self.target_worker.forward_batch_generation(
            batch, pp_proxy_tensors=pp_proxy_tensors, is_verify=True, capture_hidden_mode=self.verify_capture)
        seconds = self._elapsed(started) if self.times_verify else None
        logits_output = result.logits_output
        verdict = self._accept(batch, tree, logits_output.next_token_logits)
        self.steps += 1  # SPECPLUG_CHECK_RANKS=1: every TP rank drafted and accepted the same
        self.ranks.check(self.steps, (tree.candidates, tree.parents, verdict.accepted_nodes, verdict.bonus_token))
        self._verified(tree, verdict, seconds)
        if self.payoff is not None:  # a request whose tree is shallower than the step's depth counts as rejected there
            self.payoff.verified([self.payoff.depth] * len(verdict.num_accepted), verdict.num_accepted.tolist())
        accept_index, predict, accept_tokens = accepted_outputs(tree, verdict, self.device)
        accept_lens = (verdict.num_accepted + 1).to(torch.int32)
        move_accept_tokens_to_target_kvcache(batch, accept_index, verdict.num_accepted.to(torch.int32),
                                             self.token_to_kv_pool_allocator)
        if batch.return_logprob:
            from sglang.srt.layers.logprob_processor import compute_spec_logprobs

            compute_spec_logprobs(batch, logits_output, predict, accept_index=accept_index)
        self._commit(batch, tree, verdict, logits_output.hidden_states)
        logits_output.hidden_states = None
        new_seq_lens = view.seq_lens(batch) + accept_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        batch.forward_mode = ForwardMode.DECODE
        accept_tokens = full_width(accept_tokens, self.num_nodes)
        return self._result(result, accept_tokens.flatten(), accept_tokens.flatten(), accept_lens, new_seq_lens)

    def _elapsed(self, started: float) -> float:
        """Seconds since `started`, after the device has finished its queued work."""
        if str(self.device).startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - started

    def _result(self, target_result, next_token_ids, accept_tokens, accept_lens, new_seq_lens):
        next_draft_input = NgramVerifyInput(draft_token_num=self.num_nodes, new_seq_lens=new_seq_lens,
                                            accept_tokens=accept_tokens, accept_lens=accept_lens)
        return GenerationBatchResult(
            logits_output=target_result.logits_output, next_token_ids=next_token_ids,
            can_run_cuda_graph=target_result.can_run_cuda_graph, accept_lens=accept_lens,
            new_seq_lens=new_seq_lens, next_draft_input=next_draft_input,
            speculative_num_draft_tokens=self.num_nodes)

    # ------------------------------------------------------------------ verify, accept, commit

    def _prepare_verify(self, batch, tree: TreeBatch, layout: dict) -> None:
        """Turn the decode batch into a TARGET_VERIFY batch over the B*n tree nodes; layout
        tensors are one tree's ([n, n], [n]) or per request ([B, n, n], [B, n])."""
        bs, n = tree.candidates.shape
        seq_lens = view.seq_lens(batch)
        depth = layout["depth"].to(self.device).expand(bs, n)
        positions = (seq_lens[:, None].long() + depth).flatten()  # [B*n]
        masks = layout["mask"].to(self.device).expand(bs, n, n)  # [B, n, n]
        custom_mask = prefix_included_masks(masks, seq_lens) if self.prefix_masks else masks.flatten()
        retrieve_index = torch.arange(bs * n, device=self.device).view(bs, n)
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = tree.candidates.to(self.device).flatten()
        batch.out_cache_loc = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices, req_to_token=batch.req_to_token_pool.req_to_token,
            start_offset=seq_lens, end_offset=seq_lens + n, batch_size=bs, draft_token_num=n,
            device=self.device)
        batch.spec_info = NgramVerifyInput(
            draft_token=batch.input_ids, custom_mask=custom_mask,
            positions=positions, retrieve_index=retrieve_index,
            retrieve_next_token=layout["next_token"].to(self.device).expand(bs, n).contiguous(),
            retrieve_next_sibling=layout["next_sibling"].to(self.device).expand(bs, n).contiguous(),
            draft_token_num=n)

    def _accept(self, batch, tree: TreeBatch, logits: torch.Tensor) -> VerifyResult:
        """specplug.common.verify_step on the target's logits [B*n, V] after the request
        rules: the core chooses each request's rule (translation only here)."""
        bs, n = tree.candidates.shape
        parents, num_nodes = tree.parents, tree.num_nodes.cpu()
        rows = torch.full((bs,), n, dtype=torch.long)  # every request owns n rows (padding: roots)
        logits = apply_rules(logits, rules_of(view.requests(batch)), tree.candidates, parents, rows)
        q = None if self.method == "typical" else verify_q(  # sampled drafts: their q
            self.session, view.request_ids(batch), tree, logits.shape[-1], logits.device)
        verdict = verify_step(
            logits.view(bs, n, -1), tree.candidates, parents, num_nodes, view.request_sampling(batch),
            draft_probs=q, generator=self.generator, typical=self.method == "typical",
            typical_epsilon=self.typical_epsilon, typical_delta=self.typical_delta)
        self.stats.update(verdict.num_accepted, (num_nodes - 1).clamp(min=0))
        if self.stats.num_steps % 1000 < bs:
            logger.debug("specplug SGLang acceptance so far: %s", self.stats.as_dict())
        return verdict
