"""Drafting for serving engines, engine-free: a model-backed drafter keeps its per-request
state here and runs its network through one small seam (`runner.HeadRunner`), which
specplug implements once with its own torch modules (`runner.TorchHeadRunner`: reference
loop, training evaluation) and each engine adapter once with the modules the engine
loaded (vLLM: `specplug.vllm_eagle3.dense_head.DenseEagle3Head` and `DenseEagle1Head`).

- `runner`: the seam (`HeadRunner`, `Segment`, `DraftStep`) and `TorchHeadRunner`.
- `eagle`: EAGLE-1/3 drafting state for live requests (`EagleDrafting`): head KV per
  request, catch-up over committed rows, roll-back, deferred rows, dynamic or sampled trees.
- `sampled`: `SampledDrafts`, trees drawn from q for every model-backed drafter.
- `session`: `DraftingSession`, each request's drafting decisions across steps (sampled
  drafts or top-k, hybrid merging with a token drafter, the step record the verifier reads).
- `medusa`: `MedusaDrafting`, Medusa heads' trees per step (static, adaptive, drawn, merged).

A head's int8 / int4 linears are specplug.common.quantization's.
"""
