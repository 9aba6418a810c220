"""Build the course's bundled mixture-of-experts model, models/minillm-moe/ (chapter 12 uses it).

Expert parallelism needs a model with experts. This script trains a tiny Mixtral (transformers'
`MixtralForCausalLM`: Llama attention, and in place of each MLP a router that sends every token to
its top 2 of 4 expert MLPs) on the same corpus and with the same tokenizer as the other bundled
models, reusing tools/train_bundled.py's data pipeline, optimizer and schedule:

    python tools/train_bundled_moe.py [--out models] [--minutes 4] [--threads 1]

Shapes are the draft's (hidden 64, 2 layers, 4 query heads, 2 KV heads) so that tensor parallelism
2 or 4 and expert parallelism 2 split it. The loss adds transformers' Switch-style load-balancing
term (router_aux_loss_coef) so that no expert is left idle: an idle expert would make expert
parallelism's all-to-all trivially one-sided. The tokenizer is copied from models/minillm-target
(never retrained), and the results go into models/README.md between the MoE section's markers.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train_bundled.py: spinning OpenMP waits

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, MixtralForCausalLM  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402  (sibling scripts, not installed packages)
import train_bundled as tb  # noqa: E402

NAME = "minillm-moe"
SECTION_BEGIN = tb.MOE_SECTION_MARKER
SECTION_END = "<!-- end of the section written by tools/train_bundled_moe.py -->"
HISTOGRAM_PROMPTS = tb.SAMPLE_PROMPTS + ["Thou shalt not", "And it came to pass"]


def moe_config(aux_loss_coef: float) -> MixtralConfig:
    return MixtralConfig(
        vocab_size=4096,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,  # per expert; two experts per token: 256 active, the draft has 192
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=aux_loss_coef,
        router_jitter_noise=0.0,
        sliding_window=None,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=corpus.SPECIAL_TOKENS.index(corpus.BOS),
        eos_token_id=corpus.SPECIAL_TOKENS.index(corpus.EOS),
        pad_token_id=corpus.SPECIAL_TOKENS.index(corpus.PAD),
    )


def losses(model: MixtralForCausalLM, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token cross-entropy, load-balancing loss) on windows of seq_len + 1 tokens."""
    out = model(input_ids=batch[:, :-1], output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())
    return ce, out.aux_loss


