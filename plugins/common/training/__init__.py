"""Head training: `specplug train` and `specplug distill`, engine-free.

- `train`: the command, its config (`TrainConfig`), samples and batches, the target pass.
- `data`: prompt and conversation sets (ShareGPT, MT-bench, HumanEval, local files).
- `distill`: the target's own replies as training data (batched through vLLM when it is there).
- `states`: the cache of target states (aux layers + final hidden state, memory-mapped
  shards with a manifest), written once and read by every later epoch.
- `loop`: the resumable loop (checkpoints, same data order and LR schedule on `--resume`).
- `eagle3`, `medusa`: what each method trains (losses, unrolled steps, head export).
- `evaluate`: tau of a trained head in the reference loop.
"""
