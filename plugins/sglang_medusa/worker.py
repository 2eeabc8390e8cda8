"""The MEDUSA speculative worker for SGLang 0.5.23 (synchronous V2 scheduler schema).

One decode step for a batch of B requests, N tree nodes each (node 0 = the root, the
last committed token, whose KV is not yet in the cache):

1. draft: MedusaDrafter turns each request's last target hidden state into a static
   candidate tree (specplug.common.tree): candidates [B, N], one shared topology.
2. verify: ONE TARGET_VERIFY forward of the B*N nodes at positions seq_len + depth,
   each node attending to the prefix and its ancestors (tree mask; on CPU through
   specplug.sglang_medusa.tree_attention). It returns logits [B*N, V] and, because the
   batch captures FULL hidden states, the hidden state of every node.
3. accept: specplug.common.sampling.verify, greedy for all-greedy batches, else the
   lossless target-only tree rule (or typical acceptance, LOSSY, when configured).
4. commit: SGLang moves the accepted path's KV to the front of the verify window
   (move_accept_tokens_to_target_kvcache) and frees the rest; the drafter keeps the
   hidden state of the last accepted node for the next step.

Prefill (extend) batches run the plain target forward capturing the LAST hidden state.

Adaptive speculation (settings.adaptive): before each decode step
specplug.common.adaptive.AdaptiveController picks a tree from a family of budgets (the
optimal sparse trees for the heads' accuracies, or chains of 1..depth) or none, from
verify-pass timings by tokens in the batch, heads timings by batch, and the verify
results. SGLang reserves KV slots for the full tree every step; a smaller tree uses the
first n of them (the rest are freed as rejected drafts are), and "none" verifies the
root alone (n = 1, no heads pass): an ordinary decode step through the verify path.
Outputs are padded to the full tree's width, which SGLang's bookkeeping expects.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from specplug.common import sampling
from specplug.common.adaptive import AdaptiveController, pinned_costs, tree_family, tree_option
from specplug.common.drafters import MedusaDrafter, prior_accuracies
from specplug.common.metrics import AcceptanceStats
from specplug.common.tree import DraftTree, TreeBatch, TreeConfig
from specplug.sglang_medusa.settings import MedusaSettings, settings_from_server_args

logger = logging.getLogger(__name__)

try:  # SGLang is present whenever this module is imported by the worker factory
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
    from sglang.srt.speculative.ngram_info import NgramVerifyInput
    from sglang.srt.speculative.spec_utils import move_accept_tokens_to_target_kvcache
except ImportError as exc:  # pragma: no cover - import-time guard for engine-free installs
    raise ImportError("specplug.sglang_medusa.worker needs SGLang 0.5.23: pip install 'specplug[sglang]'") from exc


class MedusaWorker(BaseSpecWorker):
    """Built by SGLang's scheduler as `MedusaWorker(server_args=, gpu_id=, nccl_port=,
    target_worker=)`; drives the target worker, owns no model runner of its own."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None
        self.model_runner = target_worker.model_runner
        self.device = self.model_runner.device
        cfg = resolving_view(server_args)  # server_args plus what resolution declared
        self.settings: MedusaSettings = settings_from_server_args(
            cfg, adaptive_arg=bool(getattr(server_args, "speculative_adaptive", False)))
        self.drafter = MedusaDrafter(self._load_heads(), choices=self.settings.choices,
                                     head_accuracies=self.settings.head_accuracies)
        self.template: DraftTree = self.drafter.template(self.settings.tree)
        self.num_nodes = self.template.num_nodes
        if self.num_nodes != cfg.speculative_num_draft_tokens:
            raise ValueError(
                f"MEDUSA tree has {self.num_nodes} nodes but speculative_num_draft_tokens is "
                f"{cfg.speculative_num_draft_tokens}: leave --speculative-num-draft-tokens "
                "unset or give the tree's node count")
        self.stats = AcceptanceStats()  # this worker's verify steps, all requests
        self.generator = torch.Generator(device="cpu").manual_seed(int(server_args.random_seed or 0))
        self._layout = self._tree_layout(self.template)
        self.adaptive: AdaptiveController | None = None
        self._budgets: dict = {}  # SpecOption -> (TreeConfig, layout)
        if self.settings.adaptive:
            self._start_adaptive()
        logger.info("MEDUSA worker: %d heads, %d-node tree (depth %d), %s verification", self.drafter.heads.num_heads,
                    self.num_nodes, self.template.max_depth, self.settings.verification)

    # ------------------------------------------------------------------ set-up

    def _load_heads(self):
        from specplug.common.formats import load_head_module

        dtype = self.model_runner.model_config.dtype
        return load_head_module(self.settings.heads_path, target_config=self.server_args.model_path,
                                device=self.device, dtype=dtype).eval()

    def _tree_layout(self, template: DraftTree) -> dict[str, torch.Tensor]:
        """A static tree's mask, depths and SGLang retrieve links (one request)."""
        _, next_token, next_sibling = template.sglang_layout()
        return {"mask": template.attention_mask().to(self.device),  # Bool [N, N]
                "depth": template.depth.to(self.device),  # Long [N]
                "next_token": next_token.to(self.device), "next_sibling": next_sibling.to(self.device)}

    def _start_adaptive(self) -> None:
        """The controller over this worker's budget family (see budget_configs)."""
        accuracies = self.settings.head_accuracies
        if accuracies is None:
            accuracies = prior_accuracies(self.drafter.heads.num_heads, self.settings.tree.topk)
        for config in budget_configs(self.settings):
            template = self.drafter.template(config)
            self._budgets[tree_option(template, accuracies)] = (config, self._tree_layout(template))
        self.adaptive = AdaptiveController(list(self._budgets))
        self.adaptive.costs_override = pinned_costs(os.environ)
        self._root_only = self._tree_layout(DraftTree(torch.zeros(1, dtype=torch.long), torch.tensor([-1])))
        logger.info("MEDUSA adaptive speculation on: each step verifies one of the trees with %s draft nodes, "
                    "or none, as specplug.common.adaptive chooses from costs measured in this engine%s",
                    [o.nodes for o in self.adaptive.options],
                    " (cost curves pinned by SPECPLUG_ADAPTIVE_COSTS)" if self.adaptive.costs_override else "")

    @property
    def draft_worker(self):
        return None

    def clear_cache_pool(self):
        self.drafter.release(list(self.drafter.hidden))

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self.drafter.release([rid])

    # ------------------------------------------------------------------ one scheduler step

    @torch.no_grad()
    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None):
        if batch.forward_mode.is_decode():
            return self._decode_step(batch, on_publish, pp_proxy_tensors)
        return self._extend_step(batch, on_publish, pp_proxy_tensors)

    def _extend_step(self, batch, on_publish, pp_proxy_tensors):
        """Plain target forward (prefill / idle); remember each request's last hidden state."""
        result = self.target_worker.forward_batch_generation(
            batch, pp_proxy_tensors=pp_proxy_tensors, capture_hidden_mode=CaptureHiddenMode.LAST)
        bs = len(batch.reqs)
        hidden = result.logits_output.hidden_states if bs else None  # [B, H]
        if bs and hidden is not None:
            rids = [req.rid for req in batch.reqs]
            self.drafter.prefill(rids, [None] * bs, hidden[:, None], result.next_token_ids)
            result.logits_output.hidden_states = None
        accept_tokens = torch.zeros(bs, self.num_nodes, dtype=torch.int32, device=self.device)
        if bs:
            accept_tokens[:, 0] = result.next_token_ids
        accept_lens = torch.ones(bs, dtype=torch.int32, device=self.device)
        new_seq_lens = batch.seq_lens.clone()
        if on_publish is not None:
            on_publish(new_seq_lens)
        return self._result(result, result.next_token_ids, accept_tokens.flatten(), accept_lens, new_seq_lens)

    def _decode_step(self, batch, on_publish, pp_proxy_tensors):
        if batch.has_grammar:
            raise NotImplementedError("MEDUSA does not support structured output (grammar) requests yet")
        option = None if self.adaptive is None else self.adaptive.choose(len(batch.reqs))
        tree, layout = self._draft(batch, option)
        self._prepare_verify(batch, tree, layout)
        started = time.perf_counter()
        result = self.target_worker.forward_batch_generation(
            batch, pp_proxy_tensors=pp_proxy_tensors, is_verify=True, capture_hidden_mode=CaptureHiddenMode.FULL)
        if self.adaptive is not None:
            self.adaptive.verify_timed(tree.candidates.numel(), self._elapsed(started))
        logits_output = result.logits_output
        verdict = self._accept(batch, tree, logits_output.next_token_logits)
        if option is not None:
            self.adaptive.accepted(option, verdict.num_accepted)
        accept_index, predict, accept_tokens = self._sglang_outputs(tree, verdict)
        accept_lens = (verdict.num_accepted + 1).to(torch.int32)
        move_accept_tokens_to_target_kvcache(batch, accept_index, verdict.num_accepted.to(torch.int32),
                                             self.token_to_kv_pool_allocator)
        if batch.return_logprob:
            from sglang.srt.layers.logprob_processor import compute_spec_logprobs

            compute_spec_logprobs(batch, logits_output, predict, accept_index=accept_index)
        self._commit(batch, tree, verdict, logits_output.hidden_states)
        logits_output.hidden_states = None
        new_seq_lens = batch.seq_lens + accept_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        batch.forward_mode = ForwardMode.DECODE
        accept_tokens = self._full_width(accept_tokens)
        return self._result(result, accept_tokens.flatten(), accept_tokens.flatten(), accept_lens, new_seq_lens)

    def _elapsed(self, started: float) -> float:
        """Seconds since `started`, after the device has finished its queued work."""
        if str(self.device).startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - started

    def _full_width(self, accept_tokens: torch.Tensor) -> torch.Tensor:
        """[B, n] -> [B, num_nodes]: SGLang reads accepted tokens with the full tree's stride."""
        bs, n = accept_tokens.shape
        if n == self.num_nodes:
            return accept_tokens
        padded = accept_tokens.new_zeros(bs, self.num_nodes)
        padded[:, :n] = accept_tokens
        return padded

    def _result(self, target_result, next_token_ids, accept_tokens, accept_lens, new_seq_lens):
        next_draft_input = NgramVerifyInput(draft_token_num=self.num_nodes, new_seq_lens=new_seq_lens,
                                            accept_tokens=accept_tokens, accept_lens=accept_lens)
        return GenerationBatchResult(
            logits_output=target_result.logits_output, next_token_ids=next_token_ids,
            can_run_cuda_graph=target_result.can_run_cuda_graph, accept_lens=accept_lens,
            new_seq_lens=new_seq_lens, next_draft_input=next_draft_input,
            speculative_num_draft_tokens=self.num_nodes)

    # ------------------------------------------------------------------ the four phases

    def _draft(self, batch, option=None) -> tuple[TreeBatch, dict]:
        """(candidates [B, N] from the heads, the tree's layout); the root is the request's
        last committed token. Adaptive steps draft `option`'s tree, or (None) the root
        alone without running the heads."""
        rids = [req.rid for req in batch.reqs]
        roots = torch.tensor([req.output_ids[-1] for req in batch.reqs], dtype=torch.long)
        if self.adaptive is not None and option is None:
            bs = len(rids)
            return TreeBatch(roots[:, None].to(self.device), torch.full((bs, 1), -1, device=self.device),
                             torch.ones(bs, dtype=torch.long)), self._root_only
        config, layout = (self.settings.tree, self._layout) if option is None else self._budgets[option]
        started = time.perf_counter()
        tree = self.drafter.draft(rids, config)
        if option is not None:
            self.adaptive.draft_timed(len(rids), option, self._elapsed(started))
        tree.candidates[:, 0] = roots.to(tree.candidates.device)
        return TreeBatch(tree.candidates.to(self.device), tree.parents.to(self.device), tree.num_nodes), layout

    def _prepare_verify(self, batch, tree: TreeBatch, layout: dict) -> None:
        """Turn the decode batch into a TARGET_VERIFY batch over the B*N tree nodes."""
        bs, n = tree.candidates.shape
        seq_lens = batch.seq_lens
        positions = (seq_lens[:, None].long() + layout["depth"][None, :]).flatten()  # [B*N]
        retrieve_index = torch.arange(bs * n, device=self.device).view(bs, n)
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = tree.candidates.flatten()
        batch.out_cache_loc = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices, req_to_token=batch.req_to_token_pool.req_to_token,
            start_offset=seq_lens, end_offset=seq_lens + n, batch_size=bs, draft_token_num=n,
            device=self.device)
        batch.spec_info = NgramVerifyInput(
            draft_token=batch.input_ids, custom_mask=layout["mask"].flatten().repeat(bs),
            positions=positions, retrieve_index=retrieve_index,
            retrieve_next_token=layout["next_token"].expand(bs, n).contiguous(),
            retrieve_next_sibling=layout["next_sibling"].expand(bs, n).contiguous(),
            draft_token_num=n)

    def _accept(self, batch, tree: TreeBatch, logits: torch.Tensor) -> sampling.VerifyResult:
        """specplug.common.sampling.verify on the target's logits [B*N, V]."""
        bs, n = tree.candidates.shape
        info = batch.sampling_info
        logits = _apply_penalties(logits, info, n)
        parents, num_nodes = _root_only(tree.parents, _path_dependent(batch))
        if info.is_all_greedy:
            verdict = sampling.verify(tree.candidates, parents, logits.view(bs, n, -1), method="greedy",
                                      num_nodes=num_nodes)
        else:
            min_p = info.min_ps.view(-1).repeat_interleave(n) if info.need_min_p_sampling else 0.0
            p = sampling.process_logits(
                logits, temperature=info.temperatures.view(-1).repeat_interleave(n),
                top_k=info.top_ks.view(-1).repeat_interleave(n), top_p=info.top_ps.view(-1).repeat_interleave(n),
                min_p=min_p, order="sglang")  # SGLang's own filters, in its order
            verdict = sampling.verify(
                tree.candidates, parents, p.view(bs, n, -1), method=self.settings.method, num_nodes=num_nodes,
                generators=[self.generator] * bs, typical_epsilon=self.settings.typical_epsilon,
                typical_delta=self.settings.typical_delta)
        self.stats.update(verdict.num_accepted, torch.full((bs,), n - 1))
        if self.stats.num_steps % 1000 < bs:
            logger.debug("MEDUSA acceptance so far: %s", self.stats.as_dict())
        return verdict

    def _sglang_outputs(self, tree: TreeBatch, verdict: sampling.VerifyResult):
        """(accept_index Int [B, N] flat node rows -1 padded, predict Int [B*N] the token
        emitted after each accepted node, accept_tokens Int [B, N] the emitted tokens)."""
        bs, n = tree.candidates.shape
        path = verdict.accepted_nodes.to(self.device)  # [B, D+1], -1 padded
        width = path.shape[1]
        on_path = path >= 0
        rows = torch.arange(bs, device=self.device)[:, None] * n
        accept_index = torch.full((bs, n), -1, dtype=torch.int32, device=self.device)
        accept_index[:, :width] = torch.where(on_path, rows + path, -1).to(torch.int32)
        # token after path[j]: the token AT path[j + 1]; after the last accepted, the bonus
        emitted = verdict.output_tokens(tree.candidates.to(verdict.accepted_nodes.device))  # [B, D+1], -1 padded
        emitted = torch.where(on_path, emitted.to(self.device), 0)
        accept_tokens = torch.zeros(bs, n, dtype=torch.int32, device=self.device)
        accept_tokens[:, :width] = emitted.to(torch.int32)
        predict = torch.zeros(bs * n, dtype=torch.int32, device=self.device)
        kept = accept_index >= 0
        predict[accept_index[kept].long()] = accept_tokens[kept]
        return accept_index, predict, accept_tokens

    def _commit(self, batch, tree: TreeBatch, verdict: sampling.VerifyResult, hidden: torch.Tensor) -> None:
        """Keep the hidden state of each request's last accepted node ([B*N, H] -> [B, H])."""
        bs, n = tree.candidates.shape
        last_node = verdict.accepted_nodes.gather(1, verdict.num_accepted.long()[:, None])[:, 0]
        rows = torch.arange(bs, device=hidden.device) * n + last_node.to(hidden.device)
        accepted_tokens = [tree.candidates[b, verdict.accepted_nodes[b, 1:int(verdict.num_accepted[b]) + 1]]
                           for b in range(bs)]
        self.drafter.commit([req.rid for req in batch.reqs], accepted_tokens, hidden[rows][:, None],
                            verdict.bonus_token)


def budget_configs(settings: MedusaSettings) -> list[TreeConfig]:
    """The trees adaptive speculation chooses among (each as the TreeConfig the drafter
    builds it from): the core's family for the configured tree
    (specplug.common.adaptive.tree_family); explicit choices offer only themselves."""
    return [settings.tree] if settings.choices is not None else tree_family(settings.tree)


def _path_dependent(batch) -> torch.Tensor:
    """Bool [B]: requests with presence / frequency / repetition penalties. SGLang keeps
    them as one accumulated row per request (committed tokens only), which is right for
    the root's row and wrong after drafted tokens, so these verify their root alone."""
    return torch.tensor([
        p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0
        for p in (req.sampling_params for req in batch.reqs)
    ], dtype=torch.bool)


def _root_only(parents: torch.Tensor, rows: torch.Tensor):
    """parents Long [B, N] with the `rows` requests cut to their root; (parents, num_nodes
    Long [B] or None when nobody is cut). The target still scored every node; the cut
    requests emit one token, sampled from their root's row."""
    if not bool(rows.any()):
        return parents, None
    rows = rows.to(parents.device)
    cut = rows[:, None] & (torch.arange(parents.shape[1], device=parents.device) > 0)
    num_nodes = torch.where(rows, 1, parents.shape[1]).cpu()
    return torch.where(cut, -1, parents), num_nodes


def _apply_penalties(logits: torch.Tensor, info, n: int) -> torch.Tensor:
    """SGLang's per-request penalties and logit bias, repeated over each request's N nodes."""
    if info.acc_additive_penalties is not None:
        logits = logits + info.acc_additive_penalties.repeat_interleave(n, dim=0)
    if info.acc_scaling_penalties is not None:
        from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

        logits = logits.clone()
        apply_scaling_penalties(logits, info.acc_scaling_penalties.repeat_interleave(n, dim=0))
    if info.logit_bias is not None:
        logits = logits + info.logit_bias.repeat_interleave(n, dim=0)
    return logits
