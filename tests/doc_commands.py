"""The commands and snippets of README.md and docs/*.md, found and run as a reader would (issue 31).

Why our own runner: the well-kept tools for documentation tests (Sybil, pytest-examples,
pytest-markdown-docs) run Python blocks; our pages are mostly shell — servers started in the
background, a client against them, a command whose printed output the page quotes. This module
splits each fenced `bash` block into commands (quote-aware: a newline inside quotes or after `\\`
continues a command, `&` sends one to the background, `#` starts a comment), and a table below says
what CI does with each one, keyed by how the command starts:

- RUN: run as written (from the repository root, the course's environment first on PATH);
- SERVE: a server that runs until stopped: start it, wait for `/health` on its port, stop it —
  or, for KEEP (and for a command the page sends to the background with `&`), keep it up until
  the block's last command has run;
- SMALL: run with the page's options swapped for smaller ones (the same command, less load);
- START: a process that serves nothing to wait for (a `--headless` node of a multi-node world):
  started, not waited for, stopped with what it started when the block ends;
- SKIP: with the reason.

A fenced command that the table does not know fails the test: a new documented command needs a
decision. So does a `python ...` command quoted inline in prose (`python bench/x.py --flag`,
`NUMBA_ENABLE_CUDASIM=1 python -c "..."`): INLINE_DECISIONS runs it as written, with smaller options
(a timing bench: every part of it runs, on a few requests), or skips it with the reason. Every inline
command's script or module must also exist and name each flag; `minillm SUB --flag` in prose, mostly a
subcommand named mid-sentence, is checked against `minillm SUB --help`. A documented command must not
leave a file that git would see in the repository's root, bench/ or docs/ (benches write under the
git-ignored bench/results/).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass
class Command:
    text: str  # as the page writes it, continuations joined
    background: bool  # ended by `&`


@dataclass
class Block:
    page: str  # path relative to the repository root
    line: int  # where the block starts
    language: str
    body: str
    quoted_output: str | None = None  # an untagged block right after it: what the page says it prints
    commands: list[Command] = field(default_factory=list)
    end_offset: int = 0  # where the block ends in the page


def split_commands(script: str) -> list[Command]:
    """Shell commands of `script`: newlines and `&` outside quotes end one (`&&` does not)."""
    commands, current, quote, i = [], [], None, 0
    while i < len(script):
        ch = script[i]
        if quote:
            if ch == "\\" and quote == '"' and i + 1 < len(script):
                current.append(script[i : i + 2])
                i += 2
                continue
            if ch == quote:
                quote = None
            current.append(ch)
        elif ch in "'\"":
            quote = ch
            current.append(ch)
        elif ch == "\\" and script[i + 1 : i + 2] == "\n":
            current.append(" ")
            i += 2
            continue
        elif ch == "#" and (not current or current[-1] in " \t\n"):
            while i < len(script) and script[i] != "\n":
                i += 1
            continue
        elif ch == "&" and script[i + 1 : i + 2] != "&" and (not current or current[-1] != "&"):
            commands.append(Command(" ".join("".join(current).split()), True))
            current = []
        elif ch == "\n":
            commands.append(Command("".join(current).strip(), False))
            current = []
        else:
            current.append(ch)
        i += 1
    commands.append(Command("".join(current).strip(), False))
    return [c for c in commands if c.text]


FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)


def blocks_of(page: Path) -> list[Block]:
    text = page.read_text()
    found: list[Block] = []
    for m in FENCE.finditer(text):
        language, body = m.group(1), m.group(2)
        line = text.count("\n", 0, m.start()) + 1
        if language == "" and found and not text[found[-1].end_offset : m.start()].strip() and \
                found[-1].language in ("bash", "python"):
            found[-1].quoted_output = body
            continue
        block = Block(str(page.relative_to(ROOT)), line, language, body, end_offset=m.end())
        if language in ("bash", "sh", "shell"):
            block.commands = split_commands(body)
        found.append(block)
    return found


INLINE = re.compile(r"`((?:[A-Z][A-Z0-9_]*=\S+ )*(?:python3?|minillm) [^`]+)`")
ENV_PREFIX = re.compile(r"^((?:[A-Z][A-Z0-9_]*=\S+ )*)")


def inline_commands(page: Path) -> list[str]:
    """Commands quoted inline in a page's prose (fenced blocks excluded), `VAR=value` prefixes kept."""
    text = FENCE.sub("", page.read_text())
    return [" ".join(m.group(1).split()) for m in INLINE.finditer(text.replace("\n", " "))]


