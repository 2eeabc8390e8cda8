"""SPECPLUG_EAGLE3: EAGLE-3 and EAGLE-1 heads with EAGLE-2 dynamic trees in SGLang 0.5.23
(whose own EAGLE and EAGLE-3 do not start on a CPU).

The step is tree_worker.TreeVerifyWorker's; drafting is the core's, the same code the
vLLM adapter and the reference loop run: specplug.common.drafting.eagle.EagleDrafting
(the head's KV per request, catch-up over committed rows, roll-back, trees) through
drafting.runner.TorchHeadRunner over specplug's own Eagle3Head / Eagle1Head module. This
worker only translates SGLang's batches into `Committed` rows:

- prefill (each chunk): the target's states of the extend tokens paired with the token
  after each position;
- verify: the states of the accepted path's nodes, paired with the emitted tokens; after
  a step where payoff control drafted nothing they wait for the next step that drafts
  (HeldRoots.committed), so a step without drafts runs no head.

The states are what SGLang captures in CaptureHiddenMode.FULL: for an EAGLE-3 head the
aux layers' inputs (`capture_aux_states`), for an EAGLE-1 head the target's final hidden
state (after its norm, SGLang's default capture), scored by the target's own lm_head.

Which request drafts how is the core's DraftingSession's decision, the same as in vLLM:
with sampled drafts on (the head's "draft_temperature" or SPECPLUG_DRAFT_TEMPERATURE), a
request that samples without a seed gets `budget // depth` chains drawn from
q = softmax(draft log-probs / T) (SpecInfer), verified with q; greedy and seeded
requests get top-k trees, merged with the token drafter's under the same node budget
when the head's section (or SPECPLUG_RETRIEVAL / SPECPLUG_DRAFTER) names one.

A request whose head state does not match SGLang's (its root token or position differs,
e.g. right after a retraction) verifies its root alone that step; its drafts resume after
the next catch-up. A prompt prefix SGLang's radix cache already holds is not recomputed,
so the head's context for that request starts after it (drafts stay verified: this costs
acceptance only).
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from specplug.common.drafting.eagle import Committed, EagleDrafting, HeldRoots
from specplug.common.head_section import HeadSettings
from specplug.common.quantization import head_linears
from specplug.common.drafting.runner import TorchHeadRunner
from specplug.common.drafting.sampled import SampledDrafts, sampled_tree
from specplug.common.drafting.session import DraftingSession, in_batch_order
from specplug.common.tree import DraftTree, TreeBatch, stack_trees
from specplug.sglang_medusa import batch_view as view
from specplug.sglang_medusa.settings import eagle3_settings
from specplug.sglang_medusa.token_worker import synced_drafter
from specplug.common.sglang_trees import batch_layout
from specplug.sglang_medusa.tree_worker import TreeVerifyWorker

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
        self.head_path = str(cfg.speculative_draft_model_path)
        self.settings: HeadSettings = eagle3_settings(cfg)
        head = self._load_head()
        self.drafting = EagleDrafting(TorchHeadRunner(head))
        self.roots = HeldRoots(self.drafting, view.max_live(cfg))  # each request's last catch-up
        self.sampled_tree = sampled_tree(self.settings.tree)
        if self.settings.drafter is not None:
            self.token_drafts = synced_drafter(self.settings.drafter, cfg, self.model_runner)
        self.session = DraftingSession(
            self.drafting, token_drafter=None if self.token_drafts is None else self.token_drafts.drafter,
            sampled=SampledDrafts(self.settings.draft_temperature))
        self._start_payoff(self.settings.tree.depth, self.settings.payoff)
        feature = "the target's final hidden state"
        if head.KIND == "EAGLE-3":
            layers = head.config.resolved_aux_layer_ids(view.target_config(self.model_runner).num_hidden_layers)
            capture_aux_states(view.target_model(self.model_runner), layers)
            feature = f"aux layers {list(layers)}"
        logger.info("SPECPLUG_EAGLE3 worker: %s head %s, %s, dynamic trees %s (up to %d nodes)%s, "
                    "lossless verification", head.KIND, self.head_path, feature, self.settings.tree,
                    self.num_nodes, "" if self.token_drafts is None else
                    f", merged with drafter {self.settings.drafter.name!r}")

    def _load_head(self):
        from specplug.common.formats import load_head_module

        head = load_head_module(self.head_path, target_config=self.server_args.model_path,
                                device=self.device, dtype=view.target_dtype(self.model_runner)).eval()
        head.requires_grad_(False)  # serving: no autograd graph behind the states the head keeps
        if getattr(head, "KIND", None) not in ("EAGLE-3", "EAGLE-1"):
            raise ValueError(f"SPECPLUG_EAGLE3: --speculative-draft-model-path {self.head_path} holds a "
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
            fmt = self.settings.head_weights  # an EAGLE-3 head's linears after fc
            head_linears.use_head_weights(head.KIND, fmt, lambda: head_linears.swap_linears(
                head, head_linears.EAGLE3_MODULES, fmt), self.head_path, "SPECPLUG_EAGLE3", logger)
        return head

    def clear_cache_pool(self):
        self.roots.clear()
        self._free_token_drafts()

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self.roots.free([rid])
        self._free_token_drafts(rid)

    # ------------------------------------------------------------------ committed rows

    def _prefilled(self, batch, result) -> None:
        """Each request's extend tokens at positions prefix .. prefix + n - 1, paired with
        the token after each (the prompt's next one; after the prompt, the sampled one)."""
        aux = result.logits_output.hidden_states  # [sum n, 3 * H_target]
        if aux is None:
            return
        sampled = result.next_token_ids.tolist()
        requests, offset = [], 0
        for i, (req, (start, n)) in enumerate(zip(view.requests(batch), view.extend_spans(batch))):
            known = list(view.prompt_ids(req)) + list(view.output_ids(req))
            after = known[start + 1:start + n] + [known[start + n] if start + n < len(known) else sampled[i]]
            requests.append(Committed(view.request_id(req), torch.tensor(after), torch.arange(start, start + n),
                                      aux[offset:offset + n]))  # the head combines them at its catch-up
            offset += n
        self.roots.catch_up(requests)

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
        accepted_states = hidden[rows.to(hidden.device)]  # [sum m + 1, Hc]
        requests, offset = [], 0
        for b, rid in enumerate(view.request_ids(batch)):
            m = accepted[b] + 1
            requests.append(Committed(rid, emitted[b, :m].cpu(), torch.arange(seq_lens[b], seq_lens[b] + m),
                                      accepted_states[offset:offset + m]))
            offset += m
        self.roots.committed(requests, drafted=self.payoff is None or self.payoff.depth > 0)
        # SGLang reports only requests that finish in a decode step (not one that ends at
        # prefill, an early stop, an abort); a decode batch holds every running request
        self.roots.forget_stale(view.request_ids(batch))

    # ------------------------------------------------------------------ drafting

    def _draft(self, batch) -> tuple[TreeBatch, dict]:
        """One tree per request from its root, as the core's DraftingSession decides per
        request (drawn from q, or the head's top-k tree merged with the token drafter's
        when hybrid); [B, n] with n <= num_nodes. A request whose head state is out of
        step with SGLang's (see the module docstring) verifies its root alone."""
        self.session.begin_step()
        rids, last = view.request_ids(batch), view.last_tokens(batch)
        roots = self.roots.in_step(rids, last, view.seq_lens(batch).tolist())
        rows = [i for i, r in enumerate(roots) if r is not None]
        stale = [i for i, r in enumerate(roots) if r is None]
        parts = [(stale, stack_trees([_root_only(last[i]) for i in stale]))] if stale else []
        if rows:
            if self.token_drafts is not None:
                self.token_drafts.sync(batch)
            params = view.request_sampling(batch)
            with torch.inference_mode():
                parts.append((rows, self.session.trees(
                    [roots[i] for i in rows], [rids[i] for i in rows], [params[i] for i in rows],
                    self.settings.tree, self.sampled_tree, budget=self.settings.tree.budget)))
        trees = parts[0][1] if len(parts) == 1 else in_batch_order(parts, len(rids))
        return trees, batch_layout(trees)


def _root_only(token: int) -> DraftTree:
    return DraftTree(torch.tensor([int(token)]), torch.tensor([-1]), torch.zeros(1))  # score 0 = log 1: mergeable
