"""The specplug Medusa proposer for vLLM's V1 model runner (method "medusa"), in place of
vLLM's `MedusaProposer`; heads without a `specplug` section run vLLM's own Medusa path.

Drafting is the core's `MedusaDrafter` on the heads vLLM loaded (`LoadedMedusaHeads`),
each step's drafts or none the core's StepPolicy (payoff control); every request is
verified by specplug's sampler. Stage "chain" drafts the heads' top-1 chain
(num_speculative_tokens <= heads); stage "tree" hands vLLM every node of the Medusa tree
(num_speculative_tokens = its non-root nodes), verified in one target pass by
tree_verify.TreeVerifier, with the top-1 chain for requests that need one. In stage
"tree" vLLM's sample_hidden_states are put in accepted-path order first
(TreeVerifier.committed_samples); vLLM builds MedusaProposer without its runner, so
`attaching_init` (patch "GPUModelRunner.__init__") hands it over.
"""

from __future__ import annotations

import functools
import logging

import torch
from vllm.v1.spec_decode.medusa import MedusaProposer

from specplug.common.path_choice import pad_chains
from specplug.common.policy.step_policy import StepPolicy
from specplug.common.tree import TreeConfig
from specplug.common.heads.medusa import medusa_head_count
from specplug.vllm_eagle3.medusa_settings import medusa_drafter, medusa_settings
from specplug.vllm_eagle3.ranks import tp_ranks
from specplug.vllm_eagle3.runner_state import RunnerState
from specplug.vllm_eagle3.tree_platform import check_platform
from specplug.vllm_eagle3.sampler import install_verification
from specplug.common.head_section import HeadSettings
from specplug.vllm_eagle3.settings import check_head_matches_target, check_num_speculative_tokens, specplug_section

logger = logging.getLogger(__name__)


class SpecplugMedusaProposer(MedusaProposer):
    """vLLM's MedusaProposer, plus specplug's trees and sampler for specplug heads."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.state: RunnerState | None = None
        self.tree_verifier = None
        self.policy: StepPolicy | None = None  # each step: the heads' drafts or none
        draft = self.spec_config.draft_model_config
        section = specplug_section(draft.hf_config, "medusa")
        self.specplug: HeadSettings | None = None
        if section is None:
            return
        check_head_matches_target(draft.model, vllm_config.model_config.hf_text_config, "medusa")
        self.num_heads = medusa_head_count(draft.model)
        self.specplug = medusa_settings(section, self.num_heads)
        self.drafting = medusa_drafter(self.specplug, self.num_heads)
        self.tree = self._tree_config(self.num_speculative_tokens)
        check_platform(vllm_config, self.specplug.stage)
        logger.info("specplug Medusa proposer active for heads %s: %d heads, stage %s, %d draft tokens",
                    draft.model, self.num_heads, self.specplug.stage, self.num_speculative_tokens)
        self.policy = StepPolicy(self.num_speculative_tokens, adaptive=False, payoff=self.specplug.payoff,
                                 all_or_none=True, ranks=tp_ranks(), drafts="heads' drafts")

    def _tree_config(self, k: int) -> TreeConfig:
        """The TreeConfig drafted each step; ValueError when vLLM's K cannot hold it."""
        if self.specplug.stage == "chain":
            if k > self.num_heads:
                raise ValueError(f"specplug Medusa stage \"chain\" drafts one token per head: num_speculative_tokens "
                                 f"{k} exceeds the {self.num_heads} heads; set \"num_speculative_tokens\": "
                                 f"{self.num_heads} or fewer")
            return TreeConfig(depth=k, topk=1, budget=k)
        check_num_speculative_tokens(self.specplug, k, self.specplug.medusa_nodes - 1)
        return self.specplug.tree

    def attach(self, runner) -> None:
        """Called once the runner is built: specplug's sampler in place of its rejection
        sampler, and in stage "tree" the tree verifier's hooks."""
        if self.specplug is None:
            return
        self.state = RunnerState(runner)
        self.tree_verifier = install_verification(self.state, self.specplug.stage == "tree", on_verify=self._verified)
        if self.tree_verifier is not None:
            self.state.wrap_sample_hidden(self.tree_verifier.committed_samples)

    def _verified(self, req_ids, num_draft_tokens, num_accepted) -> None:
        """The sampler's verify result, [B] drafts scheduled and accepted per batch row."""
        self.policy.verified(num_draft_tokens, num_accepted)

    def load_model(self, target_model) -> None:
        if self.specplug is not None:  # vLLM set num_heads to num_speculative_tokens: load what the checkpoint holds
            self.spec_config.draft_model_config.hf_config.num_heads = self.num_heads
        super().load_model(target_model)
        if self.specplug is not None:
            self.drafting.heads.model = self.model

    def propose(self, num_speculative_tokens, target_hidden_states, sampling_metadata, slot_mappings=None):
        if self.specplug is None:
            return super().propose(num_speculative_tokens, target_hidden_states, sampling_metadata, slot_mappings)
        if self.state is None:
            raise RuntimeError("specplug Medusa proposer was not attached to vLLM's model runner: "
                               "this vLLM version is not supported")
        batch = target_hidden_states.shape[0]
        self.policy.begin(self.state.query_lens(batch))
        if self.policy.depth(batch) == 0:
            return torch.zeros(batch, 0, dtype=torch.long, device=target_hidden_states.device)
        with torch.inference_mode():
            roots = torch.zeros(batch, dtype=torch.long)  # vLLM's sampled tokens: the verifier never reads them
            logits = self.drafting.logits_from(target_hidden_states)  # [heads, B, V]
            trees = self.drafting.fill(logits, roots, self.tree)  # [B, K + 1]
            if self.tree_verifier is None:
                return trees.candidates[:, 1:]
            return self._tree_drafts(trees, self.state.request_ids(batch), logits, roots)

    def _tree_drafts(self, trees, req_ids, logits, roots) -> torch.Tensor:
        """Every tree node as a draft token, Long [B, K] (TreeVerifier.hand_over); requests
        that need a chain get the top-1 chain of the same logits [heads, B, V], padded to K."""
        top1 = TreeConfig(depth=self.num_heads, topk=1, budget=self.num_heads)
        return self.tree_verifier.hand_over(trees, req_ids, lambda rows: pad_chains(
            self.drafting.fill(logits[:, rows], roots[rows], top1), trees.candidates.shape[1] - 1))


def attaching_init(init):
    """GPUModelRunner.__init__ wrapped (patches.py): a SpecplugMedusaProposer drafter is
    attached to the runner that built it (vLLM constructs MedusaProposer(vllm_config,
    device) without it)."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, SpecplugMedusaProposer):
            drafter.attach(self)

    return __init__
