"""A decode server on a real socket that dies at a chosen point of its answer (FIN or RST), for the proxy's tests."""

from __future__ import annotations

import asyncio
import enum
import json
import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvc_testing.procs import free_port


class Death(str, enum.Enum):
    """Where the server's answer ends: each a way a decode server killed mid-request looks to its client."""

    REFUSED = "refused"  # nothing listens
    AFTER_REQUEST = "after_request"  # the request read, nothing sent
    IN_STATUS = "in_status"  # part of the status line
    IN_HEADERS = "in_headers"  # part of the headers
    IN_JSON_BODY = "in_json_body"  # a JSON answer cut short of its content-length
    SSE_HEAD_ONLY = "sse_head_only"  # a 200 event stream's headers, no event
    IN_FIRST_CHUNK = "in_first_chunk"  # part of the stream's first chunk
    AFTER_EVENTS = "after_events"  # two events relayed, then the end (mid-stream)
    NEVER = "never"  # answers in full: the healthy decode server


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENT = b'data: {"id": "cmpl-d", "object": "text_completion", "choices": [{"index": 0, "text": "t"}]}\n\n'
JSON_BODY = json.dumps({"id": "cmpl-d", "object": "text_completion", "choices": [{"index": 0, "text": "tt"}]}).encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _parts(death: Death, stream: bool) -> list[bytes]:
    """What the server sends before it dies (all of it for NEVER)."""
    json_head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(JSON_BODY)
    return {
        Death.AFTER_REQUEST: [],
        Death.IN_STATUS: [b"HTTP/1.1 200 O"],
        Death.IN_HEADERS: [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"],
        Death.IN_JSON_BODY: [json_head, JSON_BODY[:8]],
        Death.SSE_HEAD_ONLY: [SSE_HEAD],
        Death.IN_FIRST_CHUNK: [SSE_HEAD, _chunk(EVENT)[:20]],
        Death.AFTER_EVENTS: [SSE_HEAD, _chunk(EVENT), _chunk(EVENT)],
        Death.NEVER: [SSE_HEAD, _chunk(EVENT), _chunk(b"data: [DONE]\n\n"), b"0\r\n\r\n"] if stream else [json_head, JSON_BODY],
    }[death]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """The request line and headers, and the body (content-length) read off the socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = await reader.read(65536)
        if not more:
            return data
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            while len(body) < int(value):
                body += await reader.read(65536)
    return head + b"\r\n\r\n" + body


class DyingServer:
    """Answers every completion as `death` says, then closes (`rst`: with a reset) or keeps going (NEVER);
    GET /health answers 200 until the server dies once."""

    def __init__(self, death: Death, rst: bool = False) -> None:
        self.death, self.rst = death, rst
        self.port = free_port()
        self.requests = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await _read_request(reader)
                if not request:
                    return
                if request.startswith(b"GET /health"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                    await writer.drain()
                    continue
                self.requests += 1
                stream = b'"stream": true' in request or b'"stream":true' in request
                for part in _parts(self.death, stream):
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(0.02)  # each part its own segment, as a dying server's last writes
                if self.death is not Death.NEVER:
                    break
        except ConnectionError:
            return
        if self.rst:
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()

    @contextmanager
    def running(self) -> Iterator[DyingServer]:
        """Serving on its port in a thread (nothing listens for REFUSED)."""
        if self.death is Death.REFUSED:
            yield self
            return
        ready = threading.Event()

        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
            ready.set()
            await self._stop.wait()
            server.close()

        thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        thread.start()
        assert ready.wait(10), "the dying server did not start"
        try:
            yield self
        finally:
            assert self._loop is not None and self._stop is not None
            self._loop.call_soon_threadsafe(self._stop.set)
            thread.join(10)
