"""The worker: from a plan (data) to model inputs, logits and sampled tokens (chapter 04).

The worker owns everything a forward pass touches — the model, the KV pool (and the host copies
of swapped-out requests), the persistent `InputBatch` — and knows requests only by id, through
the plans it is fed (`minillm.scheduler.output.SchedulerOutput`). It never changes a request: it
reports what it sampled in a `ModelRunnerOutput`, and the scheduler's `update_from_output`
decides what that means.

One step: apply the plan's diffs to the input batch; carry out its KV moves (swap-out copies
device → host, zero freshly handed-out blocks, swap-in copies host → device); flatten the new
tokens of every row into one ragged batch (`input_ids[T]`, `positions[T]`) with the addresses
attention needs, computed here from the batch's block-table rows (`slot_mapping[T]`,
`block_tables[B, max_blocks]`, `query_start_loc`, `seq_lens`); run the model; sample the rows
the plan marks (`samples`): the last new token of each request that caught up with its known
tokens (a prefill chunk short of its prompt's end samples nothing), all 1+k of a speculative row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from minillm.attention.evicting import EvictingAttention
from minillm.attention.metadata import AttentionMetadata, StepLayout
from minillm.attention.padded import PaddedAttention, PaddedBatchCache
from minillm.attention.registry import backend_class
from minillm.attention.select import resolve_backend
from minillm.kv.base import KVCacheSpec
from minillm.kv.eviction import EvictionTracker, KVEvictionConfig
from minillm.kv_transfer.base import KVConnectorBase, KVConnectorOutput
from minillm.model.decode_step import CompiledDecode
from minillm.model.llama import LlamaModel
from minillm.sampling import sample, sampled_logprobs
from minillm.scheduler.base import ModelRunnerOutput
from minillm.scheduler.output import SchedulerOutput
from minillm.spec.rejection import greedy_accept, rejection_sample
from minillm.worker.input_batch import InputBatch
from minillm.worker.threads import StepThreads


@dataclass(frozen=True)
class WorkerStats:
    """A worker's counters, returned in one value (`ModelRunner.stats`, `Executor.stats`)."""

    model_time_s: float  # wall time in the model's forward and lm_head (CPU; a GPU would need syncs)
    keys_read: int  # decode attention: keys gathered ...
    keys_exist: int  # ... and keys the rows really have (their ratio: the torch backend's padded reads)
    attention_backend: str  # what "auto" resolved to


