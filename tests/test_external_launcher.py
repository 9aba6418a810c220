"""`distributed_executor_backend="external_launcher"`: the engine under torchrun (issue 28, item 2).

Slow part (two tests, marked slow, in the "distributed" xdist group; each starts torchrun and
loads the bundled model in every rank — about a minute each on a busy 2-core machine, so CI pays
two launches, not one per case):
- `torchrun --nproc-per-node 2 tests/torchrun_script.py 2x1 1x2 --mismatch --out=DIR`: one process per rank,
  TP 2 and then PP 2 in the same processes (the second engine joins the world the first joined),
  with a pool small enough that requests are preempted; every rank returns the one-process greedy
  tokens, and the same seeded tokens as every other rank; ranks given different prompts stop with
  an error naming the step and the ranks, instead of pairing mismatched collectives.
- two torchrun commands as two "nodes" (`--nnodes 2 --node-rank 0/1 --master-addr A`), A this
  host's non-loopback address where it has one, PP 2 across them: both ranks return the
  one-process tokens, and their gloo sockets used the interface that holds A (a rank that
  advertised the host name's loopback address would be unreachable from a real second host).
Both count the processes they started (none is left) and bound every wait (no hang).

Fast part: the errors a user meets (no torchrun environment, a world of the wrong size, an unknown
backend, a server asked to run under torchrun) and the plan fingerprint the ranks compare.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import psutil
import pytest

from minillm import LLM
from minillm.config import EngineConfig
from minillm.distributed.host_address import interface_with_address
from minillm.executor.external_launcher import launcher_rank, plan_fingerprint
from minillm.scheduler.output import SchedulerOutput

sys.path.insert(0, str(Path(__file__).parent))
from torchrun_script import GREEDY, KNOBS, PROMPTS, SEEDED  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "torchrun_script.py"
RUN_TIMEOUT_S = 420.0


def host_address() -> str:
    """A non-loopback IPv4 address of this host (a hard-coded 127.0.0.1 then cannot pass), else 127.0.0.1."""
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return "127.0.0.1"


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def one_process_tokens() -> list[list[int]]:
    """The greedy tokens of the script's first two prompts from one process, with its knobs (so with preemption)."""
    llm = LLM(**KNOBS)
    outs = llm.generate(PROMPTS, [GREEDY, GREEDY, SEEDED], use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    return [list(o.outputs[0].token_ids) for o in outs[:2]]


def torchrun(launcher_args: list[str], script_args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("GLOO_SOCKET_IFNAME", None)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launcher_args, str(SCRIPT),
                             *script_args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    """Its exit code and output; on a timeout the whole session is killed and the test fails."""
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"torchrun {proc.args[3:]} did not finish within {RUN_TIMEOUT_S:.0f} s:\n{out[-3000:]}")
    return proc.returncode, out


def left_behind(procs: list[subprocess.Popen]) -> list[int]:
    sessions = {p.pid for p in procs}
    left = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) in sessions:
                left.append(p.pid)
        except (ProcessLookupError, PermissionError):
            pass
    return left


