"""Errors as the OpenAI API shapes them: `{"error": {"message", "type", "param", "code"}}` with a status.

    400 invalid_request_error   missing fields, wrong types, unknown model, prompt + max_tokens over the context
    404 not_found_error         no such path
    405 invalid_request_error   wrong method
    413 invalid_request_error   body over --max-body-bytes
    429 rate_limit_error        per-address rate limit, or the generation queue is full
    503 service_unavailable     the swarm cannot serve: layers missing, peers busy, failover ran out of tries
    504 timeout                 the request ran past --request-timeout-s

Anything unexpected is reported as 503 with its type name (never a traceback): the server itself is fine,
the swarm behind it is what failed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from swarm.errors import CapacityError, ModelMismatch, NoRouteError, SwarmError, TransportError


@dataclass
class APIError(Exception):
    """An error to send to the client in OpenAI's shape."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 for a request the server will not run."""
    return APIError(400, message, "invalid_request_error", param, code)


def from_exception(error: BaseException) -> APIError:
    """The APIError telling a user why the swarm could not answer, in plain words."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, NoRouteError):
        return APIError(
            503, f"the swarm cannot serve right now: {error}", "service_unavailable", code="no_route"
        )
    if isinstance(error, CapacityError):
        return APIError(503, f"the swarm is busy: {error}", "service_unavailable", code="swarm_busy")
    if isinstance(error, ModelMismatch):
        return APIError(503, str(error), "service_unavailable", code="model_mismatch")
    if isinstance(error, TransportError | ConnectionError):
        return APIError(
            503,
            f"peers failed and failover ran out of tries: {error}",
            "service_unavailable",
            code="peer_failed",
        )
    if isinstance(error, TimeoutError | asyncio.TimeoutError):
        return APIError(504, "the request timed out", "timeout", code="timeout")
    if isinstance(error, SwarmError):
        return APIError(503, f"the swarm failed: {error}", "service_unavailable", code=type(error).__name__)
    return APIError(
        503, f"generation failed ({type(error).__name__})", "service_unavailable", code="internal"
    )
