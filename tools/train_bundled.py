"""Build the course's bundled models: the tiny Llama target and its draft in models/ (chapter 00 uses them).

The course runs offline, so it cannot download a model; it ships two it trained itself, in HF format:

    models/minillm-target/   ~5 M parameters: the model every chapter serves
    models/minillm-draft/    ~0.4 M parameters, same tokenizer: the proposer for speculative decoding

(The third, models/minillm-moe/, a tiny Mixtral for expert parallelism, is built by
tools/train_bundled_moe.py from this script's helpers. The committed draft went on from this script's
to imitate the target: tools/distill_draft.py, run after this one.)

This script does the whole job end to end, seeded, on a laptop-class CPU in about half an hour:
fetch the public-domain corpus (tools/corpus.py), train a byte-level BPE tokenizer, train each model
with plain torch (AdamW, warmup + cosine LR), save them with `save_pretrained` (safetensors, float32)
and write models/README.md with what was done and how well it went.

    python tools/train_bundled.py [--out models] [--minutes-target 25] [--minutes-draft 5]

By default each model trains for its time budget: the cosine schedule runs on the fraction of the
budget spent, so a busy machine takes fewer steps instead of overrunning (a timed calibration proved
useless on a shared CPU whose speed varies threefold within minutes). The number of steps taken is
recorded in models/README.md; pass --steps-target / --steps-draft to run a fixed number instead,
with the schedule on the fraction of steps done. The initialisation and the data order depend only
on --seed.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# OpenMP threads that spin while waiting turn a shared CPU into a 6x slowdown (measured here: 410 vs
# 2500 tokens/s with another job running); passive waiting costs little on an idle machine. It must
# be set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402  (a sibling script, not an installed package)

SAMPLE_PROMPTS = ["The", "And the king said unto", "In the beginning"]
# models/README.md ends with a section that tools/train_bundled_moe.py writes; rewriting the README
# here keeps it (from this marker on).
MOE_SECTION_MARKER = "<!-- section written by tools/train_bundled_moe.py -->"


@dataclass
class ModelSpec:
    """What to build and how long to train it."""

    name: str
    config: LlamaConfig
    minutes: float
    steps: int | None  # None: train for `minutes` of wall-clock time
    batch_size: int
    peak_lr: float


@dataclass
class TrainResult:
    """What a training run measured, for the README."""

    num_params: int
    steps: int
    tokens_seen: int
    train_loss: float
    heldout_loss: float
    wall_s: float
    samples: dict[str, str] = field(default_factory=dict)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def llama_config(
    hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, tied: bool
) -> LlamaConfig:
    tok_ids = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    assert [corpus.BOS, corpus.EOS, corpus.PAD] == corpus.SPECIAL_TOKENS[:3]
    return LlamaConfig(
        vocab_size=4096,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,  # fewer KV heads than query heads: GQA
        intermediate_size=intermediate,
        tie_word_embeddings=tied,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        **tok_ids,
    )


def pack_documents(docs: list[str], tokenizer) -> torch.Tensor:
    """One long stream `<s> doc </s> <s> doc </s> ...`; the post-processor supplies the `<s>`."""
    eos_id = tokenizer.eos_token_id
    ids: list[int] = []
    for encoding in tokenizer(docs, verbose=False).input_ids:  # long chapters are fine: we cut windows
        ids.extend(encoding)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


WARMUP_STEPS = 30


def lr_at(step: int, progress: float, peak_lr: float) -> float:
    """Linear warmup over the first steps, then cosine decay to a tenth of the peak as progress -> 1.

    `progress` is the fraction of the run done (of its steps, or of its time budget).
    """
    if step < WARMUP_STEPS:
        return peak_lr * (step + 1) / WARMUP_STEPS
    progress = min(1.0, progress)
    return peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    # Weight decay on matrices only; norms' gains (1-D) would be dragged towards zero.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def next_token_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predicting batch[:, 1:] from batch[:, :-1] (the windows are seq_len + 1 long)."""
    logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def train_step(model, optimizer, batch: torch.Tensor, lr: float, bf16: bool) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    # bf16 autocast roughly doubles CPU throughput; the weights and optimizer state stay float32.
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = next_token_loss(model, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def sample_batch(stream: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """Random windows of seq_len + 1 tokens; the order depends only on the generator's seed."""
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=gen)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq_len: int) -> float:
    """Mean next-token loss over non-overlapping windows of the held-out chapters (float32)."""
    model.eval()
    num_windows = (len(stream) - 1) // seq_len
    losses = []
    for i in range(0, num_windows, 16):
        rows = range(i, min(i + 16, num_windows))
        batch = torch.stack([stream[r * seq_len : r * seq_len + seq_len + 1] for r in rows])
        losses.append(next_token_loss(model, batch).item())
    model.train()
    return sum(losses) / len(losses)


