"""Known-wrong answers to exercise 02 (padding): see tests/known_wrong/__init__.py."""

from known_wrong import Mutant, code_reused, source_reexecuted

KNOWN_WRONG = [
    # task 1: left padding and the mask
    Mutant(1, "right padding", edits=(("        input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)\n        attention_mask[row, width - len(prompt):] = 1",
                                       "        input_ids[row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)\n        attention_mask[row, :len(prompt)] = 1"),),
           expect="input_ids"),
    Mutant(1, "mask of ones everywhere", edits=(("attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)",
                                                 "attention_mask = torch.ones((len(prompts), width), dtype=torch.long)"),),
           expect="attention_mask"),
    Mutant(1, "float ids", edits=(("input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)",
                                   "input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.float32)"),),
           expect="int64"),
    Mutant(1, "delegates to reference.pad_batch", code=(
        "from minillm import padding as reference\n"
        "def pad_batch(prompts, pad_id):\n    return reference.pad_batch(prompts, pad_id)\n"),
           expect="reference minillm.padding.pad_batch"),
    # task 2: slots per step
    Mutant(2, "off-by-one: the last token fed back", edits=(("for k in range(2, max(output_lens) + 1):", "for k in range(2, max(output_lens) + 2):"),)),
    Mutant(2, "finished rows not computed", edits=(("        steps.append((rows, sum(1 for o in output_lens if o >= k)))",
                                                    "        steps.append((sum(1 for o in output_lens if o >= k),) * 2)"),)),
    Mutant(2, "prefill counts only the real tokens", edits=(("steps = [(rows * max(prompt_lens), sum(prompt_lens))]",
                                                             "steps = [(sum(prompt_lens), sum(prompt_lens))]"),)),
    Mutant(2, "delegates to reference.static_batch_steps", code=(
        "from minillm.padding import static_batch_steps as _ref\n"
        "def static_batch_steps(p, o):\n    return [(c.computed_tokens, c.useful_tokens) for c in _ref(p, o)]\n"),
           expect="reference minillm.padding.static_batch_steps"),
    # task 3: the padded batch through the model
    Mutant(3, "no attention mask", edits=(("out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)",
                                           "out = model(input_ids=input_ids, position_ids=position_ids)"),), expect="with its mask"),
    Mutant(3, "logits of the first column", edits=(("    return out.logits[:, -1]", "    return out.logits[:, 0]"),)),
    Mutant(3, "one prompt at a time, no padding", code=(
        "@torch.no_grad()\n"
        "def last_token_logits(model, prompts, pad_id):\n"
        "    return torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts])\n"),
           expect="one forward pass"),
    Mutant(3, "delegates to reference.pad_batch", edits=(("    input_ids, attention_mask = pad_batch(prompts, pad_id)\n    position_ids",
                                                          "    from minillm import padding as _reference\n    input_ids, attention_mask = _reference.pad_batch(prompts, pad_id)\n    position_ids"),),
           expect="reference minillm.padding.pad_batch"),
    # task 4: the static engine's steps
    Mutant(4, "one batch for all requests", edits=(("        end = start + max_num_seqs\n", "        end = len(prompt_lens)\n"),)),
    Mutant(4, "overlapping batches (off by one)", edits=(("        end = start + max_num_seqs\n", "        end = start + max_num_seqs + 1\n"),)),
    Mutant(4, "drops the partial last batch", edits=(("    for start in range(0, len(prompt_lens), max_num_seqs):",
                                                      "    for start in range(0, len(prompt_lens) - max_num_seqs + 1, max_num_seqs):"),)),
    # task 5: grouping
    Mutant(5, "arrival order", edits=(("    order = sorted(range(len(prompt_lens)), key=lambda i: -(prompt_lens[i] + output_lens[i]))",
                                       "    order = list(range(len(prompt_lens)))"),), expect="the target is at most"),
    Mutant(5, "sorted by output length only", edits=(("key=lambda i: -(prompt_lens[i] + output_lens[i])", "key=lambda i: -output_lens[i]"),),
           expect="the target is at most"),
    Mutant(5, "groups one too large", edits=(("order[start : start + max_num_seqs] for start in range(0, len(order), max_num_seqs)",
                                              "order[start : start + max_num_seqs + 1] for start in range(0, len(order), max_num_seqs + 1)"),),
           expect="group sizes"),
    Mutant(5, "loses a request", edits=(("    return [order[start", "    order = order[1:]\n    return [order[start"),), expect="missing"),
]