def split_env(command: str) -> tuple[dict[str, str], str]:
    """(`VAR=value` assignments in front of a command, the command after them)."""
    prefix = ENV_PREFIX.match(command).group(1)
    return dict(word.split("=", 1) for word in prefix.split()), command[len(prefix):]


# ---- what CI does with each documented command ---------------------------------------------------
RUN, SERVE, KEEP, SMALL, SKIP, START = "run", "serve", "keep", "small", "skip", "start"

# (how the command starts, decision, detail): the first entry whose start matches wins. For SMALL
# the detail is a list of (option as written, smaller option); for SKIP it is the reason.
DECISIONS: list[tuple[str, str, object]] = [
    # docs/multinode.md and README: a world across nodes (issue 28)
    ("minillm serve models/minillm-target --tensor-parallel-size 2 --pipeline-parallel-size 2 --nnodes 2", SKIP,
     "two machines (10.0.0.1 is the head's address); the page's loopback block runs the same world on one"),
    ("minillm serve --pipeline-parallel-size 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1", SKIP,
     "two hosts (10.0.0.1 is the head's address); docs/multinode.md's loopback block runs the same world on one"),
    ("minillm serve --tensor-parallel-size 1 --pipeline-parallel-size 2 --nnodes 2 --node-rank 1", START, None),
    ("make lab", SKIP, "JupyterLab runs until stopped; tests/test_lab.py and tests/test_browser.py start it"),
    ("make test", SKIP, "this is the test suite that runs this test"),
    ("source .venv/bin/activate", RUN, None),
    # docs/multinode.md: one host under torchrun runs; the commands for other hosts (10.0.0.x are the page's
    # example addresses) are run on this host's address by the tests named
    ("torchrun --standalone --nproc-per-node 2 -m minillm generate", RUN, None),
    ("torchrun --nnodes 2", SKIP, "one command per host (10.0.0.x: example addresses); "
                                  "tests/test_external_launcher.py runs two such nodes on this host's address"),
    ("minillm serve --host 0.0.0.0", SKIP, "a server for other hosts to reach (10.0.0.x: example addresses); "
                                           "tests/test_cross_host.py starts the same commands on this host's address"),
    ("minillm router --worker http://10.0.0.", SKIP, "replicas on other hosts (example addresses); tests/test_cross_host.py "
                                                     "runs the router so in front of two servers on this host's address"),
    ("minillm router --pd --prefill http://10.0.0.", SKIP, "a PD pair on other hosts (example addresses); "
                                                           "tests/test_cross_host.py runs it on this host's address"),
    ("minillm generate", RUN, None),
    ("minillm simulate", RUN, None),
    ("make serve", SERVE, None),
    ("minillm serve --data-parallel-size 2", SERVE, None),
    ("minillm serve --pd-disaggregation", SERVE, None),
    ("minillm serve --tensor-parallel-size 2 --pipeline-parallel-size 2", SERVE, None),
    ("minillm router --worker URL", SKIP, "URL is a placeholder; docs/router.md's block runs the router "
                                          "in front of two real servers"),
    ("minillm router --pd --prefill http://127.0.0.1:8001", KEEP, None),
    ("minillm router --worker http://127.0.0.1:8001", SERVE, None),
    ("minillm serve --port 8001 --max-num-seqs 16 --enable-prefix-caching", SERVE, None),
    ("minillm serve", SERVE, None),
    ("python -m minillm serve", SERVE, None),
    ("minillm bench serve", SMALL, [("--num-prompts 200", "--num-prompts 6"), ("--num-prompts 64", "--num-prompts 6"),
                                    ("--num-prompts 40", "--num-prompts 4")]),
    ("python3 -m venv /work/aux-venv", SKIP, "installs aiperf from PyPI into a separate venv: a peer tool, "
                                              "never installed by CI"),
    ("env -u HF_HUB_OFFLINE /work/aux-venv/bin/aiperf", SKIP, "aiperf is not installed by CI (see above)"),
    ("python -c", RUN, None),
    ("curl -sS --fail-with-body http://127.0.0.1:8000/v1/", RUN, None),  # after a server the block keeps up (&)
    ("python bench/llamacpp.py", SKIP, "builds llama-cpp-python from source into its own venv (minutes) and "
                                       "times it: a peer never installed by CI"),
    # docs/engine.md: the step profile's small batches (one batch size, one round: every part of it runs)
    ("python bench/step_profile.py --batch-sizes 1 2 4 8 16 --compare", SMALL,
     [("--batch-sizes 1 2 4 8 16 --compare", "--batch-sizes 1 --compare --rounds 1")]),
    ("python bench/step_profile.py --batch-sizes 1 2 4 8", SMALL, [("--batch-sizes 1 2 4 8", "--batch-sizes 1")]),
    # docs/bench-serve.md: a stub server whose TTFT and TPOT are known (serves until stopped)
    ("python -m minillm.benchmark.stub_server --port 8000", SERVE, None),
]

