"""Output processing: text, stop strings and what each output carries (chapters 03 and 11).

The only writer of `Request.output_text`. While a request runs, its text grows in its incremental
detokenizer (`minillm.detokenizer`), which also matches stop strings and cuts the text at one;
when it finishes, its final text is set here. `emit` hands a request's sink what the step added
(DELTA), everything so far (CUMULATIVE) or, once finished, everything (FINAL_ONLY).
"""

from __future__ import annotations

import logging
from typing import Any

from minillm.request import CompletionOutput, Request, RequestOutput, RequestOutputKind

logger = logging.getLogger("minillm.engine")


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def finish_text(self, req: Request) -> None:
        """Set a finished request's text: cut at its stop string, or its tokens decoded."""
        if req.detokenizer is not None and isinstance(req.stop_reason, str):
            req.output_text = req.detokenizer.text  # cut where the stop string matched
            return
        # The EOS or stop token that ended it is in output_token_ids but not in the text,
        # unless include_stop_str_in_output (vLLM's rule, for stop strings and stop tokens alike).
        ids = req.output_token_ids
        if req.stopped_on_token and not req.params.include_stop_str_in_output:
            ids = ids[:-1]
        req.output_text = (self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)
                           if self.tokenizer is not None else "")

    def emit(self, req: Request, new_ids: list[int], new_logprobs: list | None, record: Any) -> None:
        """Hand `req.sink` what this step added (DELTA), everything so far (CUMULATIVE), or, once
        finished, everything (FINAL_ONLY). Text a stop string may still claim is held back."""
        kind = req.params.output_kind
        finished = req.status.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return
        if finished:
            text = req.output_text if req.output_text is not None else (
                req.detokenizer.text if req.detokenizer is not None else "")
        elif req.detokenizer is not None:
            text = req.detokenizer.emittable(req.params.stop, req.params.include_stop_str_in_output)
        else:
            text = ""
        if kind is RequestOutputKind.DELTA:
            # What was streamed is a prefix of the final text (the windowed decode of a full decode).
            completion = CompletionOutput(0, text[len(req.sent_text):], list(new_ids), req.finish_reason,
                                          req.cumulative_logprob, new_logprobs, req.stop_reason)
            req.sent_text = text
        else:
            completion = CompletionOutput(0, text, list(req.output_token_ids), req.finish_reason,
                                          req.cumulative_logprob,
                                          None if req.output_logprobs is None else list(req.output_logprobs),
                                          req.stop_reason)
        out = RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), [completion], finished,
                            record if finished else None, error=req.error)
        try:
            req.sink(out)
        except Exception:  # noqa: BLE001 - a consumer's failure must not stop the engine
            logger.exception("output sink of request %s failed", req.request_id)
