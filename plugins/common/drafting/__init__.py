"""Drafting for serving engines, engine-free: a model-backed drafter keeps its per-request
state here and runs its network through one small seam (`runner.HeadRunner`), which
specplug implements once with its own torch modules (`runner.TorchHeadRunner`: reference
loop, training evaluation) and each engine adapter once with the modules the engine
loaded (vLLM: `specplug.vllm_eagle3.dense_head.DenseEagle3Head` and `DenseEagle1Head`).

- `runner`: the seam (`HeadRunner`, `Segment`, `DraftStep`) and `TorchHeadRunner`.
- `eagle`: EAGLE-1/3 drafting state for live requests (`EagleDrafting`): head KV per
  request, catch-up over committed rows, roll-back, deferred rows, dynamic or sampled trees.
- `sampled`: `SampledDrafts`, trees drawn from q for every model-backed drafter.
- `int8`: weight-only int8 for a head's linears on a CPU, and what both formats share
  (the section's "head_weights", the EAGLE-3 roles, the check against the float layer,
  the swap for specplug's own head).
- `int4`: weight-only int4 in groups of 64 inputs (half of int8's bytes).
"""