# Python blocks: the start of the block -> what it needs first (a server command), or None.
PYTHON_BLOCKS: list[tuple[str, str | None]] = [
    ("from minillm import LLM, SamplingParams", None),
    ("import openai", "minillm serve --port 8000"),
    ("import torch", None),  # docs/engine.md's "adding an attention backend" example, run as written
]


# `make X` in prose that is not one of the Makefile's targets, on purpose.
NOT_MAKE_TARGETS = {"reset": "docs/lab.md: the alternative to a workspace copy it argues against"}


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


def inline_make_targets(page: Path) -> list[str]:
    """X of each `make X ...` quoted in a page's prose (fenced blocks excluded)."""
    return re.findall(r"`make ([a-z][\w-]*)[^`]*`", FENCE.sub("", page.read_text()))


# Scripts that hand options they do not know on to another program (so the flag check skips them).
PASSES_OPTIONS_ON = {"tools/lab.py": "extra options go to `jupyter lab`"}


def decide(command: str) -> tuple[str, object]:
    """What CI does with a documented command (`.venv/bin/minillm` is read as `minillm`)."""
    command = re.sub(r"(?<![\w/])\.venv/bin/(?=minillm|python)", "", command)
    for start, what, detail in DECISIONS:
        if command.startswith(start):
            return what, detail
    raise LookupError(command)


def port_of(command: str) -> int:
    m = re.search(r"--port[ =](\d+)", command)
    return int(m.group(1)) if m else 8000


