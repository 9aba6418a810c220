"""The script tests/test_external_launcher.py starts under torchrun: what a user's script would be.

    torchrun --nproc-per-node 2 tests/torchrun_script.py 2x1 1x2 --mismatch --out=DIR

Each argument TPxPP builds `LLM(..., distributed_executor_backend="external_launcher")` in turn (in
one process, one after another: the second joins the world the first joined) and prints one JSON
record per rank: {"rank", "tp", "pp", "tokens": [greedy ids per prompt], "seeded": [...], "preemptions",
"gloo_interface": the interface its gloo sockets used}. `--mismatch` then gives each rank a
different prompt on the last engine and records what it raised ({"rank", "mismatch": message}).
Each rank writes its lines to DIR/rank{RANK}.jsonl (its own file: ranks that share torchrun's
stdout may interleave their writes). The test imports PROMPTS and GREEDY from here for its
one-process reference.
"""

import json
import os
import sys

from minillm import LLM, SamplingParams

PROMPTS = ["In the beginning God created the heaven and the earth.", "Blessed are the meek",
           "And God said, Let there be light"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.9, top_k=20, seed=5, ignore_eos=True)
KNOBS = dict(max_num_seqs=4, max_model_len=64, block_size=4, num_kv_blocks=16)  # small: requests are preempted


def main(argv: list[str]) -> None:
    rank = int(os.environ["RANK"])
    out_dir = next(a.split("=", 1)[1] for a in argv if a.startswith("--out="))

    def report(record: dict) -> None:
        with open(os.path.join(out_dir, f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    llm = None
    for shape in [a for a in argv if not a.startswith("--")]:
        tp, pp = (int(n) for n in shape.split("x"))
        llm = LLM(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                  distributed_executor_backend="external_launcher", **KNOBS)
        outs = llm.generate(PROMPTS, [GREEDY, GREEDY, SEEDED], use_tqdm=False)
        ids = [list(o.outputs[0].token_ids) for o in outs]
        report({"rank": rank, "tp": tp, "pp": pp, "tokens": ids[:2], "seeded": ids[2],
                "preemptions": llm.engine.scheduler.num_preemptions,
                "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME")})
    if "--mismatch" in argv:
        try:
            llm.generate([PROMPTS[rank % len(PROMPTS)]], GREEDY, use_tqdm=False)
            report({"rank": rank, "mismatch": None})
        except Exception as error:  # noqa: BLE001 - printed for the test to read
            report({"rank": rank, "mismatch": f"{type(error).__name__}: {error}"})


if __name__ == "__main__":
    main(sys.argv[1:])
