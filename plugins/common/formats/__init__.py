"""Draft-head checkpoint formats: detect, load (validated), save and convert.

Five on-disk formats, three methods. Each is mapped onto ONE canonical form per method:

  method   format         layout (config.json + weights)                      canonical?
  eagle3   "eagle3"       EAGLE / SpecForge `LlamaForCausalLMEagle3`: midlayer.*,  yes
                          fc.weight, norm.weight, lm_head.weight, d2t, t2d,
                          optional embed_tokens.weight (model.safetensors or
                          pytorch_model.bin)
  eagle3   "speculators"  vllm speculators: speculators_model_type "eagle3",
                          nested transformer_layer_config / speculators_config,
                          layers.0.* instead of midlayer.*
  eagle1   "eagle1"       the EAGLE repo's EAGLE-1 heads: Llama config.json, fc.weight  yes
                          [H, 2H], layers.0.* without input_layernorm (eagle1.py)
  medusa   "medusa"       FasterDecoding: medusa_lm_head.safetensors (or .pt),     yes
                          medusa_num_heads / medusa_num_layers,
                          {head}.{layer}.linear.weight|bias, {head}.{L}.weight
  medusa   "vllm-medusa"  vLLM's MedusaModel: blocks.{i}.layers.{j}.weight|bias,
                          lm_heads.{i}.weight, num_heads, num_hidden_layers,
                          truncated_vocab_size, optional token_map

`LoadedHead.config` is the canonical config.json dict and `LoadedHead.state_dict` holds
the canonical tensor names, so the head modules (specplug.common.heads) never see any
other format. What the canonical form cannot carry (speculators' extra config, vLLM
Medusa's token_map ...) rides along in `LoadedHead.extra`; writing to the source format
puts it back, writing to another format names it in `SaveReport.dropped` (and a WARNING).

Invariants: tensors are never cast, so a conversion between formats that carry the same
tensors is bit-exact; weights are read only with safetensors or
`torch.load(weights_only=True)`; every malformed checkpoint raises `CheckpointError`
(a ValueError) naming the field, what was expected, what was given, the file and the fix,
before any weight is used.

Modules: ``base`` (the formats' names, CheckpointError, LoadedHead, SaveReport),
``files`` (reading a folder; ``read_header``: a safetensors file's tensors as shape-only
meta tensors, for dry runs), ``parse`` (detection; source format -> canonical),
``checks`` (validation, against the target too), ``write`` (load, canonical -> format,
save, convert, head modules); EAGLE-1 specifics in specplug.common.formats.eagle1.
"""

from .base import (
    CANONICAL_FORMAT, DEFAULT_SPECULATIVE_TOKENS, EAGLE3_ARCHITECTURE, FORMATS, MEDUSA_HEAD_FILE, METHOD_OF_FORMAT,
    NUM_AUX_HIDDEN_STATES, SAFETENSORS_METADATA, CheckpointError, LoadedHead, SaveReport,
)
from .checks import TargetDims, target_dims, validate
from .files import read_header
from .parse import detect_format
from .write import convert, load_head, load_head_module, save_head

__all__ = [
    "CANONICAL_FORMAT", "DEFAULT_SPECULATIVE_TOKENS", "EAGLE3_ARCHITECTURE", "FORMATS", "MEDUSA_HEAD_FILE",
    "METHOD_OF_FORMAT", "NUM_AUX_HIDDEN_STATES", "SAFETENSORS_METADATA", "CheckpointError", "LoadedHead",
    "SaveReport", "TargetDims", "target_dims", "validate", "detect_format", "convert", "load_head",
    "load_head_module", "save_head", "read_header",
]
