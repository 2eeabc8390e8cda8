"""Drafter heads as torch modules (EAGLE-3, Medusa)."""
