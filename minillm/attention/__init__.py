"""Attention backends: how each sequence's queries meet its own keys in a shared KV pool."""
