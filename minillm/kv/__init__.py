"""KV cache managers: who owns which slots of the KV pool (chapters 04–07)."""
