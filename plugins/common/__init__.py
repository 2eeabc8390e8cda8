"""The engine-free core: draft trees, verification samplers, drafter heads,
checkpoint formats, cost model and metrics. Never imports vllm or sglang."""