@dataclass
class StepInputs:
    """One step's model inputs, and how its logits rows map back to the plan."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata  # what the attention backend built (its `build_metadata`)
    logits_rows: list[int]  # flattened token rows whose logits are computed
    order: list[int]  # order[j]: the plan row of flattened sequence j (decode rows first, longest first)
    sampled: list[int] = field(default_factory=list)  # plan rows that sample, in plan order
    spans: list[tuple[int, int]] = field(default_factory=list)  # per sampled row: (first logits row, width)
    sampled_rows: np.ndarray | None = None  # per sampled row: its input-batch row
    expert_load: list[list[int]] | None = None  # what the forward measured (MoE), for ModelRunnerOutput

    def __iter__(self):
        """Unpacks as (input_ids, positions, meta, logits_rows), as chapter 04 prints them."""
        return iter((self.input_ids, self.positions, self.meta, self.logits_rows))


class ModelRunner:
    def __init__(self, model: LlamaModel, cache_spec: KVCacheSpec, attention_backend: str = "auto",
                 kv_connector: KVConnectorBase | None = None, num_threads: int | None = None,
                 kv_eviction: KVEvictionConfig | None = None) -> None:
        """`kv_connector`: a KV connector's worker side (minillm.kv_transfer), which loads remote K/V into
        this worker's blocks when the plan's `kv_connector_metadata` says so. `num_threads`: torch
        threads for every step, or None for the step's rule (minillm/worker/threads.py). `kv_eviction`:
        decode attends to a per-sequence budget of tokens (chapter 14; the torch backend, `EvictingAttention`)."""
        self.model = model
        self.cache_spec = cache_spec
        self.threads = StepThreads(model.dtype, num_threads)  # torch threads per step, by its size
        self.attention_backend = resolve_backend(attention_backend, model.device, cache_spec.dtype)
        self.backend = backend_class(self.attention_backend)  # builds its metadata, then runs each layer
        # a quantized pool (chapter 14): the backend is told how to read it (a backend without the keyword refuses)
        self.quantized_kv = {"kv_cache_dtype": cache_spec.kv_cache_dtype} if cache_spec.quantized else {}
        self.block_size = cache_spec.block_size
        self.null_block = cache_spec.null_block
        self.k_pool = self.v_pool = None
        if cache_spec.allocate and cache_spec.num_slots:
            # (a quantized kv_cache_dtype stores bytes: each (token, head) row its codes and scale)
            self.k_pool = torch.zeros(cache_spec.shape, dtype=cache_spec.storage_dtype, device=model.device)
            self.v_pool = torch.zeros(cache_spec.shape, dtype=cache_spec.storage_dtype, device=model.device)
        self._pools_by_block: list | None = None  # the pools seen as [L, blocks, block] (`_zero_blocks`)
        self.padded_cache: PaddedBatchCache | None = None  # static/dynamic batching's rectangle
        # host K, V, number of blocks: per swapped-out request, and per host block of the prefix cache's
        # offload tier (its pseudo request id, minillm.kv.offload.host_block_id: never planned, never finished)
        self.swapped: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.input_batch = InputBatch(cache_spec.max_blocks_per_seq, model.device)
        self.keys_read = 0  # decode attention, over the runner's life: keys gathered ...
        self.keys_exist = 0  # ... and keys the rows really have
        self.model_time_s = 0.0  # wall time in the model's forward and lm_head (CPU; a GPU would need syncs)
        self.kv_connector = kv_connector
        if kv_connector is not None:
            kv_connector.register_kv_caches(self.k_pool, self.v_pool, self.block_size)
        # Small decode steps as one compiled call over reused buffers, where that is exact
        # (minillm/model/decode_step.py); why not, when it is not.
        self.compiled_decode: CompiledDecode | None = None
        self.compiled_decode_off = CompiledDecode.supported(model, self.k_pool, self.attention_backend)
        if self.compiled_decode_off is None:
            self.compiled_decode = CompiledDecode(model, self.k_pool, self.v_pool, self.block_size)
        self.eviction = None if kv_eviction is None else EvictionTracker(kv_eviction)
        if self.eviction is not None and self.attention_backend != "torch":
            raise ValueError(f"kv_eviction needs the torch attention backend, not {self.attention_backend!r}")

    def stats(self, reset: bool = False) -> WorkerStats:
        """The counters since start (or the last reset); `reset` zeroes them after reading."""
        out = WorkerStats(self.model_time_s, self.keys_read, self.keys_exist, self.attention_backend)
        if reset:
            self.model_time_s, self.keys_read, self.keys_exist = 0.0, 0, 0
        return out

    # ---- the plan's diffs and KV moves -----------------------------------------------------------
    def update_state(self, plan: SchedulerOutput) -> KVConnectorOutput | None:
        """Apply the plan to the input batch, then its KV moves, in the only safe order: copy
        victims out before their blocks are zeroed or rewritten, zero fresh blocks, copy back in,
        then load remote K/V (a KV connector's); returns what the connector loaded, if anything."""
        for rid in plan.finished_req_ids:
            self.swapped.pop(rid, None)
            if self.eviction is not None:
                self.eviction.forget(rid)
        if self.swapped:  # a host copy is dropped once its request runs without needing it
            swapping_in = {rid for rid, _ in plan.blocks_to_swap_in}
            for rid in plan.req_ids:
                if rid in self.swapped and rid not in swapping_in:
                    del self.swapped[rid]
        self.input_batch.update(plan)
        for rid, blocks in plan.blocks_to_swap_out:
            self._copy_out(rid, blocks)
        if plan.blocks_to_zero and self.k_pool is not None:
            self._zero_blocks(plan.blocks_to_zero)
        for rid, blocks in plan.blocks_to_swap_in:
            self._copy_in(rid, blocks)
        if plan.kv_connector_metadata is not None:  # remote K/V into freshly zeroed blocks (minillm.kv_transfer)
            return self.kv_connector.start_load_kv(plan.kv_connector_metadata)
        return None

    def _zero_blocks(self, blocks: list[int]) -> None:
        """Zero the K and V of `blocks` in every layer (on a CPU through numpy views of the pools,
        made once: a few µs and no torch op, where torch's index_fill_ cost ~50 µs a step at batch 64)."""
        if self._pools_by_block is None:
            numpy_ok = self.k_pool.device.type == "cpu" and self.k_pool.dtype in (
                torch.float32, torch.float64, torch.uint8)  # (numpy has no bf16)
            self._pools_by_block = [(pool.numpy() if numpy_ok else pool).reshape(
                pool.shape[0], -1, self.block_size * pool.shape[2] * pool.shape[3])  # [L, blocks, block]
                for pool in (self.k_pool, self.v_pool)]
        for pool in self._pools_by_block:
            if isinstance(pool, np.ndarray):
                pool[:, blocks] = 0
            else:
                pool.index_fill_(1, torch.tensor(blocks, dtype=torch.long, device=pool.device), 0)

    def _block_slots(self, blocks: list[int]) -> torch.Tensor:
        bs, device = self.block_size, self.k_pool.device
        base = torch.tensor(blocks, dtype=torch.long, device=device)[:, None] * bs
        return (base + torch.arange(bs, device=device)[None, :]).reshape(-1)

    def _copy_out(self, rid: str, blocks: list[int]) -> None:
        if self.k_pool is None or not blocks:
            return
        slots = self._block_slots(blocks)
        self.swapped[rid] = (self.k_pool[:, slots].to("cpu"), self.v_pool[:, slots].to("cpu"), len(blocks))

    def _copy_in(self, rid: str, blocks: list[int]) -> None:
        """Host → the request's device blocks that the prefix cache did not cover."""
        saved = self.swapped.get(rid)
        if self.k_pool is None or not blocks or saved is None:
            return
        k, v, num_blocks = saved
        skip = (num_blocks - len(blocks)) * self.block_size
        slots = self._block_slots(blocks)
        self.k_pool[:, slots] = k[:, skip:].to(self.k_pool.device)
        self.v_pool[:, slots] = v[:, skip:].to(self.v_pool.device)

    # ---- inputs ------------------------------------------------------------------------------------
    def prepare(self, plan: SchedulerOutput) -> StepInputs:
        """Model inputs for a (ragged) step whose diffs `update_state` applied.

        Rows are reordered for attention — decode rows longest first, then the rest longest first;
        the logits rows come in plan order (`StepInputs.sampled` holds their plan rows). The
        per-row and per-token arithmetic is one compiled pass (`layout_step`), so it stays small
        beside the forward at batch 64. What attention needs beyond the flat layout, the
        attention backend builds itself (`build_metadata`)."""
        from minillm.worker.step_layout import layout_step  # (numba, imported on first use, not with minillm)

        device, bs, batch = self.model.device, self.block_size, self.input_batch
        req_ids, spec = plan.req_ids, plan.spec_token_ids
        counts = np.asarray(plan.num_scheduled_tokens, dtype=np.int64)
        samples = np.asarray(plan.samples, dtype=bool)
        widths = samples.astype(np.int64)  # logits rows per plan row: 1 if it samples, 1+k if it speculates
        if spec:
            for i in np.flatnonzero(samples).tolist():
                widths[i] += len(spec.get(req_ids[i], ()))
        plan_rows = batch.rows_of(req_ids)  # each plan row's input-batch row
        is_decode = np.asarray(plan.is_decode, dtype=bool)
        # The flat layout in one compiled pass (minillm/worker/step_layout.py): the rows' order,
        # lengths, where each row's tokens start, each token's position, id and K/V slot, the
        # block tables, and the rows whose logits are needed.
        order_np, seq_lens, query_start_np, pos, token_ids, slot_mapping, tables, logits_np = layout_step(
            counts, np.asarray(plan.num_computed_tokens, dtype=np.int64), is_decode, widths, plan_rows,
            batch.block_table.table, batch.token_ids, bs)
        nd = int(np.count_nonzero(is_decode))
        sampled_np = np.flatnonzero(samples)
        sampled = sampled_np.tolist()
        if spec:  # per sampled row, where its logits rows start and how many
            sampled_widths = widths[sampled_np]
            firsts = np.zeros(len(sampled), dtype=np.int64)
            np.cumsum(sampled_widths[:-1], out=firsts[1:])
            spans = list(zip(firsts.tolist(), sampled_widths.tolist()))
        else:
            spans = [(j, 1) for j in range(len(sampled))]
        layout = StepLayout(slot_mapping, query_start_np, seq_lens, counts[order_np], tables, nd, bs,
                            self.null_block, device, self.model.config.sliding_windows)
        meta = self.backend.build_metadata(layout)
        self.keys_exist += int(seq_lens[:nd].sum())
        self.keys_read += meta.keys_read
        return StepInputs(torch.from_numpy(token_ids).to(device), torch.from_numpy(pos).to(device), meta,
                          logits_np.tolist(), order_np.tolist(), sampled, spans, plan_rows[sampled_np])

    # ---- one step ------------------------------------------------------------------------------------
    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; per plan row, the token ids it sampled (and their logprobs)."""
        loaded = self.update_state(plan)
        batch = self.input_batch
        compiled = self.compiled_decode
        kernel_rows = None if compiled is None or len(plan.req_ids) > compiled.max_rows else compiled.rows_of(plan, batch)
        if kernel_rows is not None:  # a small decode or verify step: one compiled call, every row samples
            logits, logits_np = self._run_compiled(*kernel_rows)
            plain = not (batch.num_random or batch.num_penalized or batch.num_min_tokens or batch.num_logprobs)
            if plan.spec_token_ids:
                if plain:
                    return ModelRunnerOutput(self._greedy_verify(plan, logits_np), None, None, loaded)
                return self._verify(plan, logits, self._compiled_inputs(plan))
            if plain:
                # every known request greedy and plain: `sample` would be this argmax (the first
                # largest logit), here without a tensor op
                return ModelRunnerOutput(logits_np.argmax(axis=-1)[:, None].tolist(), None, None, loaded)
            sampled, expert_load, rows = range(len(plan.req_ids)), None, kernel_rows[0]
        elif plan.padded is not None:
            if self.threads.per_step:
                self.threads.apply(len(plan.padded.row_req_ids) * plan.padded.width)
            logits, expert_load = self.compute_padded_logits(plan)
            sampled = [i for i in range(len(plan.req_ids))]
            rows = batch.rows_of(plan.req_ids)
        else:
            if self.threads.per_step:
                self.threads.apply(plan.num_tokens)
            logits, inputs = self.compute_logits(plan)
            sampled, rows = inputs.sampled, inputs.sampled_rows  # (prepare looked the rows up)
            expert_load = inputs.expert_load
            if plan.spec_token_ids:
                return self._verify(plan, logits, inputs)  # (no KV connector with speculative decoding)
        req_ids = [plan.req_ids[i] for i in sampled]
        states = [batch.requests[rid] for rid in req_ids]
        tokens = sample(logits, batch, rows, states)
        out: list[list[int]] = [[] for _ in plan.req_ids]
        for i, t in zip(sampled, tokens):
            out[i] = [t]
        logprobs = None
        if batch.num_logprobs and batch.wants_logprobs[rows].any():
            logprobs = [None] * len(plan.req_ids)
            for i, lp in zip(sampled, sampled_logprobs(logits, states, tokens)):
                logprobs[i] = lp
        return ModelRunnerOutput(out, logprobs, expert_load, loaded)

    def _compiled_inputs(self, plan: SchedulerOutput) -> StepInputs:
        """What `_verify` reads of a compiled step's inputs: every plan row samples, its logits rows
        consecutive (1, or 1+k for a verify row), in plan order."""
        widths = plan.num_scheduled_tokens
        firsts = np.cumsum(widths) - widths
        every = list(range(len(plan.req_ids)))
        return StepInputs(None, None, None, list(range(int(firsts[-1]) + widths[-1])), every, every,
                          list(zip(firsts.tolist(), widths)), self.input_batch.rows_of(plan.req_ids))

    @staticmethod
    def _greedy_verify(plan: SchedulerOutput, logits_np: np.ndarray) -> list[list[int]]:
        """A verify step's tokens when every request is greedy and plain: `_verify` would emit these
        (`rejection_sample`'s greedy rule on the argmax of each row), here from one numpy argmax and
        without a tensor op."""
        best = logits_np.argmax(axis=-1).tolist()
        spec, out, first = plan.spec_token_ids, [], 0
        for rid, width in zip(plan.req_ids, plan.num_scheduled_tokens):
            guesses = spec.get(rid)
            out.append(greedy_accept(guesses, best[first : first + width]) if guesses else [best[first]])
            first += width
        return out

    def _verify(self, plan: SchedulerOutput, logits: torch.Tensor, inputs: StepInputs) -> ModelRunnerOutput:
        """A step with speculative rows: plain rows sample as usual, speculative rows go through the
        rejection sampler (0 … k guesses accepted, then a correction or the bonus token)."""
        batch = self.input_batch
        out: list[list[int]] = [[] for _ in plan.req_ids]
        states = [batch.requests[plan.req_ids[i]] for i in inputs.sampled]
        logprobs: list | None = None
        if any(s.params.logprobs is not None for s in states):
            logprobs = [None] * len(plan.req_ids)
        plain = [(j, i) for j, i in enumerate(inputs.sampled) if plan.req_ids[i] not in plan.spec_token_ids]
        if plain:
            first = torch.tensor([inputs.spans[j][0] for j, _ in plain], dtype=torch.long, device=logits.device)
            plain_logits, plain_states = logits.index_select(0, first), [states[j] for j, _ in plain]
            rows = np.fromiter((s.row for s in plain_states), np.int64, len(plain_states))
            tokens = sample(plain_logits, batch, rows, plain_states)
            lps = sampled_logprobs(plain_logits, plain_states, tokens) if logprobs is not None else [None] * len(plain)
            for (_, i), t, lp in zip(plain, tokens, lps):
                out[i] = [t]
                if logprobs is not None:
                    logprobs[i] = lp
        for j, i in enumerate(inputs.sampled):
            state = states[j]
            guesses = plan.spec_token_ids.get(state.req_id)
            if guesses:
                start, width = inputs.spans[j]
                out[i] = rejection_sample(state, logits[start : start + width], guesses,
                                          plan.spec_draft_probs.get(state.req_id))
                if logprobs is not None and state.params.logprobs is not None:
                    # the target's logprobs at each emitted position (before temperature, as for plain rows)
                    m = len(out[i])
                    logprobs[i] = [e[0] for e in sampled_logprobs(logits[start : start + m], [state] * m, out[i])]
        return ModelRunnerOutput(out, logprobs, inputs.expert_load)

    def compute_padded_logits(self, plan: SchedulerOutput) -> tuple[torch.Tensor, list[list[int]] | None]:
        """A static/dynamic step: every row of the rectangle is computed, pads and finished rows too.
        Logits come for the live rows (those with tokens), in row order — the plan's order; with the
        forward's expert load (MoE)."""
        step, device, c = plan.padded, self.model.device, self.cache_spec
        if step.is_prefill:
            self.padded_cache = PaddedBatchCache(c.num_layers, len(step.row_req_ids), step.max_len, c.num_kv_heads,
                                                 c.head_dim, c.dtype, device, c.kv_cache_dtype)
        cache, width = self.padded_cache, step.width
        ids = torch.zeros(len(step.row_req_ids), width, dtype=torch.long)
        is_real = torch.zeros(len(step.row_req_ids), width, dtype=torch.bool)
        live_rows = []
        for i, new in enumerate(step.row_token_ids):
            if not new:
                continue  # a finished row computes a dummy token that nobody reads
            ids[i, width - len(new):] = torch.tensor(new)
            is_real[i, width - len(new):] = True
            live_rows.append(i)
        attention = PaddedAttention(cache, width, is_real.to(device), self.model.config.sliding_windows)
        # Positions count real tokens only, as HF derives them from the attention mask.
        real_so_far = cache.is_real[:, : cache.length + width].long().cumsum(-1)[:, -width:]
        positions = (real_so_far - 1).clamp(min=0)
        last = torch.tensor([i * width + width - 1 for i in live_rows], dtype=torch.long, device=device)
        start = time.perf_counter()
        forward = self.model.forward(ids.to(device).flatten(), positions.flatten(), attention, output_rows=last)
        attention.finish_step()
        logits = self.model.compute_logits(forward.hidden)
        self.model_time_s += time.perf_counter() - start
        return logits, forward.expert_load

    def _run_compiled(self, rows: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """The compiled decode step (minillm/model/decode_step.py) on the kernel rows `CompiledDecode.rows_of`
        gave (input-batch rows, positions): its logits buffer, as a tensor and as numpy; the runner's
        counters kept as the op-by-op step keeps them."""
        start = time.perf_counter()
        logits, logits_np = self.compiled_decode.run(rows, starts, self.input_batch)
        self.model_time_s += time.perf_counter() - start
        keys = int(np.add.reduce(starts)) + len(rows)  # (the ufunc itself: ndarray.sum goes through a Python wrapper)
        self.keys_read += keys
        self.keys_exist += keys
        return logits, logits_np

    def compute_logits(self, plan: SchedulerOutput) -> tuple[torch.Tensor, StepInputs]:
        """Run the model on a step whose diffs were applied; logits [N, vocab] of the sampled rows
        (plan order, 1+k per speculative row) and the step's inputs. A step the compiled decode
        can run (the draft model's one-token passes, chapter 09) runs compiled: its logits are a
        copy of the buffer, and its inputs hold no tensors (none were built)."""
        compiled = self.compiled_decode
        if compiled is not None and len(plan.req_ids) <= compiled.max_rows:
            kernel_rows = compiled.rows_of(plan, self.input_batch)
            if kernel_rows is not None:
                logits = self._run_compiled(*kernel_rows)[0].clone()
                if plan.spec_token_ids:
                    return logits, self._compiled_inputs(plan)
                every = list(range(len(plan.req_ids)))
                return logits, StepInputs(None, None, None, every, every, every, [(j, 1) for j in every],
                                          kernel_rows[0])
        inputs = self.prepare(plan)
        if self.eviction is None:
            attention = self.backend(self.k_pool, self.v_pool, inputs.meta, self.model.config.sliding_windows,
                                     **self.quantized_kv)
        else:
            attention = EvictingAttention(self.k_pool, self.v_pool, inputs.meta, self.model.config.sliding_windows,
                                          self.eviction, [plan.req_ids[i] for i in inputs.order], **self.quantized_kv)
        rows = torch.tensor(inputs.logits_rows, dtype=torch.long, device=inputs.input_ids.device)
        start = time.perf_counter()
        forward = self.model.forward(inputs.input_ids, inputs.positions, attention, output_rows=rows)
        logits = self.model.compute_logits(forward.hidden)
        self.model_time_s += time.perf_counter() - start
        inputs.expert_load = forward.expert_load
        return logits, inputs
