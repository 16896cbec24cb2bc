"""Server-sent events as vLLM streams them: split into events, and what an event is (output, error, preamble)."""

from __future__ import annotations

import enum
import json
from typing import Any


class EventKind(enum.Enum):
    PREAMBLE = "preamble"  # nothing generated yet: a comment, chat's role-only first chunk
    OUTPUT = "output"  # a token, a finish reason, usage, or anything we do not know (never held back)
    ERROR = "error"  # {"error": {...}}: vLLM's way to fail a request after its 200 (e.g. a failed KV load)
    DONE = "done"  # data: [DONE]


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete events (without their blank-line terminator) and the incomplete rest."""
    *events, rest = buffer.split(b"\n\n")
    return events, rest


def event_data(event: bytes) -> bytes | None:
    """The payload of an event's data line(s); None for an event without data (a comment)."""
    lines = [line[5:].strip() for line in event.strip().split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def _json(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except ValueError:
        return None


def _is_preamble_choice(choice: Any) -> bool:
    """A chat choice that only names the role (vLLM's first chunk), generating nothing."""
    if not isinstance(choice, dict) or choice.get("finish_reason") is not None or choice.get("logprobs"):
        return False
    if choice.get("token_ids"):  # a token whose text vLLM holds back (part of a character) is output
        return False
    delta = choice.get("delta")
    if not isinstance(delta, dict) or "text" in choice:
        return False
    return all(
        key == "role" or (key in ("content", "reasoning_content", "reasoning") and not value) for key, value in delta.items()
    )


def parse_event(event: bytes) -> tuple[EventKind, Any]:
    """What an event is, and its data parsed (None: no data, [DONE], or not JSON)."""
    payload = event_data(event)
    if payload is None:
        return EventKind.PREAMBLE, None
    if payload == b"[DONE]":
        return EventKind.DONE, None
    obj = _json(payload)
    if not isinstance(obj, dict):
        return EventKind.OUTPUT, obj
    choices = obj.get("choices")
    if "error" in obj and not choices:
        return EventKind.ERROR, obj
    if isinstance(choices, list) and choices and all(_is_preamble_choice(c) for c in choices):
        return EventKind.PREAMBLE, obj
    return EventKind.OUTPUT, obj


def classify_event(event: bytes) -> EventKind:
    return parse_event(event)[0]


def error_message(event: bytes) -> str:
    """The message of an ERROR event (bounded)."""
    obj = _json(event_data(event) or b"")
    error = obj.get("error") if isinstance(obj, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    return str(message)[:300]


class FirstOutput:
    """Buffers a stream's bytes until its first output event (or an error, or [DONE]) is known."""

    def __init__(self) -> None:
        self.held = b""
        self._rest = b""

    def feed(self, chunk: bytes) -> tuple[EventKind, bytes] | None:
        """None while only preamble has come; else the first non-preamble event's kind and the event."""
        self.held += chunk
        events, self._rest = split_events(self._rest + chunk)
        for event in events:
            kind = classify_event(event)
            if kind is not EventKind.PREAMBLE:
                return kind, event
        return None


class DoneSeen:
    """Whether a relayed stream has carried `data: [DONE]` (chunk boundaries anywhere)."""

    _MARK = b"data: [DONE]"

    def __init__(self) -> None:
        self.seen = False
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        if not self.seen:
            window = self._tail + chunk
            self.seen = self._MARK in window
            self._tail = window[-len(self._MARK) :]
