"""Drafter heads as torch modules (EAGLE-1, EAGLE-3, Medusa), in their canonical checkpoint names."""

from .eagle1 import Eagle1Config, Eagle1Head
from .eagle3 import Eagle3Config, Eagle3Head, Eagle3Output, default_aux_layer_ids
from .medusa import MedusaConfig, MedusaHeads

__all__ = ["Eagle1Config", "Eagle1Head", "Eagle3Config", "Eagle3Head", "Eagle3Output", "MedusaConfig",
           "MedusaHeads", "default_aux_layer_ids"]
