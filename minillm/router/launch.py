"""`minillm router` and `minillm serve --data-parallel-size N`: start the router, and the replicas (chapter 13).

    minillm serve --data-parallel-size 2 --port 8000          # 2 engine processes + the router on :8000
    minillm router --worker http://127.0.0.1:8001 --worker http://127.0.0.1:8002 \\
        --policy cache_aware --cache-threshold 0.3 --port 8000
    minillm router --pd --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002   # PD mode (router/pd.py)

With `--data-parallel-size N` each replica is its own `python -m minillm serve` process on a free
loopback port, with the same engine flags, and `OMP_NUM_THREADS` = cores // N unless set (N
replicas then share the cores instead of fighting over them). The router starts once every
replica answers /health, on `--host`/`--port`; stopping it (Ctrl-C, SIGTERM) stops the replicas,
and on Linux a replica also gets SIGTERM if the launcher dies without cleaning up.

Flag names and meanings are SGLang's router's (`--policy`, `--cache-threshold`,
`--balance-abs-threshold`, `--balance-rel-threshold`, `--eviction-interval-secs`,
`--max-tree-size`, `--health-check-interval-secs`, ...), except `--worker` (one URL per flag).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from minillm.router.app import HealthConfig, Router, create_router_app
from minillm.router.policies import POLICIES, CacheAwareConfig, make_policy

_CACHE = CacheAwareConfig()
_HEALTH = HealthConfig()


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    """Routing and health flags, shared by `minillm router` and `minillm serve --data-parallel-size`."""
    p.add_argument("--policy", default="cache_aware", choices=POLICIES, help="how the router picks a worker")
    p.add_argument("--cache-threshold", type=float, default=_CACHE.cache_threshold,
                   help="cache_aware: min prefix match rate (0-1) to route by affinity")
    p.add_argument("--balance-abs-threshold", type=int, default=_CACHE.balance_abs_threshold,
                   help="cache_aware: imbalance needs max - min in-flight load above this ...")
    p.add_argument("--balance-rel-threshold", type=float, default=_CACHE.balance_rel_threshold,
                   help="... and max load above this times min load; then least-loaded wins")
    p.add_argument("--eviction-interval-secs", type=float, default=_CACHE.eviction_interval_secs,
                   help="cache_aware: seconds between LRU evictions of the tree")
    p.add_argument("--max-tree-size", type=int, default=_CACHE.max_tree_size,
                   help="cache_aware: characters per worker the tree keeps after an eviction")
    p.add_argument("--health-check-interval-secs", type=float, default=_HEALTH.health_check_interval_secs)
    p.add_argument("--health-check-timeout-secs", type=float, default=_HEALTH.health_check_timeout_secs)
    p.add_argument("--health-failure-threshold", type=int, default=_HEALTH.health_failure_threshold,
                   help="failed checks in a row before a worker gets no traffic")
    p.add_argument("--health-success-threshold", type=int, default=_HEALTH.health_success_threshold,
                   help="passed checks in a row before an unhealthy worker gets traffic again")
    p.add_argument("--request-timeout-secs", type=float, default=_HEALTH.request_timeout_secs)


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker", action="append", metavar="URL",
                   help="a worker's root URL, e.g. http://127.0.0.1:8001 (repeat for each)")
    p.add_argument("--pd", action="store_true",
                   help="prefill/decode mode: each request goes to --prefill, then to --decode (minillm.router.pd)")
    p.add_argument("--prefill", metavar="URL", help="with --pd: the prefill instance (kv_role kv_producer)")
    p.add_argument("--decode", metavar="URL", help="with --pd: the decode instance (kv_role kv_consumer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--uvicorn-log-level", default="warning")
    add_policy_arguments(p)


def router_configs(args: argparse.Namespace) -> tuple[CacheAwareConfig, HealthConfig]:
    """The policy's and the health checker's settings from the flags, checked (a ValueError names the flag)."""
    cache = CacheAwareConfig(args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold,
                             args.eviction_interval_secs, args.max_tree_size)
    cache.validate()
    health = HealthConfig(args.health_check_interval_secs, args.health_check_timeout_secs,
                          args.health_failure_threshold, args.health_success_threshold, args.request_timeout_secs)
    for name in ("health_check_interval_secs", "health_check_timeout_secs", "request_timeout_secs"):
        if not getattr(health, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(health, name)}")
    for name in ("health_failure_threshold", "health_success_threshold"):
        if getattr(health, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(health, name)}")
    return cache, health


def build_router(args: argparse.Namespace, worker_urls: list[str]) -> Router:
    cache, health = router_configs(args)
    return Router(worker_urls, make_policy(args.policy, cache), health)


def listening_socket(host: str, port: int) -> socket.socket:
    """Bound and listening before uvicorn starts, so that a client who read the printed URL is queued in the
    backlog until the app is up rather than refused; TCP_NODELAY so that a streamed chunk is not held back."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def serve_router(router: Router, host: str, port: int, log_level: str = "warning") -> None:
    import uvicorn

    sock = listening_socket(host, port)
    print(f"minillm router: http://{host}:{sock.getsockname()[1]}/v1 -> {router.describe()}", flush=True)
    # (no access log below level info, no X-Forwarded-* parsing: the router reads no client address)
    server = uvicorn.Server(uvicorn.Config(create_router_app(router), log_level=log_level, lifespan="on",
                                           access_log=log_level in ("info", "debug", "trace"), proxy_headers=False))
    server.run(sockets=[sock])