def results(out_dir: Path) -> list[dict]:
    """What the ranks recorded, each in its own file."""
    return [json.loads(line) for f in sorted(out_dir.glob("rank*.jsonl")) for line in f.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.xdist_group("distributed")
def test_torchrun_two_processes_tp2_then_pp2_match_one_process(tmp_path):
    want = one_process_tokens()
    proc = torchrun(["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port("127.0.0.1"))],
                    ["2x1", "1x2", "--mismatch", f"--out={tmp_path}"])
    code, out = finish(proc)
    assert not left_behind([proc])
    lines = results(tmp_path)
    runs = [r for r in lines if "tokens" in r]
    assert sorted((r["tp"], r["pp"], r["rank"]) for r in runs) == [(1, 2, 0), (1, 2, 1), (2, 1, 0), (2, 1, 1)], out[-3000:]
    for r in runs:
        assert r["tokens"] == want, (r, want)
        assert r["preemptions"] > 0, r  # the pool is small: the ranks' schedulers agreed through preemption too
    assert len({json.dumps(r["seeded"]) for r in runs}) == 1  # the sampling rank's tokens on every rank
    mismatches = [r["mismatch"] for r in lines if "mismatch" in r]
    assert len(mismatches) == 2 and all(
        m and "EngineDeadError: the ranks planned different steps" in m and "[[0], [1]]" in m for m in mismatches), out[-3000:]
    assert code == 0, out[-3000:]


@pytest.mark.slow
@pytest.mark.xdist_group("distributed")
def test_torchrun_two_nodes_on_this_host_pp2_match_one_process(tmp_path):
    want = one_process_tokens()
    master = host_address()
    port = str(free_port(master))
    nodes = [torchrun(["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr", master,
                       "--master-port", port], ["1x2", f"--out={tmp_path}"]) for node in (0, 1)]
    finished = [finish(node) for node in nodes]
    assert not left_behind(nodes)
    for code, out in finished:
        assert code == 0, out[-3000:]
    runs = results(tmp_path)
    assert sorted(r["rank"] for r in runs) == [0, 1]
    for r in runs:
        assert (r["tp"], r["pp"], r["tokens"]) == (1, 2, want), r
        assert r["gloo_interface"] == interface_with_address(master), (r, master)


# ---- the errors a user meets, without processes ---------------------------------------------------------
def test_without_torchrun_the_error_says_how_to_launch(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT is not set: start "
                                         r"the script with `torchrun --nproc-per-node 2 script.py`"):
        LLM(tensor_parallel_size=2, distributed_executor_backend="external_launcher", max_model_len=64)


def test_a_world_of_the_wrong_size_is_refused(monkeypatch):
    for name, value in dict(RANK="0", WORLD_SIZE="3", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=3 processes, but tensor_parallel_size × pipeline_parallel_size"
                                         r" = 4"):
        launcher_rank(4)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    assert launcher_rank(4) == 2


def test_backend_names_are_checked():
    with pytest.raises(ValueError, match=r"distributed_executor_backend='torchrun'; choose one of "
                                         r"\('uni', 'mp', 'external_launcher'\)"):
        EngineConfig(distributed_executor_backend="torchrun")
    with pytest.raises(ValueError, match=r"'uni' runs one process.*'external_launcher' under torchrun"):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match=r"kv_transfer_config makes a server one half"):
        EngineConfig(distributed_executor_backend="external_launcher",
                     kv_transfer_config={"kv_connector": "TorchDistConnector", "kv_role": "kv_producer"})
    assert EngineConfig(tensor_parallel_size=2, distributed_executor_backend="external_launcher").executor_backend \
        == "external_launcher"


def test_a_server_is_not_run_under_torchrun():
    import argparse

    from minillm.server.serve import add_serve_arguments, build_app

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args: Namespace = parser.parse_args(["--distributed-executor-backend", "external_launcher"])
    with pytest.raises(ValueError, match=r"external_launcher makes every process .* use mp"):
        build_app(args)


def test_plan_fingerprint_tells_plans_apart():
    def plan(tokens: int, req: str = "0") -> SchedulerOutput:
        return SchedulerOutput(new_requests=[], req_ids=[req, "1"], num_scheduled_tokens=[tokens, 1],
                               num_computed_tokens=[0, 7], new_token_ids=[[5] * tokens, [9]], is_decode=[False, True],
                               samples=[True, True])

    assert plan_fingerprint(plan(3)) == plan_fingerprint(plan(3))
    assert len({plan_fingerprint(plan(3)), plan_fingerprint(plan(4)), plan_fingerprint(plan(3, "2"))}) == 3
    assert 0 <= plan_fingerprint(plan(3)) < 2**56  # fits the int64 the ranks gather
