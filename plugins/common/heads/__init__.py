"""Drafter heads as torch modules (EAGLE-3, Medusa), in their canonical checkpoint names."""

from .eagle3 import Eagle3Config, Eagle3Head, Eagle3Output, default_aux_layer_ids
from .medusa import MedusaConfig, MedusaHeads

__all__ = ["Eagle3Config", "Eagle3Head", "Eagle3Output", "MedusaConfig", "MedusaHeads",
           "default_aux_layer_ids"]
