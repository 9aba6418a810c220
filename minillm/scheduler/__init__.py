"""Schedulers: who runs in the next step, and with how many tokens (chapters 02–09)."""
