"""Head training: `specplug train` and `specplug distill`, engine-free.

- `train`: one run of the command (checks, data, head, loop, output, final eval); `cli`: its
  command line; `config`: its settings (`TrainConfig`); `checks`: the up-front checks.
- `samples`: conversations -> samples -> batches; `regenerate`: `--regenerate`'s replies.
- `target`: the frozen target and its pass; `output`: the output folder and checkpoint reader.
- `data`: prompt and conversation sets (ShareGPT, MT-bench, HumanEval, local files).
- `distill`: the target's own replies as training data (batched through vLLM when it is there).
- `states`: the cache of target states (aux layers + final hidden state, memory-mapped
  shards with a manifest), written once and read by every later epoch.
- `loop`: the resumable loop (checkpoints, same data order and LR schedule on `--resume`).
- `eagle3`, `medusa`: what each method trains (losses, unrolled steps, head export).
- `evaluate`: tau of a trained head in the reference loop.
"""
