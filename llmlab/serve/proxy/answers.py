"""What the proxy answers itself, as bytes on the wire: an error in the OpenAI shape, a small JSON answer, a status
line; and :class:`ProxyError`, a start the proxy refuses with one sentence.  The floor every other proxy module
stands on."""

from __future__ import annotations

import json
from http import HTTPStatus


class ProxyError(RuntimeError):
    """The proxy cannot start; the message says what to fix."""



REASONS = {400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
           413: "Content Too Large", 429: "Too Many Requests", 431: "Request Header Fields Too Large",
           502: "Bad Gateway", 503: "Service Unavailable"}


def status_line(status: int) -> bytes:
    try:
        reason = REASONS.get(status) or HTTPStatus(status).phrase
    except ValueError:  # a status code Python does not name: the reason phrase is optional
        reason = ""
    return b"HTTP/1.1 %d %b" % (status, reason.encode())


def error_response(status: int, message: str, extra: tuple[bytes, ...] = (), close: bool = False) -> bytes:
    """A whole JSON error answer in the OpenAI shape ``{"error": {"message", "code"}}``, head and body."""
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    head = [status_line(status), b"content-type: application/json",
            b"content-length: %d" % len(body), *extra] + ([b"connection: close"] if close else [])
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def closing(answer: bytes) -> bytes:
    """An :func:`error_response` that also says ``connection: close`` (the proxy closes after it)."""
    head, _, body = answer.partition(b"\r\n\r\n")
    return head + b"\r\nconnection: close\r\n\r\n" + body


def json_response(status: int, obj) -> bytes:
    """A whole JSON answer, head and body (what the proxy answers itself: the merged ``/v1/models``)."""
    body = json.dumps(obj).encode()
    return b"\r\n".join([status_line(status), b"content-type: application/json",
                          b"content-length: %d" % len(body)]) + b"\r\n\r\n" + body
