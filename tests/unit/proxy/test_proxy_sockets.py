"""The proxy under uvicorn on real sockets, with tiny real fake backends: client disconnects reach the backends."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

import kv_connectors.proxy
from tests.unit.proxy.proxy_fakes import KV_FROM_P, config, serve


class Backend:
    """A fake vLLM server that holds every completion until its client goes away (as vLLM aborts)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.started = 0
        self.aborted = 0
        self.app = FastAPI()
        self.app.add_api_route("/health", lambda: JSONResponse({}), methods=["GET"])
        self.app.add_api_route("/v1/completions", self.completion, methods=["POST"])

    async def completion(self, request: Request) -> Any:
        body = await request.json()
        self.started += 1
        if self.role == "prefill":
            return JSONResponse({"choices": [{"text": "x"}], "kv_transfer_params": KV_FROM_P})
        if body.get("stream"):
            return StreamingResponse(self._tokens(), media_type="text/event-stream")
        while not await request.is_disconnected():
            await asyncio.sleep(0.01)
        self.aborted += 1
        return JSONResponse({})

    async def _tokens(self) -> Any:
        try:
            while True:
                yield b'data: {"choices": [{"index": 0, "text": "t"}]}\n\n'
                await asyncio.sleep(0.01)
        except BaseException:
            self.aborted += 1
            raise


def _wait(predicate: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_decode(stream: bool) -> None:
    p, d = Backend("prefill"), Backend("decode")
    with serve(p.app) as p_url, serve(d.app) as d_url:
        app = kv_connectors.proxy.build_app(config((p_url,), (d_url,)))
        with serve(app) as proxy_url:
            with httpx.Client(timeout=10) as client:
                if stream:
                    with client.stream("POST", f"{proxy_url}/v1/completions", json={"prompt": [1], "stream": True}) as resp:
                        assert resp.status_code == 200
                        next(resp.iter_bytes())
                else:
                    with pytest.raises(httpx.ReadTimeout):
                        client.post(f"{proxy_url}/v1/completions", json={"prompt": [1]}, timeout=0.5)
            # the client's connection is closed now
            _wait(lambda: d.aborted == 1, "D to see the proxy go away")
            health = httpx.get(f"{proxy_url}/health", timeout=5).json()
            metrics = httpx.get(f"{proxy_url}/metrics", timeout=5).text
    assert p.started == 1 and d.started == 1
    assert health["decode"][0]["outstanding"] == 0
    assert 'kvc_proxy_requests_total{outcome="client_disconnected",route="/v1/completions"} 1.0' in metrics
