"""Tensor and pipeline parallelism on real processes (issue 16, chapter 12).

The exactness matrix: greedy (and seeded) tokens of `LLM(tensor_parallel_size=..., pipeline_parallel_size=...)`
equal the one-process engine's in float64 for TP 2, TP 4, PP 2 (2 micro-batches a step), TP 2 × PP 2
and the bundled Mixtral on 2 ranks with its experts whole (EP 2) or sliced (TP 2), with its per-step
expert-load histogram, each with chunked prefill,
prefix caching and preemption (recompute or swap) happening, and n-gram speculation on TP 2 and on
PP 2 with micro-batches; slabs,
static and dynamic batching and a draft model too; float32 TP 2 is compared by greedy tokens with the
logit margin printed. Faults: a worker killed, a worker hung, a shard that cannot
load each end in a clear `EngineDeadError` within the executor's timeout, and no process is left
(counted); `shutdown()`, garbage collection and a killed driver leave no rank behind. The server answers 500 and
/health 503 once a worker died; `minillm serve --tensor-parallel-size 2` answers the `openai`
client with TP 1's text.

Every rank is a spawned process on gloo, one torch thread each. All tests here share one xdist
group: they run one after another (2 cores), never beside each other.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import wait_until_healthy

from minillm import LLM, SamplingParams
from minillm.executor.abstract import EngineDeadError
from minillm.llm import BUNDLED_TARGET

sys.path.insert(0, str(Path(__file__).parent))

pytestmark = pytest.mark.xdist_group("distributed")

PROMPTS = ["In the beginning God created the heaven and the earth.",
           "In the beginning God created the heaven and",
           "And God said, Let there be light",
           "Blessed are the meek"]
# Small pool and budget: prompts are chunked (10 tokens a step), the shared prefix is found in the
# cache, and the pool (14 blocks of 4) is too small for all four: requests are preempted.
KNOBS = dict(max_num_seqs=4, block_size=4, num_kv_blocks=14, max_model_len=48, enable_chunked_prefill=True,
             max_num_batched_tokens=10, enable_prefix_caching=True)
SMALL = dict(max_num_seqs=4, max_model_len=64)


def params(max_tokens: int = 10) -> list[SamplingParams]:
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=20, seed=5, ignore_eos=True)
    return [greedy, seeded, greedy, greedy]


def worker_processes() -> set[int]:
    """Pids of this process's descendants (multiprocessing's resource tracker, started once, excluded)."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def gone(pids) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def bounded(fn, timeout_s: float = 180.0):
    """fn() on a thread; fails (never hangs) if it has not returned within timeout_s."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - re-raised below
            result["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"no answer within {timeout_s} s: a hang"
    if "error" in result:
        raise result["error"]
    return result["value"]


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


_reference: dict = {}


def reference(dtype: str, knobs: dict, sampling: list[SamplingParams], model: str | None = None):
    """The one-process engine's outputs (cached per configuration)."""
    key = (dtype, repr(sorted(knobs.items())), tuple(repr(p) for p in sampling), model)
    if key not in _reference:
        llm = LLM(model, dtype=dtype, **knobs)
        _reference[key] = (llm.generate(PROMPTS, sampling, use_tqdm=False), llm.engine)
    return _reference[key]


MOE = str(BUNDLED_TARGET.parent / "minillm-moe")  # Mixtral-style: 4 experts, top-2, 4 query / 2 KV heads


@pytest.mark.parametrize("tp, pp, micro, preemption, cache, moe", [
    (2, 1, 1, "swap", "radix", False), (4, 1, 1, "recompute", "hash", False), (1, 2, 2, "recompute", "hash", False),
    (2, 2, 1, "swap", "hash", False), (2, 1, 1, "recompute", "hash", "ep"), (2, 1, 1, "swap", "radix", "tp"),
    (1, 2, 2, "recompute", "hash", "tp")],
    ids=["tp2-ngram-spec", "tp4", "pp2-microbatches2-ngram-spec", "tp2xpp2", "ep2-moe", "tp2-moe-sliced-experts",
         "pp2-moe-microbatches2"])
