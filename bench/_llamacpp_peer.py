"""The llama.cpp side of bench/llamacpp.py, run by the python of llama-cpp-python's own venv.

It imports llama_cpp and numpy only (never minillm or torch). Two modes:

    python bench/_llamacpp_peer.py serve       JSON requests on stdin, one JSON answer a line
    python bench/_llamacpp_peer.py startup GGUF LAUNCHED_AT THREADS CHATS_JSON
                                               import + Llama(...) load + the first token of each chat

Generation goes through the low-level binding as llama.cpp's own `batched` example does: one
context, one KV cache (`kv_unified`), a `llama_batch` whose tokens carry their sequence id, llama.cpp's
greedy sampler per output row. The high-level `Llama` is used where its Python API is the feature:
tokenizing, and prompt-lookup decoding (`LlamaPromptLookupDecoding`) against its plain `generate`.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _protocol_stream():
    """Answers go to a private copy of stdout; fd 1 becomes stderr, so nothing llama.cpp prints can
    corrupt the protocol."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


class RawEngine:
    """One model, one context, one KV cache shared by up to `n_seq_max` sequences."""

    def __init__(self, path: str, n_ctx: int, n_seq_max: int, n_batch: int = 512) -> None:
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = L.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
        params.n_seq_max, params.kv_unified, params.no_perf = n_seq_max, True, True
        params.n_threads = params.n_threads_batch = 1
        self.ctx = L.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.memory = L.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        self.batch = L.llama_batch_init(n_batch, 0, 1)
        self.sampler = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        L.llama_sampler_chain_add(self.sampler, L.llama_sampler_init_greedy())

    def set_threads(self, n: int) -> None:
        self.L.llama_set_n_threads(self.ctx, n, n)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence id, wants logits) rows."""
        b = self.batch
        for i, (token, pos, seq, wants_logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, wants_logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for {len(rows)} tokens (1: no KV slot: n_ctx too small)")

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        """Greedy, EOS ignored: every prompt is its own sequence in the one KV cache; prompt tokens are
        packed n_batch at a time, then each step decodes one token of every unfinished sequence."""
        L = self.L
        L.llama_memory_clear(self.memory, True)
        out: list[list[int]] = [[] for _ in prompts]
        rows = [(tok, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, tok in enumerate(p)]
        for start in range(0, len(rows), self.n_batch):
            chunk = rows[start:start + self.n_batch]
            self._decode(chunk)
            for i, (_, _, seq, wants_logits) in enumerate(chunk):
                if wants_logits:
                    out[seq].append(L.llama_sampler_sample(self.sampler, self.ctx, i))
        active = [s for s in range(len(prompts)) if len(out[s]) < max_tokens[s]]
        while active:
            self._decode([(out[s][-1], len(prompts[s]) + len(out[s]) - 1, s, True) for s in active])
            for i, s in enumerate(active):
                out[s].append(L.llama_sampler_sample(self.sampler, self.ctx, i))
            for s in active:
                if len(out[s]) >= max_tokens[s]:
                    L.llama_memory_seq_rm(self.memory, s, -1, -1)  # its KV cells free for the others
            active = [s for s in active if len(out[s]) < max_tokens[s]]
        return out


def _high_level(path: str, n_ctx: int, lookup: dict | None):
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(**lookup) if lookup else None
    return Llama(model_path=path, n_ctx=n_ctx, n_threads=1, n_threads_batch=1, verbose=False, draft_model=draft)


def _generate_high_level(llm, prompt: list[int], n: int) -> list[int]:
    llm.reset()  # no reuse of the previous run's KV: every run prefills its whole prompt
    tokens: list[int] = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        tokens.append(int(token))
        if len(tokens) == n:
            break
    return tokens


class Peer:
    def __init__(self) -> None:
        self.raw: dict[str, RawEngine] = {}
        self.high: dict[tuple[str, str], object] = {}
        self.paths: dict[str, str] = {}

    def load(self, name: str, path: str, n_ctx: int, n_seq_max: int) -> dict:
        start = time.perf_counter()
        self.raw[name] = RawEngine(path, n_ctx, n_seq_max)
        self.paths[name] = path
        self.high[(name, "plain")] = _high_level(path, n_ctx, None)
        import llama_cpp

        return {"load_s": time.perf_counter() - start, "llama_cpp_version": llama_cpp.__version__}

    def tokenize(self, name: str, texts: list[str]) -> dict:
        llm = self.high[(name, "plain")]
        return {"ids": [llm.tokenize(t.encode(), add_bos=True, special=False) for t in texts]}

    def generate(self, name: str, prompts: list[list[int]], max_tokens: list[int], threads: int,
                 one_at_a_time: bool = False) -> dict:
        engine = self.raw[name]
        engine.set_threads(threads)
        start = time.perf_counter()
        if one_at_a_time:
            tokens = [engine.generate([p], [n])[0] for p, n in zip(prompts, max_tokens)]
        else:
            tokens = engine.generate(prompts, max_tokens)
        return {"tokens": tokens, "wall_s": time.perf_counter() - start}

    def generate_high_level(self, name: str, prompts: list[list[int]], max_tokens: int, threads: int,
                            lookup: dict | None = None) -> dict:
        import llama_cpp

        key = (name, json.dumps(lookup, sort_keys=True) if lookup else "plain")
        if key not in self.high:
            self.high[key] = _high_level(self.paths[name], self.raw[name].L.llama_n_ctx(self.raw[name].ctx), lookup)
        llm = self.high[key]
        llama_cpp.llama_set_n_threads(llm.ctx, threads, threads)
        start = time.perf_counter()
        tokens = [_generate_high_level(llm, p, max_tokens) for p in prompts]
        return {"tokens": tokens, "wall_s": time.perf_counter() - start}


def serve() -> None:
    out = _protocol_stream()
    peer = Peer()
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        try:
            answer = {"ok": True, **getattr(peer, op)(**request)}
        except Exception as err:  # the bench prints it and stops
            answer = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        out.write(json.dumps(answer) + "\n")


def startup(path: str, launched_at: float, threads: int, chats: list[list[dict]]) -> None:
    """What a llama.cpp user waits for: interpreter + import + load, then the first token of each chat."""
    out = _protocol_stream()
    from llama_cpp import Llama

    threads_kw = {"n_threads": threads, "n_threads_batch": threads} if threads > 0 else {}  # 0: its defaults
    llm = Llama(model_path=path, n_ctx=2048, verbose=False, **threads_kw)
    ready_at = time.time()
    first_token_s, prompt_tokens = [], []
    for messages in chats:
        sent = time.time()
        for chunk in llm.create_chat_completion(messages, max_tokens=8, temperature=0.0, stream=True):
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first_token_s.append(time.time() - sent)
                prompt_tokens.append(llm.n_tokens)  # the first sampled token is not evaluated yet
                break
    out.write(json.dumps({"launched_at": launched_at, "ready_at": ready_at, "first_token_s": first_token_s,
                          "prompt_tokens": prompt_tokens}) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve()
    elif sys.argv[1:2] == ["startup"]:
        startup(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]))
    else:
        sys.exit("usage: _llamacpp_peer.py serve | startup GGUF LAUNCHED_AT THREADS CHATS_JSON")