POLICY_FLAGS = ("--policy", "--cache-threshold", "--balance-abs-threshold", "--balance-rel-threshold",
                "--eviction-interval-secs", "--max-tree-size")


def refuse_policy_flags(argv: list[str], mode: str) -> None:
    """PD mode has no choice of worker to make: a routing-policy flag given there is refused, not ignored."""
    given = sorted({token.split("=", 1)[0] for token in argv} & set(POLICY_FLAGS))
    if given:
        raise ValueError(f"{mode} sends each request to its prefill and then its decode instance: {given} choose "
                         f"among replicas and do not apply there; leave them out (health flags do apply)")


def build_pd_router(args: argparse.Namespace):
    """`minillm router --pd`: one prefill and one decode instance behind the router (minillm/router/pd.py)."""
    from minillm.router.pd import PDRouter

    refuse_policy_flags(getattr(args, "argv", []), "--pd")
    if args.worker:
        raise ValueError("--pd takes --prefill URL and --decode URL, not --worker")
    if not args.prefill or not args.decode:
        raise ValueError("--pd needs both --prefill URL and --decode URL")
    _, health = router_configs(args)
    return PDRouter(args.prefill, args.decode, health)


def run_router(args: argparse.Namespace) -> int:
    if args.pd:
        router = build_pd_router(args)
    elif args.prefill or args.decode:
        raise ValueError("--prefill and --decode need --pd (prefill/decode mode)")
    elif not args.worker:
        raise ValueError("give the workers: --worker URL (repeat for each), or --pd --prefill URL --decode URL")
    else:
        router = build_router(args, args.worker)
    serve_router(router, args.host, args.port, args.uvicorn_log_level)
    return 0


# ---- data parallel ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child before exec (Linux): SIGTERM when the launcher dies
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def start_replicas(serve_argv: list[str], n: int, startup_timeout_s: float = 300.0,
                   per_replica_argv: list[list[str]] | None = None) -> list[tuple[subprocess.Popen, str]]:
    """N `minillm serve` processes on free loopback ports, each answering /health; or none (all stopped).
    `per_replica_argv[i]` is added to replica i's flags (the PD pair's two --kv-transfer-config)."""
    import httpx

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    procs: list[tuple[subprocess.Popen, str]] = []
    try:
        for i in range(n):
            port = free_port()
            own = per_replica_argv[i] if per_replica_argv else []
            cmd = [sys.executable, "-m", "minillm", "serve", *serve_argv, *own, "--host", "127.0.0.1",
                   "--port", str(port)]
            proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            procs.append((proc, f"http://127.0.0.1:{port}"))
        deadline = time.monotonic() + startup_timeout_s
        for proc, url in procs:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"replica {url} exited with code {proc.returncode} while starting")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"replica {url} did not answer /health within {startup_timeout_s:.0f} s")
                time.sleep(0.2)
    except BaseException:
        stop_replicas(procs)
        raise
    return procs


def stop_replicas(procs: list[tuple[subprocess.Popen, str]], timeout_s: float = 15.0) -> None:
    for proc, _ in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc, _ in procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)


def run_data_parallel(args: argparse.Namespace, serve_argv: list[str]) -> int:
    n = args.data_parallel_size
    if n < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {n}")
    router_configs(args)  # a bad flag fails before any replica starts
    try:
        procs = start_replicas(serve_argv, n)
    except RuntimeError as err:
        print(f"minillm serve: error: {err}", file=sys.stderr)
        return 1
    return serve_in_front_of(procs, lambda: build_router(args, [url for _, url in procs]), args)


def serve_in_front_of(procs: list[tuple[subprocess.Popen, str]], make_router, args: argparse.Namespace) -> int:
    """Serve `make_router()` on `--host`/`--port` until Ctrl-C or SIGTERM, then stop `procs` (the replicas
    or the PD pair the launcher started), whatever happened."""

    def on_term(signum, frame):  # uvicorn handles SIGINT; SIGTERM from a supervisor stops the replicas too
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        serve_router(make_router(), args.host, args.port, args.uvicorn_log_level)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_replicas(procs)
    return 0
