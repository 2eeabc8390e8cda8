"""SPECPLUG_EAGLE3: EAGLE-3 and EAGLE-1 heads with EAGLE-2 dynamic trees in SGLang 0.5.23
(whose own EAGLE and EAGLE-3 do not start on a CPU).

The step is tree_worker.TreeVerifyWorker's; drafting is the core's, the same code the
vLLM adapter and the reference loop run: specplug.common.drafting.eagle.EagleDrafting
(the head's KV per request, catch-up over committed rows, roll-back, trees) through
drafting.runner.TorchHeadRunner over specplug's own Eagle3Head / Eagle1Head module. This
worker only translates SGLang's batches into `Committed` rows:

- prefill (each chunk): the target's states of the extend tokens paired with the token
  after each position;
- verify: the states of the accepted path's nodes, paired with the emitted tokens.

The states are what SGLang captures in CaptureHiddenMode.FULL: for an EAGLE-3 head the
aux layers' inputs (`capture_aux_states`), for an EAGLE-1 head the target's final hidden
state (after its norm, SGLang's default capture), scored by the target's own lm_head.

Sampled drafts (the head's "draft_temperature" or SPECPLUG_DRAFT_TEMPERATURE): in a batch
with a sampled request, each request's tree is `budget // depth` chains drawn from
q = softmax(draft log-probs / T) (SpecInfer; specplug.common.drafting.sampled), carrying
q per node, and verified with it (method "rejection"); all-greedy batches keep top-k trees.

Hybrid drafting, as in vLLM: when the head's section (or SPECPLUG_RETRIEVAL /
SPECPLUG_DRAFTER) names a token drafter, its trees are merged with the head's under the
same node budget (specplug.common.merge.merge_trees).

A request whose head state does not match SGLang's (its root token or position differs,
e.g. right after a retraction) verifies its root alone that step; its drafts resume after
the next catch-up. A prompt prefix SGLang's radix cache already holds is not recomputed,
so the head's context for that request starts after it (drafts stay verified: this costs
acceptance only).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from specplug.common.drafting.eagle import Committed, EagleDrafting, Root
from specplug.common.drafting import int8
from specplug.common.drafting.runner import TorchHeadRunner
from specplug.common.drafting.sampled import SampledDrafts, sampled_tree
from specplug.common.tree import DraftTree, TreeBatch, TreeConfig, stack_trees
from specplug.sglang_medusa import batch_view as view
from specplug.sglang_medusa.settings import Eagle3Settings, eagle3_settings_from_server_args
from specplug.sglang_medusa.token_worker import synced_drafter
from specplug.sglang_medusa.tree_worker import TreeVerifyWorker, batch_layout

logger = logging.getLogger(__name__)


def capture_aux_states(model, layer_ids) -> None:
    """Make SGLang's Llama-family `model` return the inputs of layers `layer_ids`
    (Hugging Face's hidden_states[i], specplug's aux convention) as its captured hidden
    states, concatenated. The one place this adapter touches SGLang's capture fields;
    SGLang's own set_eagle3_layers_to_capture shifts ids by one (EAGLE's convention)."""
    if not hasattr(model, "capture_aux_hidden_states") or not hasattr(model.model, "layers_to_capture"):
        raise ValueError(f"{type(model).__name__} cannot capture aux hidden states in SGLang 0.5.23: "
                         "SPECPLUG_EAGLE3 needs a Llama-family target")
    ids = [int(i) for i in layer_ids]
    if ids != sorted(set(ids)):  # SGLang captures in layer order, once per layer
        raise ValueError(f"SPECPLUG_EAGLE3 needs the head's aux layer ids ascending and distinct, got {ids}: "
                         "fix eagle_aux_hidden_state_layer_ids in the head's config.json (and its fc's column order)")
    model.capture_aux_hidden_states = True
    model.model.layers_to_capture = ids


class Eagle3Worker(TreeVerifyWorker):
    """EAGLE-3 trees over the target's aux hidden states; SGLang builds it with the
    scheduler's worker arguments (see TreeVerifyWorker)."""

    prefill_capture = CaptureHiddenMode.FULL
    verify_capture = CaptureHiddenMode.FULL

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        cfg = resolving_view(server_args)
        super().__init__(server_args, target_worker, int(cfg.speculative_num_draft_tokens))
        self.settings: Eagle3Settings = eagle3_settings_from_server_args(cfg)
        head = self._load_head()
        self.drafting = EagleDrafting(TorchHeadRunner(head))
        self.roots: dict[str, Root] = {}  # each request's last catch-up
        # requests SGLang never reported finished (e.g. done at prefill, aborted) are dropped beyond this
        self.max_live = 2 * int(cfg.max_running_requests or 48)
        self.sampled = SampledDrafts(self.settings.draft_temperature)
        self.sampled_tree = sampled_tree(self.settings.tree)
        if self.settings.drafter is not None:
            self.token_drafts = synced_drafter(self.settings.drafter, cfg, self.model_runner)
        feature = "the target's final hidden state"
        if head.KIND == "EAGLE-3":
            layers = head.config.resolved_aux_layer_ids(view.target_config(self.model_runner).num_hidden_layers)
            capture_aux_states(view.target_model(self.model_runner), layers)
            feature = f"aux layers {list(layers)}"
        logger.info("SPECPLUG_EAGLE3 worker: %s head %s, %s, dynamic trees %s (up to %d nodes)%s, "
                    "lossless verification", head.KIND, self.settings.head_path, feature, self.settings.tree,
                    self.num_nodes, "" if self.token_drafts is None else
                    f", merged with drafter {self.settings.drafter.name!r}")

    def _load_head(self):
        from specplug.common.formats import load_head_module

        head = load_head_module(self.settings.head_path, target_config=self.server_args.model_path,
                                device=self.device, dtype=view.target_dtype(self.model_runner)).eval()
        head.requires_grad_(False)  # serving: no autograd graph behind the states the head keeps
        if getattr(head, "KIND", None) not in ("EAGLE-3", "EAGLE-1"):
            raise ValueError(f"SPECPLUG_EAGLE3: --speculative-draft-model-path {self.settings.head_path} holds a "
                             f"{type(head).__name__}, not an EAGLE-3 or EAGLE-1 head: use MEDUSA for Medusa heads")
        vocab = head.config.vocab_size
        if not hasattr(head, "embed_tokens"):  # share the target's embedding (no copy)
            weight = view.embedding_weight(self.model_runner)[:vocab]
            head.set_target_embedding(torch.nn.Embedding.from_pretrained(weight, freeze=True))
        if head.KIND == "EAGLE-1":  # scores with the target's lm_head (no copy)
            lm_head = torch.nn.Linear(head.config.hidden_size, vocab, bias=False, device="meta")
            lm_head.weight = torch.nn.Parameter(view.lm_head_weight(self.model_runner)[:vocab], requires_grad=False)
            head.set_target_lm_head(lm_head)
        if self.settings.head_weights != "float":
            self._use_quantized_weights(head, self.settings.head_weights)
        return head

    def _use_quantized_weights(self, head, fmt: str) -> None:
        """The section's "head_weights": an EAGLE-3 head's linears after fc with int8 or int4 weights."""
        reason = f"an EAGLE-1 head has no {fmt} path" if head.KIND != "EAGLE-3" else int8.swap_linears(
            head, int8.EAGLE3_MODULES, fmt)
        if reason is None:
            logger.info("SPECPLUG_EAGLE3: head %s runs its linears with %s weights (\"head_weights\")",
                        self.settings.head_path, fmt)
        else:
            logger.warning("SPECPLUG_EAGLE3: \"head_weights\" is %s but the head runs as loaded: %s", fmt, reason)

    def clear_cache_pool(self):
        self.drafting.free(list(self.drafting.caches))
        self.roots.clear()
        self._free_token_drafts()

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self.drafting.free([rid])
        self.roots.pop(rid, None)
        self._free_token_drafts(rid)

    # ------------------------------------------------------------------ committed rows

    def _prefilled(self, batch, result) -> None:
        """Each request's extend tokens at positions prefix .. prefix + n - 1, paired with
        the token after each (the prompt's next one; after the prompt, the sampled one)."""
        aux = result.logits_output.hidden_states  # [sum n, 3 * H_target]
        if aux is None:
            return
        hidden = self.drafting.runner.combine(aux)  # [sum n, H]
        sampled = result.next_token_ids.tolist()
        requests, offset = [], 0
        for i, (req, (start, n)) in enumerate(zip(view.requests(batch), view.extend_spans(batch))):
            known = list(view.prompt_ids(req)) + list(view.output_ids(req))
            after = known[start + 1:start + n] + [known[start + n] if start + n < len(known) else sampled[i]]
            requests.append(Committed(view.request_id(req), torch.tensor(after), torch.arange(start, start + n),
                                      hidden[offset:offset + n]))
            offset += n
        self._catch_up(requests)

    def _commit(self, batch, tree: TreeBatch, verdict, hidden: torch.Tensor) -> None:
        """The accepted path's m nodes at positions seq_len .. seq_len + m - 1, each paired with
        the token emitted after it (the next accepted node's, then the bonus)."""
        if hidden is None:  # nothing captured: the head keeps its state and these requests verify roots alone
            return
        bs, n = tree.candidates.shape
        emitted = verdict.output_tokens(tree.candidates.to(verdict.accepted_nodes.device))  # [B, D+1]
        accepted = verdict.num_accepted.tolist()
        seq_lens = view.seq_lens(batch).tolist()
        rows = torch.cat([b * n + verdict.accepted_nodes[b, :accepted[b] + 1] for b in range(bs)])
        combined = self.drafting.runner.combine(hidden[rows.to(hidden.device)])  # [sum m + 1, H]
        requests, offset = [], 0
        for b, rid in enumerate(view.request_ids(batch)):
            m = accepted[b] + 1
            requests.append(Committed(rid, emitted[b, :m].cpu(), torch.arange(seq_lens[b], seq_lens[b] + m),
                                      combined[offset:offset + m]))
            offset += m
        self._catch_up(requests)
        self._forget_stale(set(view.request_ids(batch)))  # a decode batch holds every running request

    def _catch_up(self, requests) -> None:
        with torch.inference_mode():
            self.roots.update(zip((r.req_id for r in requests), self.drafting.catch_up(requests)))

    def _forget_stale(self, current: set) -> None:
        """Bound the head state: SGLang reports only requests that finish in a decode
        step, so one that ends at prefill (one-token answers, an early stop, an abort) is
        never reported. Past max_live, requests not in this batch are freed (one that
        comes back verifies its root alone until its next catch-up)."""
        if len(self.roots) <= self.max_live:
            return
        stale = [rid for rid in self.roots if rid not in current]
        self.drafting.free(stale)
        for rid in stale:
            self.roots.pop(rid)

    # ------------------------------------------------------------------ drafting

    def _draft(self, batch) -> tuple[TreeBatch, dict]:
        """One tree per request from its root: the head's, merged with the token
        drafter's when hybrid; [B, n] with n <= num_nodes."""
        if self.sampled.on and not view.sampling(batch).all_greedy:
            return self._sampled_trees(batch)
        trees = self._with_token_drafts(batch, self._head_trees(batch), self.settings.tree.budget,
                                        self.settings.tree.depth)
        return trees, batch_layout(trees)

    def _sampled_trees(self, batch) -> tuple[TreeBatch, dict]:
        """Chains drawn from q with q per node, when every request's head state is in
        step; else top-k trees (verified with the target-only rule: still lossless)."""
        found = self._roots(batch)
        if not all(found.usable):
            trees = self._head_trees(batch, found)
            return trees, batch_layout(trees)
        with torch.inference_mode():
            trees = self.drafting.trees(found.roots, self.sampled_tree, self.sampled, view.request_ids(batch))
        return trees, batch_layout(trees)

    def _roots(self, batch) -> "_Roots":
        """Each request's Root (or None), its root token in SGLang, and whether the two
        are in step (same root token, at position seq_len - 1)."""
        last = view.last_tokens(batch)
        roots = [self.roots.get(rid) for rid in view.request_ids(batch)]
        seq_lens = view.seq_lens(batch).tolist()
        usable = [r is not None and r.token == t and r.position == s - 1 for r, t, s in zip(roots, last, seq_lens)]
        return _Roots(roots, last, usable)

    def _head_trees(self, batch, found: "_Roots | None" = None) -> TreeBatch:
        """EAGLE-2 trees; a request whose head state is out of step with SGLang's (see
        the module docstring) gets its root alone."""
        roots, last, usable = found or self._roots(batch)
        if not any(usable):
            return stack_trees([_root_only(t) for t in last])
        with torch.inference_mode():
            drafted = self.drafting.trees([r for r, ok in zip(roots, usable) if ok], self.settings.tree)
        if not all(usable):
            drafted_rows = iter(drafted.unbind())
            drafted = stack_trees([next(drafted_rows) if ok else _root_only(t) for ok, t in zip(usable, last)])
        return drafted


class _Roots(NamedTuple):
    roots: list  # Root or None per request
    last: list[int]  # each request's root token in SGLang (its last output id)
    usable: list[bool]  # the Root is in step with SGLang's request


def _root_only(token: int) -> DraftTree:
    return DraftTree(torch.tensor([int(token)]), torch.tensor([-1]), torch.zeros(1))  # score 0 = log 1: mergeable
