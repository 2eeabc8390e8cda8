"""Speculation policy, engine-free: how much to speculate in each engine step.

- `cost`: the cost model (target step and draft costs, measured in the engine) and the
  expected tokens of a chain or tree, from which a step's best option follows.
- `adaptive`: the batch-aware controller both adapters run (option families, measured
  acceptance and costs, the choice per step).
"""
