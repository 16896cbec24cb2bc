"""What the client sees when a request fails (OpenAI-style JSON errors) and the backend failures worth a retry."""

from __future__ import annotations

import enum
import json
from typing import Any

from fastapi.responses import JSONResponse, Response

from .config import Role

EXCERPT_CHARS = 300


class Outcome(str, enum.Enum):
    """How a client request ended (the `outcome` label of kvc_proxy_requests_total)."""

    OK = "ok"
    BAD_REQUEST = "bad_request"
    TOO_LARGE = "too_large"
    BACKEND_REJECTED = "backend_rejected"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    NO_BACKEND = "no_backend"
    FAILED_MID_STREAM = "failed_mid_stream"
    CLIENT_DISCONNECTED = "client_disconnected"
    INTERNAL_ERROR = "internal_error"


def error_body(status: int, message: str, err_type: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "code": status}}


def error_response(status: int, message: str, err_type: str) -> JSONResponse:
    return JSONResponse(error_body(status, message, err_type), status_code=status)


def sse_error(status: int, message: str, err_type: str) -> bytes:
    """An SSE error event followed by the end of the stream."""
    return f"data: {json.dumps(error_body(status, message, err_type))}\n\ndata: [DONE]\n\n".encode()


class ProxyError(Exception):
    """Ends a request with an error for the client: ours (OpenAI-style) or a backend's own 4xx JSON body."""

    def __init__(self, status: int, message: str, err_type: str, outcome: Outcome, raw: bytes | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.outcome, self.raw = status, message, err_type, outcome, raw

    def response(self) -> Response:
        if self.raw is not None:
            return Response(self.raw, status_code=self.status, media_type="application/json")
        return error_response(self.status, self.message, self.err_type)


def bad_request(message: str) -> ProxyError:
    return ProxyError(400, message, "invalid_request_error", Outcome.BAD_REQUEST)


def no_backend(role: Role) -> ProxyError:
    return ProxyError(503, f"no healthy {role.value} server", "service_unavailable", Outcome.NO_BACKEND)


class FailureKind(str, enum.Enum):
    NOT_REACHED = "not_reached"  # connect error: the request never got to the backend
    DISCONNECTED = "disconnected"  # connection dropped before the answer
    TIMEOUT = "timeout"
    SERVER_ERROR = "server_error"  # HTTP 5xx
    BAD_ANSWER = "bad_answer"  # 2xx we cannot use (not JSON, empty stream)
    STREAM_ERROR = "stream_error"  # a 200 stream whose first event is an error (vLLM: a failed KV load)
    EVICTED = "evicted"  # the health checks took it out of rotation while the request waited on it


class UpstreamFailure(Exception):
    """A backend call failed in a way another backend may not: the flows may retry it."""

    def __init__(self, role: Role, url: str, kind: FailureKind, detail: str) -> None:
        super().__init__(f"{role.value} server {url} {detail}")
        self.role, self.url, self.kind = role, url, kind

    @property
    def marks_unhealthy(self) -> bool:
        """Passive health: a backend that cannot be reached or dropped us is evicted at once.

        A 5xx answer means the server is up; the active checker decides about it."""
        return self.kind in (FailureKind.NOT_REACHED, FailureKind.DISCONNECTED, FailureKind.TIMEOUT)

    def to_proxy_error(self) -> ProxyError:
        if self.kind is FailureKind.TIMEOUT:
            return ProxyError(504, str(self), "upstream_timeout", Outcome.UPSTREAM_TIMEOUT)
        return ProxyError(502, str(self), "upstream_error", Outcome.UPSTREAM_ERROR)