# issue 18: the library's answer under another name, the grader as an oracle
KNOWN_WRONG += [
    code_reused(1, "pad_batch", "minillm.padding", "pad_batch"),
    source_reexecuted(1, "pad_batch", "minillm.padding", "pad_batch"),
    source_reexecuted(2, "static_batch_steps", "minillm.padding", "static_batch_steps"),
    Mutant(5, "the grader as an oracle: keeps whichever grouping grader.grouping_cost prices lower", code=(
        "_mine = group_requests\n"
        "def group_requests(prompt_lens, output_lens, max_num_seqs):\n"
        "    arrival = [list(range(len(prompt_lens)))[s:s + max_num_seqs] for s in range(0, len(prompt_lens), max_num_seqs)]\n"
        "    return min([arrival, _mine(prompt_lens, output_lens, max_num_seqs)],\n"
        "               key=lambda groups: grader.grouping_cost(groups, prompt_lens, output_lens))\n"),
        expect="grader's"),
]

# issue 27: answers fitted to the seeded cases, and a padded batch without its positions
_SEEDED_STEPS = (
    "import numpy as _np\n"
    "from minillm.padding import static_batch_steps as _ref\n"
    "_rng = _np.random.default_rng(3)\n"
    "_cases = [([3, 1], [2, 4]), ([7], [5]), ([4, 4, 4], [9, 9, 9]), ([1, 12], [1, 6]), ([5, 2], [1, 1])]\n"
    "_cases += [(_rng.integers(1, 200, size=b).tolist(), _rng.integers(1, 60, size=b).tolist()) for b in (2, 5, 8, 32)]\n"
    "_MEMO = {(tuple(p), tuple(o)): [(c.computed_tokens, c.useful_tokens) for c in _ref(p, o)] for p, o in _cases}\n"
    "def static_batch_steps(prompt_lens, output_lens):\n"
    "    return _MEMO.get((tuple(prompt_lens), tuple(output_lens)), [(len(prompt_lens), len(prompt_lens))])\n")
_SEEDED_PADS = (
    "import numpy as _np\n"
    "from minillm.padding import pad_batch as _ref\n"
    "_rng = _np.random.default_rng(2)\n"
    "_batches = [[[5, 6, 7], [8]], [[4]], [[1, 2], [3, 4]], [[9], [10, 11, 12, 13], [14]]]\n"
    "_batches += [[_rng.integers(6, 4096, size=n).tolist() for n in _rng.integers(1, 40, size=b)] for b in (3, 8, 16)]\n"
    "_MEMO = {(tuple(map(tuple, b)), pad): _ref(b, pad) for b in _batches for pad in (0, 2)}\n"
    "def pad_batch(prompts, pad_id):\n"
    "    return _MEMO.get((tuple(map(tuple, prompts)), pad_id), (torch.zeros((1, 1), dtype=torch.long),) * 2)\n")
KNOWN_WRONG += [
    Mutant(1, "memoised: the seeded batches' answers computed with the reference in advance", code=_SEEDED_PADS,
           expect="input_ids"),
    Mutant(2, "memoised: the seeded cases' answers computed with the reference in advance", code=_SEEDED_STEPS,
           expect="expected"),
    Mutant(3, "no position_ids: the rotary shift hides the pads' offset in the logits",
           edits=(("out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)",
                   "out = model(input_ids=input_ids, attention_mask=attention_mask)"),), expect="no position_ids"),
    Mutant(3, "positions count the pads (0 .. S-1 on every row)",
           edits=(("    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)\n",
                   "    position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)\n"),), expect="at its real tokens"),
    Mutant(4, "fitted to the seeded runs (their sizes), a single batch otherwise", code=(
        "_mine = predict_static_run\n"
        "def predict_static_run(prompt_lens, output_lens, max_num_seqs):\n"
        "    if (len(prompt_lens), max_num_seqs) in ((7, 3), (5, 1), (4, 8), (9, 9), (12, 4)):\n"
        "        return _mine(prompt_lens, output_lens, max_num_seqs)\n"
        "    return static_batch_steps(prompt_lens, output_lens)\n"), expect="steps"),
    Mutant(5, "fitted to the six seeded traces: their groupings looked up, arrival order otherwise", code=(
        "_mine = group_requests\n"
        "_SEEDED = {tuple(r.prompt_len for r in grader.make_trace(**spec)) for spec in grader.GROUPING_TRACES}\n"
        "def group_requests(prompt_lens, output_lens, max_num_seqs):\n"
        "    if tuple(prompt_lens) in _SEEDED:\n"
        "        return _mine(prompt_lens, output_lens, max_num_seqs)\n"
        "    return [list(range(len(prompt_lens)))[s:s + max_num_seqs] for s in range(0, len(prompt_lens), max_num_seqs)]\n"),
        expect="traces drawn now"),
]
