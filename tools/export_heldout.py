"""Write the bundled corpus' held-out split into the repository: data/heldout/kjv_heldout.jsonl.

The bundled models were trained on the King James Version with every 50th chapter held out
(tools/corpus.py, `load_corpus`). Those 23 chapters (about 86 kB of public-domain text) are what
chapter 14's quality harness (minillm/kv/quality.py) scores, so they ship with the course; the training
text does not (tools/corpus.py fetches it with apt when the models are retrained).

    python tools/export_heldout.py            # fetches the Debian packages once (apt-get download)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import CORPUS_LICENSE, CORPUS_SOURCE, load_corpus  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "data" / "heldout" / "kjv_heldout.jsonl"


def main() -> None:
    corpus = load_corpus()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w") as f:
        for number, doc in enumerate(corpus.heldout_docs):
            f.write(json.dumps({"doc": number, "text": doc}, ensure_ascii=False) + "\n")
    (OUT.parent / "README.md").write_text(
        "# Held-out text of the bundled models\n\n"
        f"`kjv_heldout.jsonl`: the {len(corpus.heldout_docs)} chapters the bundled models never trained on (every "
        "50th chapter, `tools/corpus.py`), one JSON object per line (`doc`, `text`), written by "
        "`python tools/export_heldout.py`. Chapter 14's quality harness (`minillm/kv/quality.py`) scores them.\n\n"
        f"- Source: {CORPUS_SOURCE}.\n- License: {CORPUS_LICENSE}\n")
    print(f"wrote {OUT} ({len(corpus.heldout_docs)} chapters, {corpus.num_heldout_chars} characters)")


if __name__ == "__main__":
    main()
