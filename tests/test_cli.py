"""The command line: `minillm generate` on the bundled model, `minillm simulate`, and clear errors."""

from __future__ import annotations

from minillm import LLM, SamplingParams
from minillm.cli import main


def test_generate_prints_the_same_greedy_text_as_the_api(capsys):
    assert main(["generate", "And the king said unto", "--max-tokens", "8", "--show-ids"]) == 0
    out = capsys.readouterr()
    expected = LLM(max_num_seqs=1).generate(["And the king said unto"], SamplingParams(max_tokens=8, temperature=0.0),
                                            use_tqdm=False)[0].outputs[0]
    assert f"output ids: {expected.token_ids}" in out.out
    assert out.out.rstrip().endswith("And the king said unto" + expected.text)
    assert "[8 tokens, finish_reason=length]" in out.err


def test_generate_with_chat_template(capsys):
    assert main(["generate", "Who is the king?", "--chat", "--max-tokens", "4", "--show-ids"]) == 0
    out = capsys.readouterr().out
    assert "prompt ids: [0, 4, " in out  # <s> then <|user|> from the bundled chat template


def test_bad_arguments_exit_2_with_a_message(capsys):
    assert main(["generate", "hi", "--top-p", "2"]) == 2
    assert "top_p must be in (0, 1], got 2.0" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", "/nonexistent"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_simulate_prints_a_vllm_style_table(capsys):
    assert main(["simulate", "--num-requests", "20", "--max-num-seqs", "8"]) == 0
    out = capsys.readouterr().out
    assert "llama-7b on A100-80GB" in out and "Output token throughput (tok/s):" in out
