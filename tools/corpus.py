"""The training corpus and tokenizer behind the course's bundled models (see tools/train_bundled.py).

Nothing can be downloaded at run time, so the corpus comes from a Debian package that apt can always
reach: `bible-kjv-text` holds the King James Version in a compressed random-access format, and
`bible-kjv` holds the `bible` program that prints it. The KJV text (1611) is in the public domain; the
package's own copyright file says "The copyright for the King James Version text of the Bible is
expired". We never commit the text: it is fetched into a cache directory and rebuilt on demand.

The tokenizer is a byte-level BPE (the GPT-2 / Llama-3 family of tokenizers) trained on that text, so
that every byte string round-trips and the 4096-entry vocabulary is spent on this corpus's words.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DEBIAN_PACKAGES = ("bible-kjv-text", "bible-kjv")
CORPUS_SOURCE = (
    "King James Version of the Bible (1611), Debian packages bible-kjv-text + bible-kjv "
    "(text dumped with their `bible` program)"
)
CORPUS_LICENSE = (
    "Public domain (the KJV text's copyright has expired; see /usr/share/doc/bible-kjv-text/copyright). "
    "The Debian packaging and the `bible` program are GPL-2+, but only the text is used."
)

# Special tokens: ids 0..5 in this order, so bos = 0 and eos = 1 in every bundled model.
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, PAD, "<|system|>", "<|user|>", "<|assistant|>"]

# One turn per message: a role tag, the content, eos. A generation prompt opens the assistant turn.
# The template begins with bos itself because apply_chat_template tokenizes without special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('role must be system, user or assistant') }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- endif -%}"
)


def cache_dir() -> Path:
    """Where the fetched packages and the dumped text live (never inside the repository)."""
    return Path(os.environ.get("MINILLM_CACHE", Path.home() / ".cache" / "minillm")) / "kjv"


@dataclass
class Corpus:
    """The text as documents: one document per chapter, its verses joined into running prose."""

    train_docs: list[str]
    heldout_docs: list[str]

    @property
    def num_train_chars(self) -> int:
        return sum(len(d) for d in self.train_docs)

    @property
    def num_heldout_chars(self) -> int:
        return sum(len(d) for d in self.heldout_docs)


def fetch_kjv_text() -> Path:
    """Download the two Debian packages, unpack them, and dump the whole Bible, one verse a line."""
    root = cache_dir()
    text_path = root / "kjv.txt"
    if text_path.exists():
        return text_path
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        # apt-get download writes into the current directory and needs no root for that.
        subprocess.run(["apt-get", "download", *DEBIAN_PACKAGES], cwd=tmp, check=True, capture_output=True)
        unpacked = Path(tmp) / "root"
        for deb in sorted(Path(tmp).glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked)], check=True)
        # -f turns pretty-printing off: one verse per line, each prefixed with its reference.
        dump = subprocess.run(
            [str(unpacked / "usr/bin/bible"), "-f", "-p", str(unpacked / "usr/lib"), "gen1:1-rev22:21"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        shutil.copy(unpacked / "usr/share/doc/bible-kjv-text/copyright", root / "copyright")
    text_path.write_text(dump)
    return text_path


_VERSE = re.compile(r"^(?P<book>\d?[A-Za-z]+)(?P<chapter>\d+):(?P<verse>\d+) (?P<text>.*)$")


def load_corpus(heldout_every: int = 50) -> Corpus:
    """Split the verses into chapters; every `heldout_every`-th chapter is held out for evaluation.

    Holding out whole chapters (rather than random verses) keeps held-out text from sharing a
    context window with training text.
    """
    chapters: list[list[str]] = []
    current = None
    for line in fetch_kjv_text().read_text().splitlines():
        match = _VERSE.match(line)
        if match is None:
            raise ValueError(f"unexpected line in the KJV dump: {line!r}")
        key = (match["book"], match["chapter"])
        if key != current:
            chapters.append([])
            current = key
        chapters[-1].append(match["text"])
    docs = [" ".join(verses) for verses in chapters]
    heldout = [d for i, d in enumerate(docs) if i % heldout_every == heldout_every - 1]
    train = [d for i, d in enumerate(docs) if i % heldout_every != heldout_every - 1]
    return Corpus(train_docs=train, heldout_docs=heldout)


def train_tokenizer(docs: list[str], vocab_size: int = 4096) -> Tokenizer:
    """Byte-level BPE with our special tokens at ids 0..5 and a post-processor that prepends bos."""
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: decode(encode(text)) must give back exactly `text`.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, so nothing is unknown
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def save_hf_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    """Write tokenizer.json + tokenizer_config.json (with the chat template) for AutoTokenizer."""
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=SPECIAL_TOKENS[3:],
        # The default clean-up would rewrite " ," to "," on decode and break the round trip.
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(out_dir, save_jinja_files=False)  # chat template stays in the config
    make_config_portable(Path(out_dir) / "tokenizer_config.json")


def make_config_portable(config_path: Path) -> None:
    """Rewrite transformers 5's tokenizer_config.json in the spelling that 4.x and 5.x both load.

    5.x writes `"tokenizer_class": "TokenizersBackend"` and a list under `extra_special_tokens`;
    4.x knows neither (it expects a dict there). Both read `PreTrainedTokenizerFast` and a list of
    `additional_special_tokens` (checked with 4.57 and 5.24).
    """
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(config.get("extra_special_tokens"), list):
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
