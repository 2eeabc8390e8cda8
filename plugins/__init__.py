"""specplug: lossless speculative decoding plugins for vLLM and SGLang.

`specplug.common` is the engine-free core; `specplug.vllm_eagle3` and
`specplug.sglang_medusa` are the engine adapters, found through entry points.
"""

__version__ = "0.1.0"