def train_model(
    spec: ModelSpec, train: torch.Tensor, heldout: torch.Tensor, args
) -> tuple[LlamaForCausalLM, TrainResult]:
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    model = LlamaForCausalLM(spec.config)  # float32 weights
    num_params = sum(p.numel() for p in model.parameters())
    log(f"{spec.name}: {num_params:,} parameters")
    budget_s = spec.minutes * 60

    def progress(step: int, elapsed_s: float) -> float:
        return step / spec.steps if spec.steps else elapsed_s / budget_s

    optimizer = make_optimizer(model, spec.peak_lr)
    gen = torch.Generator().manual_seed(args.seed)
    recent: list[float] = []
    step, tenths_reported, start = 0, 0, time.perf_counter()
    while progress(step, time.perf_counter() - start) < 1.0:
        batch = sample_batch(train, spec.batch_size, args.seq_len, gen)
        lr = lr_at(step, progress(step, time.perf_counter() - start), spec.peak_lr)
        recent = (recent + [train_step(model, optimizer, batch, lr, args.bf16)])[-20:]
        step += 1
        elapsed = time.perf_counter() - start
        if int(progress(step, elapsed) * 10) > tenths_reported:  # every tenth of the run
            tenths_reported = int(progress(step, elapsed) * 10)
            log(
                f"{spec.name} step {step}  lr {lr:.2e}  train {sum(recent) / len(recent):.3f}  "
                f"held-out {heldout_loss(model, heldout, args.seq_len):.3f}  "
                f"{step * spec.batch_size * args.seq_len / elapsed:.0f} tok/s  {elapsed:.0f}s"
            )
    steps, wall_s = step, time.perf_counter() - start
    result = TrainResult(
        num_params=num_params,
        steps=steps,
        tokens_seen=steps * spec.batch_size * args.seq_len,
        train_loss=sum(recent) / len(recent),
        heldout_loss=heldout_loss(model, heldout, args.seq_len),
        wall_s=wall_s,
    )
    return model, result


