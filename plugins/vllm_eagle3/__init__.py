"""vLLM adapter: EAGLE-3 with dynamic draft trees (entry point `vllm.general_plugins`)."""


def register() -> None:
    """Entry point run by vLLM in every process; imports vLLM lazily."""
