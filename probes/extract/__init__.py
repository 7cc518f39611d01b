"""Attention extraction stage: frozen encoder -> word-level attention cache."""
