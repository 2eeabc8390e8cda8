"""SGLang adapter: Medusa heads with tree verification (entry point `sglang.srt.plugins`)."""


def register() -> None:
    """Entry point run by SGLang's load_plugins() in every process; imports SGLang lazily."""