def save_model(model: LlamaForCausalLM, tokenizer_dir: Path, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model.save_pretrained(out_dir)  # safetensors is the only format transformers 5 writes
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out_dir / name).write_bytes((tokenizer_dir / name).read_bytes())
    stray = [p.name for p in out_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    assert not stray, f"pickle files written: {stray}"


def greedy_samples(model_dir: Path, max_new_tokens: int = 40) -> dict[str, str]:
    """Reload from disk, exactly as a student would, and continue each prompt greedily."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    samples = {}
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        samples[prompt] = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return samples


def rope_theta(config: LlamaConfig) -> float:
    # transformers 5 moved rope_theta into config.rope_parameters.
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    return rope_parameters.get("rope_theta", getattr(config, "rope_theta", float("nan")))


def describe(config: LlamaConfig) -> str:
    return (
        f"LlamaForCausalLM: hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
        f"{config.num_attention_heads} heads, {config.num_key_value_heads} KV heads, "
        f"intermediate {config.intermediate_size}, vocab {config.vocab_size}, "
        f"{'tied' if config.tie_word_embeddings else 'untied'} embeddings, RoPE theta {rope_theta(config):g}, "
        f"max positions {config.max_position_embeddings}"
    )


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def samples_and_build(samples: dict[str, str], command: str, total_min: float, threads: int) -> list[str]:
    """The end of a model's section of models/README.md (the MoE's, the distilled draft's): its greedy
    samples as a list, then the command that built it and on what."""
    lines = [f"- **{prompt}**{text}".replace("\n", " ") for prompt, text in samples.items()]
    return lines + [
        "",
        f"Build: `{command}`, whole script {total_min:.1f} min on {cpu_name()}, {threads} thread(s);"
        f" Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}.",
    ]


def write_readme_section(readme: Path, begin: str, end: str, section: str, before: str | None = None) -> None:
    """Put `section` (which starts with `begin` and ends with `end`) into models/README.md: in place of
    the old one if there is one, else just before the marker `before` if given and present, else at the end."""
    text = readme.read_text() if readme.exists() else ""
    if begin in text:
        head, rest = text.split(begin, 1)
        after = rest.split(end, 1)[1].lstrip("\n") if end in rest else ""
        text = head + section + ("\n" + after if after else "")
    elif before is not None and before in text:
        head, rest = text.split(before, 1)
        text = head + section + "\n" + before + rest
    else:
        text = text.rstrip("\n") + "\n\n" + section
    readme.write_text(text)


def write_readme(out: Path, specs: list[ModelSpec], results: list[TrainResult], info: dict, args) -> None:
    lines = [
        "# Bundled models",
        "",
        "Two tiny Llama models trained from scratch for this course by `tools/train_bundled.py`",
        f"(`{info['command']}`). Load either offline:",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("models/minillm-target")',
        'tokenizer = AutoTokenizer.from_pretrained("models/minillm-target")',
        "```",
        "",
        "They write King-James-flavoured English: good enough to see that a serving engine produces the",
        "same tokens as `transformers`, far too small to answer anything. The draft shares the target's",
        "tokenizer, so it can propose tokens for speculative decoding.",
        "",
        "## Corpus",
        "",
        f"- Source: {corpus.CORPUS_SOURCE}.",
        f"- License: {corpus.CORPUS_LICENSE}",
        "- Fetched by the script with `apt-get download` + `dpkg-deb -x` into `~/.cache/minillm/kjv`"
        " (never committed).",
        f"- One document per chapter, verses joined into running prose: {info['train_docs']} training chapters"
        f" ({info['train_tokens']:,} tokens), every 50th chapter held out ({info['heldout_docs']} chapters,"
        f" {info['heldout_tokens']:,} tokens).",
        "",
        "## Tokenizer",
        "",
        "Byte-level BPE (HF `tokenizers`), vocabulary 4096, trained on the training chapters. Special tokens:"
        " `<s>` = 0 (bos, prepended by the post-processor), `</s>` = 1 (eos), `<pad>` = 2, `<|system|>` = 3,"
        " `<|user|>` = 4, `<|assistant|>` = 5. Chat template (in `tokenizer_config.json`): `<s>`, then per"
        " message `<|role|>\\n{content}</s>\\n` (role: system, user or assistant), then `<|assistant|>\\n`"
        " when `add_generation_prompt`. The models never saw chat-formatted text.",
        "",
        "## Models",
        "",
        "| | target | draft |",
        "| --- | --- | --- |",
    ]
    t, d = results
    rows = [
        ("directory", "`minillm-target/`", "`minillm-draft/`"),
        ("parameters", f"{t.num_params:,}", f"{d.num_params:,}"),
        ("optimizer steps", f"{t.steps:,}", f"{d.steps:,}"),
        (
            "batch (sequences x tokens)",
            f"{specs[0].batch_size} x {args.seq_len}",
            f"{specs[1].batch_size} x {args.seq_len}",
        ),
        ("peak learning rate", f"{specs[0].peak_lr:g}", f"{specs[1].peak_lr:g}"),
        ("tokens seen", f"{t.tokens_seen:,}", f"{d.tokens_seen:,}"),
        ("final training loss (mean of last 20 steps)", f"{t.train_loss:.3f}", f"{d.train_loss:.3f}"),
        ("held-out loss", f"{t.heldout_loss:.3f}", f"{d.heldout_loss:.3f}"),
        ("held-out perplexity", f"{math.exp(t.heldout_loss):.1f}", f"{math.exp(d.heldout_loss):.1f}"),
        ("training wall time", f"{t.wall_s / 60:.1f} min", f"{d.wall_s / 60:.1f} min"),
        (
            "mean throughput",
            f"{t.tokens_seen / t.wall_s:,.0f} tokens/s",
            f"{d.tokens_seen / d.wall_s:,.0f} tokens/s",
        ),
    ]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines += [
        "",
        f"- target: {describe(specs[0].config)}.",
        f"- draft: {describe(specs[1].config)}.",
        "- Both: float32 `model.safetensors`, AdamW (betas 0.9/0.95, weight decay 0.1 on matrices),"
        f" {WARMUP_STEPS}-step linear warmup then cosine decay to 10% of the peak over the"
        f" {'fixed step count' if specs[0].steps else 'time budget'}, gradient clipping 1.0, bf16 autocast"
        f" {'on' if args.bf16 else 'off'}, random 257-token windows drawn by a generator seeded with {args.seed}.",
        "",
        "## Greedy samples (40 new tokens, from the saved files)",
        "",
        "Greedy decoding falls into loops quickly at this size; that is expected, and it makes the",
        "outputs easy to compare token for token.",
        "",
    ]
    for spec, result in zip(specs, results):
        lines.append(f"{spec.name}:")
        lines.append("")
        for prompt, text in result.samples.items():
            lines.append(f"- **{prompt}**{text}".replace("\n", " "))
        lines.append("")
    lines += [
        "## Build",
        "",
        f"- Command: `{info['command']}`.",
        f"- Whole script: {info['total_min']:.1f} min on {cpu_name()}, {torch.get_num_threads()} threads"
        " (a shared machine: throughput depends on what else runs, so a time-budgeted rerun takes a"
        " different number of steps; --steps-target / --steps-draft fix the step counts instead).",
        f"- Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}.",
        "",
    ]
    readme = out / "README.md"
    old = readme.read_text() if readme.exists() else ""
    moe_section = MOE_SECTION_MARKER + old.split(MOE_SECTION_MARKER, 1)[1] if MOE_SECTION_MARKER in old else ""
    readme.write_text("\n".join(lines) + ("\n" + moe_section if moe_section else ""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models"))
    parser.add_argument("--minutes-target", type=float, default=25.0)
    parser.add_argument("--minutes-draft", type=float, default=5.0)
    parser.add_argument(
        "--steps-target", type=int, default=None, help="run this many steps instead of a time budget"
    )
    parser.add_argument("--steps-draft", type=int, default=None)
    parser.add_argument("--lr-target", type=float, default=2e-3)
    parser.add_argument("--lr-draft", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step (both models)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in pure float32")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    script_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    log("fetching the corpus")
    text = corpus.load_corpus()
    log(
        f"{len(text.train_docs)} training chapters ({text.num_train_chars:,} chars), {len(text.heldout_docs)} held out"
    )
    tokenizer_dir = out / ".tokenizer"
    corpus.save_hf_tokenizer(corpus.train_tokenizer(text.train_docs), tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    probe = text.heldout_docs[0]
    assert tokenizer.decode(tokenizer(probe).input_ids, skip_special_tokens=True) == probe, (
        "tokenizer round trip"
    )
    train, heldout = pack_documents(text.train_docs, tokenizer), pack_documents(text.heldout_docs, tokenizer)
    log(f"tokenizer: {len(tokenizer)} entries; {len(train):,} training tokens, {len(heldout):,} held out")

    specs = [
        ModelSpec(
            "minillm-target",
            llama_config(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=688, tied=False),
            args.minutes_target,
            args.steps_target,
            args.batch_size,
            args.lr_target,
        ),
        ModelSpec(
            "minillm-draft",
            llama_config(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=192, tied=True),
            args.minutes_draft,
            args.steps_draft,
            args.batch_size,
            args.lr_draft,
        ),
    ]
    results = []
    for spec in specs:
        model, result = train_model(spec, train, heldout, args)
        save_model(model, tokenizer_dir, out / spec.name)
        result.samples = greedy_samples(out / spec.name)
        for prompt, continuation in result.samples.items():
            log(f"{spec.name} sample: {prompt!r} -> {continuation!r}")
        results.append(result)

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tokenizer_dir / name).unlink()
    tokenizer_dir.rmdir()
    info = {
        "train_docs": len(text.train_docs),
        "heldout_docs": len(text.heldout_docs),
        "train_tokens": len(train),
        "heldout_tokens": len(heldout),
        "total_min": (time.perf_counter() - script_start) / 60,
        "command": " ".join(
            ["python", "tools/train_bundled.py", *(argv if argv is not None else sys.argv[1:])]
        ),
    }
    write_readme(out, specs, results, info, args)
    log(f"done in {info['total_min']:.1f} min; wrote {out / 'README.md'}")


if __name__ == "__main__":
    main()