def test_exactness_matrix_float64(tp, pp, micro, preemption, cache, moe):
    knobs = dict(KNOBS, preemption_mode=preemption, prefix_cache=cache)
    if (tp == 2 and pp == 1 and not moe) or (micro > 1 and not moe):  # n-gram speculation too: the sampling rank verifies
        knobs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3}
    model = MOE if moe else None
    want, one = reference("float64", knobs, params(), model)
    before = worker_processes()
    llm = LLM(model, dtype="float64", tensor_parallel_size=tp, pipeline_parallel_size=pp,
              pipeline_micro_batches=micro, enable_expert_parallel=moe == "ep", **knobs)
    pids = llm.engine.executor.pids
    assert len(pids) == tp * pp and set(pids) <= worker_processes()
    got = bounded(lambda: llm.generate(PROMPTS, params(), use_tqdm=False))
    assert tokens(got) == tokens(want)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0 and engine.kv.num_hit_tokens > 0
    assert any(s.prefill_chunk_sizes and max(s.prefill_chunk_sizes) == 10 for s in engine.metrics.steps)
    if preemption == "swap":
        assert engine.kv.num_swapped_in_tokens > 0
    if "speculative_config" in knobs:
        assert engine.metrics.spec_decode.num_draft_tokens > 0
    # Each rank holds its heads' KV pool (KV heads replicated only when fewer than ranks) and its stage's layers.
    info = engine.executor.rank_info
    kv_heads, layers = (2, 2) if moe else (4, 4)
    assert [i["kv_pool_shape"][2] for i in info] == [kv_heads // min(tp, kv_heads)] * (tp * pp)
    assert sum(i["kv_pool_shape"][0] for i in info) == layers * tp
    if moe:  # experts split over the ranks (whole, or sliced), the same per-step expert-load histogram
        assert [s.expert_load for s in engine.metrics.steps] == [s.expert_load for s in one.metrics.steps]
        assert all(i["weight_bytes"] < (0.6 if tp > 1 else 0.8) * one.model.weight_bytes for i in info)
    # Communication: 2 all-reduces per layer and step (+1 for the embedding) on each TP rank; an expert-
    # parallel MoE layer has 1 (after attention: its output comes whole from all-to-all + all-gather).
    stats = engine.executor.collective_stats()
    if tp > 1:
        layers_first_stage = info[0]["kv_pool_shape"][0]
        per_layer = 1 if moe == "ep" else 2
        assert stats[0]["calls"]["all_reduce"] == engine.executor.num_steps * (per_layer * layers_first_stage + 1)
    if pp > 1:  # one send/recv of [tokens, hidden] per step, or per micro-batch
        sends = stats[0]["calls"]["send"]
        assert sends == stats[-1]["calls"]["recv"]
        assert sends > engine.executor.num_steps if micro > 1 else sends == engine.executor.num_steps
    if tp == 2 and pp == 1:  # garbage collection joins the workers
        del llm, engine
        gc.collect()
    else:
        llm.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            llm.generate(PROMPTS[:1], params()[:1], use_tqdm=False)
    assert gone(pids) and worker_processes() <= before


@pytest.mark.parametrize("tp, pp, knobs", [
    (2, 1, dict(kv_layout="slab", enable_chunked_prefill=True, max_num_batched_tokens=10)),
    (2, 1, dict(batching="static")),
    (1, 2, dict(batching="dynamic")),
    (2, 1, dict(speculative_config={"method": "draft_model", "num_speculative_tokens": 3}))],
    ids=["tp2-slab-chunked", "tp2-static", "pp2-dynamic", "tp2-draft-model-spec"])
def test_other_kv_layouts_and_batching_modes_float64(tp, pp, knobs):
    """Slabs (chapter 04) and the padded rectangles of static / dynamic batching (chapters 02-03) run the
    same on ranks: each holds its heads and layers of them. A draft model (chapter 09) runs in the driver,
    beside the scheduler; the ranks verify its guesses."""
    knobs = dict(knobs, max_num_seqs=2, max_model_len=48)
    sp = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * 4
    want, _ = reference("float64", knobs, sp)
    llm = LLM(dtype="float64", tensor_parallel_size=tp, pipeline_parallel_size=pp, **knobs)
    try:
        got = bounded(lambda: llm.generate(PROMPTS, sp, use_tqdm=False))
        if "speculative_config" in knobs:
            assert llm.engine.metrics.spec_decode.num_draft_tokens > 0
    finally:
        llm.shutdown()
    assert tokens(got) == tokens(want)


@pytest.fixture(scope="module")
def tp2_float32():
    """One TP 2 float32 engine for the float32 comparison, then for the killed-worker test (which ends it)."""
    llm = LLM(dtype="float32", tensor_parallel_size=2, **SMALL)
    yield llm
    llm.shutdown()


def test_float32_tp2_greedy_tokens_and_logit_margin(tp2_float32, capsys):
    """float32: the all-reduce adds partial sums in another order than one matmul, so logits differ in the
    last bits. Greedy tokens stay equal while every step's top-1 margin exceeds that difference."""
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    want, _ = reference("float32", SMALL, [sp] * 4)
    got = bounded(lambda: tp2_float32.generate(PROMPTS, sp, use_tqdm=False))
    assert tokens(got) == tokens(want)
    margins, diffs = [], []
    for a, b in zip(want, got):
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            values = sorted(lp_a.values(), reverse=True)
            margins.append(values[0] - values[1])
            diffs.extend(abs(lp_a[t] - lp_b[t]) for t in lp_a if t in lp_b)
    with capsys.disabled():
        print(f"\nfloat32 TP2 vs TP1: {len(margins)} greedy steps, smallest top-1 margin {min(margins):.3g} "
              f"(logprob), largest |Δ logprob| {max(diffs):.2g}")
    assert max(diffs) < 1e-3 and max(diffs) < min(margins)


def test_a_killed_worker_is_a_clear_error_and_no_process_is_left(tp2_float32):
    llm = tp2_float32
    pids = llm.engine.executor.pids
    others = worker_processes() - set(pids)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(bounded(lambda: llm.generate(PROMPTS[:2], sp, use_tqdm=False))) == 2
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(EngineDeadError, match=rf"rank 1 \(pid {pids[1]}\)"):
        bounded(lambda: llm.generate(PROMPTS[:2], sp, use_tqdm=False))
    assert gone(pids) and worker_processes() <= others  # the other rank was stopped too
    with pytest.raises(EngineDeadError, match="rank 1"):  # and every later call says so at once
        llm.generate(PROMPTS[:1], sp, use_tqdm=False)


def test_a_hung_worker_times_out_with_a_clear_error():
    before = worker_processes()
    llm = LLM(tensor_parallel_size=2, pipeline_parallel_size=1, execute_model_timeout_s=3, **SMALL)
    pids = llm.engine.executor.pids
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    os.kill(pids[0], signal.SIGSTOP)  # alive, but answers nothing (a rank stuck in a kernel or collective)
    try:
        with pytest.raises(EngineDeadError, match=r"rank\(s\) \[0, 1\] .* did not answer step 1 within 3 s"):
            bounded(lambda: llm.generate(PROMPTS[:2], sp, use_tqdm=False), 60)
    finally:
        if psutil.pid_exists(pids[0]):
            os.kill(pids[0], signal.SIGCONT)
    assert gone(pids) and worker_processes() <= before


DRIVER = """
import sys
from minillm import LLM
llm = LLM(tensor_parallel_size=2, max_num_seqs=2, max_model_len=64)
print(" ".join(map(str, llm.engine.executor.pids)), flush=True)
sys.stdin.read()
"""


def test_ranks_leave_when_their_driver_is_killed():
    """The worst case for orphans: the driver dies without any clean-up; each rank sees its pipe close and exits."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                              text=True)
    try:
        pids = [int(p) for p in bounded(driver.stdout.readline, 180).split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    finally:
        driver.kill()
        driver.wait(30)
    deadline = time.monotonic() + 60
    while not gone(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(pids), f"rank processes {pids} outlived their driver"


def test_a_shard_that_cannot_load_fails_at_construction(tmp_path):
    """A checkpoint missing a tensor: the ranks report it, LLM(...) raises, nothing keeps running."""
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "broken"
    shutil.copytree(BUNDLED_TARGET, model_dir)
    state = load_file(model_dir / "model.safetensors")
    del state["model.layers.3.mlp.down_proj.weight"]
    save_file(state, model_dir / "model.safetensors")
    before = worker_processes()
    with pytest.raises(EngineDeadError, match=r"failed in start-up: KeyError.*layers\.3\.mlp\.down_proj"):
        bounded(lambda: LLM(str(model_dir), pipeline_parallel_size=2, **SMALL))
    assert worker_processes() <= before


@pytest.mark.parametrize("knobs, message", [
    (dict(tensor_parallel_size=3), r"tensor_parallel_size=3 does not divide the model's 8 attention heads"),
    (dict(pipeline_parallel_size=5), r"pipeline_parallel_size=5 is more stages than the model's 4 layers"),
    (dict(tensor_parallel_size=0), r"tensor_parallel_size must be an integer >= 1, got 0"),
    (dict(pipeline_micro_batches=2), r"pipeline_micro_batches=2 .* needs pipeline_parallel_size >= 2"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), r"'uni' runs one process"),
    (dict(distributed_executor_backend="ray"), r"distributed_executor_backend='ray'; choose one of \('uni', 'mp', 'external_launcher'\)"),
    (dict(enable_expert_parallel=True), r"enable_expert_parallel=True .* needs tensor_parallel_size >= 2 \(got 1\)"),
    (dict(tensor_parallel_size=2, enable_expert_parallel=True), r"model_type 'llama' has no experts"),
    (dict(model=MOE, tensor_parallel_size=8, enable_expert_parallel=True), r"tensor_parallel_size=8 does not divide .* 4 attention heads"),
])
def test_worlds_the_model_cannot_split_are_refused_at_construction(knobs, message):
    before = worker_processes()
    knobs = dict(knobs)
    with pytest.raises(ValueError, match=message):
        LLM(knobs.pop("model", None), **knobs)
    assert worker_processes() <= before  # refused before any process started


def test_layers_split_as_vllm_splits_them_and_steps_into_micro_batches():
    from minillm.distributed.layout import stage_layer_counts, stage_layers
    from minillm.distributed.worker import micro_batch_rows

    assert stage_layer_counts(3, 2) == [2, 1]
    assert stage_layer_counts(4, 3) == [1, 2, 1]
    assert stage_layer_counts(5, 3) == [2, 2, 1]
    assert stage_layer_counts(4, 2) == [2, 2]
    assert [list(stage_layers(5, 3, s)) for s in range(3)] == [[0, 1], [2, 3], [4]]
    assert micro_batch_rows([1] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert micro_batch_rows([1, 1, 1, 1, 10], 2) == [(0, 4), (4, 5)]  # a long prefill row stays whole
    assert micro_batch_rows([5], 4) == [(0, 1)] and micro_batch_rows([], 2) == []


@pytest.mark.parametrize("tp", [2, 8])
def test_each_rank_reads_only_its_shard(tp):
    """Slices from safe_open(...).get_slice equal the slices of the whole tensors; with tp 8 > 4 KV heads
    each KV head is held by the 2 ranks whose query heads read it."""
    import torch

    from minillm.distributed.layout import RankLayout
    from minillm.model.checkpoint import SafetensorsCheckpoint
    from minillm.model.config import ModelConfig
    from minillm.model.loader import Placement, load_weights, read_hf_config, read_safetensors

    config = ModelConfig.from_hf_dict(read_hf_config(BUNDLED_TARGET))
    full = read_safetensors(BUNDLED_TARGET)
    total = sum(t.numel() * t.element_size() for t in full.values())
    d, per_q = config.head_dim, config.num_heads // tp
    for rank in (0, tp - 1):
        layout = RankLayout(rank, tp, 1)
        with SafetensorsCheckpoint(BUNDLED_TARGET) as checkpoint:
            w = load_weights(checkpoint, config, Placement.of_rank(config, layout), torch.float32)
        a = "model.layers.2.self_attn."
        kv_head = rank * config.num_kv_heads // tp if tp > config.num_kv_heads else None
        q_rows = slice(rank * per_q * d, (rank + 1) * per_q * d)
        kv_rows = slice(kv_head * d, (kv_head + 1) * d) if kv_head is not None else \
            slice(rank * d * config.num_kv_heads // tp, (rank + 1) * d * config.num_kv_heads // tp)
        want_qkv = torch.cat((full[a + "q_proj.weight"][q_rows], full[a + "k_proj.weight"][kv_rows],
                              full[a + "v_proj.weight"][kv_rows]))
        assert torch.equal(w.layers[2].qkv, want_qkv)
        assert torch.equal(w.layers[2].o, full[a + "o_proj.weight"][:, q_rows])
        inter = config.intermediate_size // tp
        m = slice(rank * inter, (rank + 1) * inter)
        assert torch.equal(w.layers[2].down, full["model.layers.2.mlp.down_proj.weight"][:, m])
        vocab = config.vocab_size // tp
        assert torch.equal(w.lm_head, full["lm_head.weight"][rank * vocab:(rank + 1) * vocab])
        assert w.bytes_read < total / tp * 1.1  # its share (norms are whole), never the whole checkpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_answers_500_and_health_503_once_a_worker_died():
    import httpx
    from test_server import running_server

    with running_server(tensor_parallel_size=2, **SMALL) as (url, app):
        executor = app.state.server.llm.engine.executor
        body = {"model": "minillm", "prompt": "In the beginning", "max_tokens": 3, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=120).status_code == 200
        assert httpx.get(url + "/health").status_code == 200
        os.kill(executor.pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while executor.processes[1].is_alive() and time.monotonic() < deadline:  # (not psutil's wait: it would reap it)
            time.sleep(0.05)
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 500 and "rank 1" in r.json()["error"]["message"]
        assert gone(executor.pids)
    app.state.server.llm.shutdown()


def test_minillm_serve_tensor_parallel_2_answers_the_openai_client_as_tp_1():
    import openai

    port = free_port()
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--port", str(port), "--dtype", "float64",
                             "--max-model-len", "64", "--max-num-seqs", "4", "--tensor-parallel-size", "2"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers: list[int] = []
    try:
        wait_until_healthy(proc, port, 180)
        workers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)
                   if "resource_tracker" not in " ".join(c.cmdline())]
        assert len(workers) == 2
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        texts = [client.completions.create(model="minillm", prompt=p, max_tokens=12, temperature=0).choices[0].text
                 for p in PROMPTS[:2]]
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    assert gone(workers)  # the server joined its workers on the way out
    want = LLM(dtype="float64", **SMALL).generate(PROMPTS[:2], SamplingParams(max_tokens=12, temperature=0.0),
                                                  use_tqdm=False)
    assert texts == [o.outputs[0].text for o in want] and all(texts)


def test_serve_flags_use_vllm_names():
    from minillm.cli import build_parser
    from minillm.server.serve import engine_knobs

    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
                                      "--distributed-executor-backend", "mp", "--enable-expert-parallel"])
    assert engine_knobs(args) == {"tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                                  "distributed_executor_backend": "mp", "enable_expert_parallel": True}
