"""Attention backends: how each sequence's queries meet its own keys in a shared KV pool.

    registry.py    name -> backend class, one line per backend ("torch", "numba", "numba_cpu")
    select.py      "auto" resolved (a fixed rule), a choice checked against the device and dtype
    metadata.py    StepLayout (the step's flat layout, from the worker) and AttentionMetadata (its varlen form)
    flat_pool.py   "torch": SDPA per length group of rows, gathering whole blocks (any device)
    cpu_paged.py   "numba_cpu": decode rows through the @njit CPU kernel, the rest as "torch"
    numba_paged.py "numba": chapter 10's numba.cuda kernels
    padded.py      static/dynamic batching's padded rectangle (not a paged backend)
"""
