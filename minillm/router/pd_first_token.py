"""The PD router's first token, sent to the client as soon as the prefill instance answers (chapter 13).

The prefill instance stops after one token, so its answer arrives when the first token exists. Sent
on at once (as the first chunk of the client's stream), the client's TTFT is one hop and the
prefill; the decode request, the K/V transfer and the decode instance's first chunk overlap with the
client reading it. The decode instance streams the whole answer again, token 1 included (it got the
token with the K/V), so the router drops from its stream what the client already has: the chat role
chunk and the first token's text. It parses the decode's events only until that text is consumed,
then passes the rest through as raw bytes.

Forwarded early only where the client then reads exactly what one server streams: a streamed
request without `stop` strings (a stop string can hold back or cut text one token cannot judge),
without `continuous_usage_stats` (usage in every chunk), whose prefill finished by length (not EOS or
a stop token) with text that is not half a character. Otherwise the router relays the decode
instance's stream as it is, after the prefill's answer (`PDRouter._relay_decode`).
"""

from __future__ import annotations

import json


class SpliceMismatch(Exception):
    """The decode instance's text does not start with the first token the client was sent."""


def frame(payload: dict) -> bytes:
    """One server-sent event, written as the server writes it."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def first_token_events(data: dict, chat: bool, answer: bytes) -> tuple[bytes, str] | None:
    """(the events carrying the prefill's first token in the server's own chunk format, that token's text),
    or None where sending it before the decode instance's stream could differ from one server's stream.
    `data` is the client's request, `answer` the prefill instance's (non-streamed, status 200) body."""
    if data.get("stream") is not True or data.get("stop"):
        return None
    options = data.get("stream_options") or {}
    if not isinstance(options, dict) or options.get("continuous_usage_stats"):
        return None
    try:
        prefill = json.loads(answer)
        choice = prefill["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        base = {"id": prefill["id"], "object": "chat.completion.chunk" if chat else "text_completion",
                "created": prefill["created"], "model": prefill["model"]}
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    if choice.get("finish_reason") != "length" or not isinstance(text, str) or not text or "\ufffd" in text:
        return None
    usage = {"usage": None} if options.get("include_usage") is True else {}
    events = []
    if chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        events.append(frame({**base, "choices": [role], **usage}))
        first = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None, "stop_reason": None}
    else:
        first = {"index": 0, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}
    events.append(frame({**base, "choices": [first], **usage}))
    return b"".join(events), text


class FirstTokenSplice:
    """Feed it the decode instance's stream, chunk by chunk as received; it returns what to send on."""

    def __init__(self, sent_text: str, chat: bool) -> None:
        self.left = sent_text  # the first token's text, not yet seen in the decode's stream
        self.chat = chat
        self.role_dropped = not chat
        self.passing = False  # True once the client has nothing more to be spared: raw bytes from then on
        self._buffer = b""

    def feed(self, chunk: bytes) -> bytes:
        if self.passing:
            return chunk
        self._buffer += chunk
        out = []
        while not self.passing:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                break
            event, self._buffer = self._buffer[:end + 2], self._buffer[end + 2:]
            out.append(self._event(event))
        if self.passing:
            out.append(self._buffer)
            self._buffer = b""
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {"):
            return event  # `data: [DONE]` (the stream ended early): passed on
        payload = json.loads(event[6:])
        choices = payload.get("choices")
        if "error" in payload or not choices:
            self.passing = "error" in payload
            return event
        choice = choices[0]
        if self.chat:
            delta = choice.get("delta") or {}
            if not self.role_dropped and "role" in delta:
                self.role_dropped = True
                if not delta.get("content"):
                    return b""  # the client has its role chunk already
            text = delta.get("content") or ""
        else:
            text = choice.get("text") or ""
        n = min(len(text), len(self.left))
        if text[:n] != self.left[:n]:
            raise SpliceMismatch(f"the decode instance's text {text!r} does not continue the first token "
                                 f"{self.left!r} the client was sent")
        self.left, rest = self.left[n:], text[n:]
        self.passing = not self.left
        if n == 0:
            return event
        if not rest and choice.get("finish_reason") is None:
            return b""  # exactly the text the client has
        if self.chat:
            delta["content"] = rest
        else:
            choice["text"] = rest
        return frame(payload)
