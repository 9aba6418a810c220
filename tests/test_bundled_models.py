"""The bundled models in models/ (built by tools/train_bundled.py, the draft then distilled by
tools/distill_draft.py; used from chapter 00 on).

These tests only load what is committed; they never train. They check what the course relies on:
both models load offline with plain transformers, the draft is an order of magnitude smaller,
speaks the same tokenizer and mostly guesses the target's greedy token, and the target writes English.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# The course runs offline: make any attempt to reach the hub fail loudly instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
TARGET_DIR = MODELS_DIR / "minillm-target"
DRAFT_DIR = MODELS_DIR / "minillm-draft"
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


def _load(model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model, tokenizer


@pytest.fixture(scope="module")
def target():
    return _load(TARGET_DIR)


@pytest.fixture(scope="module")
def draft():
    return _load(DRAFT_DIR)


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_dir", [TARGET_DIR, DRAFT_DIR], ids=["target", "draft"])
def test_model_dir_has_the_hf_files(model_dir: Path) -> None:
    names = {p.name for p in model_dir.iterdir()}
    hf_files = {"config.json", "generation_config.json", "model.safetensors"}
    assert hf_files | {"tokenizer.json", "tokenizer_config.json"} <= names
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    assert config.model_type == "llama"
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 1, 2)


def test_both_load_offline_as_float32_llama(target, draft) -> None:
    for model, _ in (target, draft):
        assert type(model).__name__ == "LlamaForCausalLM"
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert model.generation_config.eos_token_id == 1


def test_architectures(target, draft) -> None:
    def shape(config) -> tuple[int, int, int, int]:
        return (
            config.hidden_size,
            config.num_hidden_layers,
            config.num_attention_heads,
            config.num_key_value_heads,
        )

    t, d = target[0].config, draft[0].config
    # GQA in both: fewer KV heads than query heads.
    assert shape(t) == (256, 4, 8, 4)
    assert shape(d) == (64, 2, 4, 2)
    assert not t.tie_word_embeddings and d.tie_word_embeddings
    assert t.max_position_embeddings == d.max_position_embeddings == 2048


def test_parameter_counts_and_ratio(target, draft) -> None:
    target_params, draft_params = _num_params(target[0]), _num_params(draft[0])
    assert 4_000_000 <= target_params <= 6_000_000
    assert 200_000 <= draft_params <= 800_000
    assert 7 <= target_params / draft_params <= 20  # "about 10x smaller"


def test_draft_shares_the_target_tokenizer(target, draft) -> None:
    t_tok, d_tok = target[1], draft[1]
    assert t_tok.get_vocab() == d_tok.get_vocab()
    assert len(t_tok) == 4096 == target[0].config.vocab_size == draft[0].config.vocab_size
    assert (TARGET_DIR / "tokenizer.json").read_bytes() == (DRAFT_DIR / "tokenizer.json").read_bytes()
    assert t_tok.convert_tokens_to_ids(SPECIAL_TOKENS) == list(range(6))
    assert (t_tok.bos_token_id, t_tok.eos_token_id, t_tok.pad_token_id) == (0, 1, 2)


def test_tokenizer_prepends_bos_and_round_trips(target) -> None:
    tokenizer = target[1]
    text = "And Joseph said, Fear not: for am I in the place of God?\n  Tabs\tand ünïcode too."
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # Byte-level BPE trained on English prose: common words are single tokens.
    assert len(tokenizer(" the", add_special_tokens=False).input_ids) == 1


def test_chat_template_renders(target) -> None:
    tokenizer = target[1]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Who made the heaven?"},
    ]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|system|>\nBe brief.</s>\n<|user|>\nWho made the heaven?</s>\n<|assistant|>\n"
    closed = tokenizer.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=False)
    assert closed == "<s><|user|>\nWho made the heaven?</s>\n"
    ids = tokenizer.apply_chat_template(messages[1:], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    # Exactly one bos (the template's own), and the role tags are single special tokens.
    assert ids[:2] == [0, 4] and ids.count(0) == 1 and 5 in ids


def test_size_budget_and_no_pickles() -> None:
    files = [p for p in MODELS_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 40 * 1024 * 1024
    assert not [p for p in files if p.suffix in {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"}]


def test_target_beats_draft_beats_uniform_on_known_text(target, draft) -> None:
    text = "And God said, Let there be light: and there was light."
    losses = []
    for model, tokenizer in (target, draft):
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            losses.append(model(input_ids=ids, labels=ids).loss.item())
    uniform = torch.log(torch.tensor(4096.0)).item()
    assert losses[0] < losses[1] < uniform - 2


def test_the_draft_guesses_the_targets_greedy_tokens(target, draft) -> None:
    """What greedy speculation accepts (chapter 09): on the target's own greedy continuations of four
    verses, the draft's greedy next token is the target's at most positions. The draft as
    tools/train_bundled.py trained it (on the text alone) agreed at 79 of 145 (0.54); distilled from
    the target by tools/distill_draft.py it agrees far more often."""
    model, tokenizer = target
    same = total = 0
    with torch.no_grad():
        for prompt in ("In the beginning God created the heaven and the earth.", "And the LORD spake unto Moses, saying,",
                       "The LORD is my shepherd; I shall not want.", "And it came to pass in those days, that"):
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            sequence = model.generate(ids, max_new_tokens=48, do_sample=False)
            at = slice(ids.shape[1] - 1, -1)  # the positions whose next token the target generated
            target_tokens = model(input_ids=sequence).logits.argmax(-1)[0, at]
            draft_tokens = draft[0](input_ids=sequence).logits.argmax(-1)[0, at]
            same += int((target_tokens == draft_tokens).sum())
            total += len(target_tokens)
    assert same / total >= 0.65, f"the draft guesses the target's greedy token at {same} of {total} positions"


def test_target_greedy_continuation_is_english(target) -> None:
    model, tokenizer = target
    ids = tokenizer("The", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    pieces = text.split()
    words = [w for w in (re.sub(r"[^A-Za-z0-9]", "", p) for p in pieces) if w.isalpha()]
    assert len(words) >= 0.8 * len(pieces) and len(words) >= 8, text
    assert len(set(w.lower() for w in words)) >= 5, f"degenerate repetition: {text!r}"