def train(model: MixtralForCausalLM, train_ids: torch.Tensor, heldout: torch.Tensor, args) -> dict:
    """tools/train_bundled.py's loop (same schedule, optimizer, batches), plus the router's aux loss."""
    budget_s = args.minutes * 60

    def progress(step: int, elapsed_s: float) -> float:
        return step / args.steps if args.steps else elapsed_s / budget_s

    optimizer = tb.make_optimizer(model, args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    recent: list[float] = []
    step, tenths, start = 0, 0, time.perf_counter()
    while progress(step, time.perf_counter() - start) < 1.0:
        batch = tb.sample_batch(train_ids, args.batch_size, args.seq_len, gen)
        lr = tb.lr_at(step, progress(step, time.perf_counter() - start), args.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            ce, aux = losses(model, batch)
        (ce + model.config.router_aux_loss_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        recent = (recent + [ce.item()])[-20:]
        step += 1
        elapsed = time.perf_counter() - start
        if int(progress(step, elapsed) * 10) > tenths:
            tenths = int(progress(step, elapsed) * 10)
            tb.log(
                f"{NAME} step {step}  lr {lr:.2e}  train {sum(recent) / len(recent):.3f}  aux {aux.item():.3f}  "
                f"{step * args.batch_size * args.seq_len / elapsed:.0f} tok/s  {elapsed:.0f}s"
            )
    wall_s = time.perf_counter() - start
    return {
        "steps": step,
        "tokens_seen": step * args.batch_size * args.seq_len,
        "train_loss": sum(recent) / len(recent),
        "heldout_loss": tb.heldout_loss(model, heldout, args.seq_len),
        "wall_s": wall_s,
    }


@torch.no_grad()
def expert_histogram(model_dir: Path, prompts: list[str]) -> list[list[int]]:
    """Tokens routed to each expert, per layer, over the prompts (each token counts top_k times)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    cfg = model.config
    counts = torch.zeros(cfg.num_hidden_layers, cfg.num_local_experts, dtype=torch.long)
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        router_logits = model(input_ids=ids, output_router_logits=True).router_logits
        for layer, logits in enumerate(router_logits):
            chosen = logits.topk(cfg.num_experts_per_tok, dim=-1).indices.flatten()
            counts[layer] += torch.bincount(chosen, minlength=cfg.num_local_experts)
    return counts.tolist()


def readme_section(config: MixtralConfig, result: dict, samples: dict, histogram, args, info: dict) -> str:
    num_params, active = info["num_params"], info["active_params"]
    lines = [
        SECTION_BEGIN,
        "## The mixture-of-experts model (`minillm-moe/`)",
        "",
        "A tiny Mixtral trained by `tools/train_bundled_moe.py` for chapter 12's expert parallelism,"
        " on the same corpus with the target's tokenizer (copied, not retrained):",
        "",
        "| | minillm-moe |",
        "| --- | --- |",
        f"| parameters (total / active per token) | {num_params:,} / {active:,} |",
        f"| optimizer steps | {result['steps']:,} |",
        f"| batch (sequences x tokens) | {args.batch_size} x {args.seq_len} |",
        f"| peak learning rate | {args.lr:g} |",
        f"| load-balancing loss coefficient | {config.router_aux_loss_coef:g} |",
        f"| tokens seen | {result['tokens_seen']:,} |",
        f"| final training loss (cross-entropy, mean of last 20 steps) | {result['train_loss']:.3f} |",
        f"| held-out loss | {result['heldout_loss']:.3f} |",
        f"| held-out perplexity | {math.exp(result['heldout_loss']):.1f} |",
        f"| training wall time | {result['wall_s'] / 60:.1f} min |",
        f"| mean throughput | {result['tokens_seen'] / result['wall_s']:,.0f} tokens/s |",
        "",
        f"- MixtralForCausalLM: hidden {config.hidden_size}, {config.num_hidden_layers} layers,"
        f" {config.num_attention_heads} heads, {config.num_key_value_heads} KV heads,"
        f" {config.num_local_experts} experts of intermediate {config.intermediate_size}, top"
        f" {config.num_experts_per_tok} (softmax over the 4 router logits, top 2 renormalised to sum 1),"
        f" vocab {config.vocab_size}, tied embeddings, RoPE theta {tb.rope_theta(config):g}, no sliding window.",
        "- Training as the others (AdamW, warmup + cosine, clipping 1.0, bf16 autocast"
        f" {'on' if args.bf16 else 'off'}, seed {args.seed}), plus the router's Switch-style"
        " load-balancing loss; the table's training loss is the cross-entropy alone.",
        f"- Tokens per expert over {len(HISTOGRAM_PROMPTS)} prompts ({', '.join(repr(p) for p in HISTOGRAM_PROMPTS)}),"
        " each token counted once per chosen expert:"
        + "".join(f" layer {i}: {row};" for i, row in enumerate(histogram)).rstrip(";")
        + ".",
        "",
        "Greedy samples (40 new tokens):",
        "",
    ]
    lines += tb.samples_and_build(samples, info["command"], info["total_min"], torch.get_num_threads())
    lines += [SECTION_END, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models"))
    parser.add_argument("--tokenizer-from", type=Path, default=Path("models/minillm-target"))
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=None, help="run this many steps instead of a time budget")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--aux-loss-coef", type=float, default=0.02)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-bf16", dest="bf16", action="store_false")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    script_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    text = corpus.load_corpus()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_from)
    train_ids = tb.pack_documents(text.train_docs, tokenizer)
    heldout = tb.pack_documents(text.heldout_docs, tokenizer)
    tb.log(f"{len(train_ids):,} training tokens, {len(heldout):,} held out")

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    config = moe_config(args.aux_loss_coef)
    model = MixtralForCausalLM(config)
    num_params = sum(p.numel() for p in model.parameters())
    per_expert = 3 * config.hidden_size * config.intermediate_size * config.num_hidden_layers
    idle = (config.num_local_experts - config.num_experts_per_tok) * per_expert
    tb.log(f"{NAME}: {num_params:,} parameters, {num_params - idle:,} active per token")

    result = train(model, train_ids, heldout, args)
    out_dir = args.out / NAME
    tb.save_model(model, args.tokenizer_from, out_dir)
    samples = tb.greedy_samples(out_dir)
    for prompt, continuation in samples.items():
        tb.log(f"sample: {prompt!r} -> {continuation!r}")
    histogram = expert_histogram(out_dir, HISTOGRAM_PROMPTS)
    tb.log(f"tokens per expert (per layer): {histogram}")
    info = {
        "num_params": num_params,
        "active_params": num_params - idle,
        "total_min": (time.perf_counter() - script_start) / 60,
        "command": " ".join(
            ["python", "tools/train_bundled_moe.py", *(argv if argv is not None else sys.argv[1:])]
        ),
    }
    section = readme_section(config, result, samples, histogram, args, info)
    tb.write_readme_section(args.out / "README.md", SECTION_BEGIN, SECTION_END, section)
    tb.log(f"done in {info['total_min']:.1f} min; wrote {out_dir} and {args.out / 'README.md'}")


if __name__ == "__main__":
    main()
