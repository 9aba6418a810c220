"""Tokenizer and chat template, through HF transformers (chapter 00).

minillm writes the engine, not a tokenizer: text ↔ ids and chat templating come from the
well-kept HF implementation, loaded offline from the model directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def load_tokenizer(model_dir: str | Path) -> Any | None:
    """The directory's tokenizer, or None if it ships none (then prompts must be token ids)."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json (what HF `generate` stops on), if the file exists."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