# ---- what CI does with each `python ...` command quoted inline in prose --------------------------
# (`minillm SUB --flag` in prose names a subcommand and its flags, mostly mid-sentence: checked against
# `minillm SUB --help`. A `python` command in prose is a command a reader copies: it runs.)
# (how the command starts — or, ending in `$`, the whole command —, decision, detail): the first entry
# that matches wins. RUN: as written, detail None or the lines the page quotes from its output (each must
# be in it, runs of spaces read as one); SMALL: detail is the options appended (argparse keeps the last value of an option
# given twice); SKIP: the reason.
INLINE_DECISIONS: list[tuple[str, str, object]] = [
    # timing benches: their smallest documented options, or the fewest requests that exercise every part
    ("python bench/forward.py", SMALL, "--quick"),
    ("python bench/ladder.py", SMALL, "--num-requests 8 --repeats 1"),
    ("python bench/step_profile.py", SMALL, "--batch-sizes 16 --num-requests 12"),
    ("python bench/attention_backends.py", SMALL, "--num-requests 8 --repeats 1"),
    ("python bench/paged.py", SMALL, "--quick"),
    ("python bench/spec.py", SMALL, "--num-requests 2 --max-tokens 8"),
    ("python bench/spec_batch1.py", SMALL, "--repeats 1 --num-prompts 1 --max-tokens 8"),
    ("python bench/chunked.py", SMALL, "--num-requests 6 --budgets 0 32"),
    ("python bench/threads.py", SMALL, "--dtypes float32 --decode-rows 8 --prefill-tokens 64 --max-threads 2 "
                                       "--rounds 1 --steps 2"),
    ("python bench/parallel_steps.py", SMALL, "--repeats 1 --num-prompts 2 --max-tokens 4"),
    ("python bench/kv_quality.py", SMALL, "--texts 1 --tokens 80"),
    ("python bench/offload.py", SMALL, "--requests 40 --tenants 8"),
    # deterministic: run as written
    ("python bench/kv_capacity.py --sim-only", RUN, None),
    ("python -m minillm.sim.chunking", RUN, None),
    ("python -m minillm.kernels.ptx", RUN, None),
    ("NUMBA_ENABLE_CUDASIM=1 python bench/gpu.py --dry-run", RUN, None),
    ("NUMBA_ENABLE_CUDASIM=1 python -c", RUN, None),
    ("python tools/check_prose.py", RUN, None),
    # skipped, with the reason
    ("python bench/repeat.py", SKIP, "runs a bench three times over (minutes to an hour); "
                                     "tests/test_bench_repeat.py tests it, and each bench it repeats runs above"),
    ("python -m minillm.sim.goodput", SKIP, "minutes of CPU (each deployment's goodput is a bisection over "
                                            "simulations); tests/test_sim_disagg.py runs the same functions on small traces"),
    ("python bench/router.py", SKIP, "starts 2-4 servers and loads them for minutes; tests/test_router.py, "
                                     "tests/test_router_hops.py and tests/test_router_policies.py run its parts"),
    ("python bench/pd.py", SKIP, "starts a PD pair and a colocated server and loads them for minutes; tests/test_pd.py"),
    ("python bench/llamacpp.py", SKIP, "builds llama-cpp-python from source into its own venv (minutes) and "
                                       "times it: a peer never installed by CI; tests/test_bench_llamacpp.py"),
    ("python tools/distill_draft.py", SKIP, "trains the committed draft for 22 minutes and rewrites models/; "
                                            "tests/test_bundled_models.py checks the draft it made"),
    ("python bench/gpu_smoke.py", SKIP, "needs a GPU (on a CPU it compares the CPU with itself)"),
    ("python bench/gpu.py", SKIP, "needs a GPU; its CPU check (NUMBA_ENABLE_CUDASIM=1 ... --dry-run) runs"),
    ("python -m minillm.benchmark.stub_server --host A", SKIP, "A is a placeholder for a host's address"),
    ("python tools/lab.py --port", SKIP, "JupyterLab runs until stopped; tests/test_lab.py starts it"),
    ("python tools/lab.py --reset", SKIP, "replaces the reader's own workspace copy; tests/test_lab.py "
                                          "resets a copy in a temporary course"),
    ("python tools/grade.py path/to/", SKIP, "path/to/... is a placeholder"),
    ("python tools/grade.py workspace/", SKIP, "grades the reader's workspace copy (made by make lab); "
                                               "tests/test_grading*.py grade the same notebooks"),
    ("python tools/check_claims.py chapters/NN_", SKIP, "NN is a placeholder; tests/test_prose_claims.py "
                                                       "checks every chapter"),
    ("python tests/test_grading_copies.py", SKIP, "the test module itself, which CI runs under pytest; as a script "
                                                   "it prints the closest approaches the page quotes"),
    ("python -m minillm serve$", SKIP, "prose naming the process each replica runs; docs/server.md's block "
                                        "starts `python -m minillm serve`"),
    ("python -c$", SKIP, "prose naming a way to run Python (`a python -c`), not a command"),
]


def decide_inline(command: str) -> tuple[str, object]:
    """What CI does with a `python ...` command quoted in prose."""
    for start, what, detail in INLINE_DECISIONS:
        if command == start[:-1] if start.endswith("$") else command.startswith(start):
            return what, detail
    # no entry for its environment prefix (`OMP_WAIT_POLICY=PASSIVE python bench/x.py`): the command's own decision
    bare = re.sub(r"^(?:[A-Z][A-Z0-9_]*=\S+ )+", "", command)
    if bare != command:
        return decide_inline(bare)
    raise LookupError(command)
