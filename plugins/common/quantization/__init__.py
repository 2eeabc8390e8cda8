"""Weight-only quantization of a draft head's linear layers on a CPU.

- `platform`: what both formats need from the machine (a CPU, bf16 or fp32 activations)
  and their rounded-up bf16 scales;
- `int8`: one scale per output channel (torch's `_weight_int8pack_mm`);
- `int4`: groups of 64 input columns with a scale and zero point each
  (`_weight_int4pack_mm_for_cpu`);
- `head_linears`: which linears of an EAGLE-3 head are quantized, the check of a
  quantized copy against its layer, and `swap_linears`.

A head section's "head_weights" (float / int8 / int4) is specplug.common.head_section's.
Only drafts change: verification never sees the head, so output is unchanged.
"""
