"""The SDK's exceptions: one root, HTTP statuses mapped to one class each.

TuneloopError
├── APIError
│   ├── APIConnectionError
│   │   └── APITimeoutError
│   ├── APIResponseValidationError
│   └── APIStatusError (status_code, body)
│       ├── BadRequestError (400)          ├── RequestTooLargeError (413)
│       ├── AuthenticationError (401)      ├── UnsupportedMediaTypeError (415)
│       ├── PermissionDeniedError (403)    ├── UnprocessableEntityError (422)
│       ├── NotFoundError (404)            ├── RateLimitError (429)
│       ├── ConflictError (409)            └── InternalServerError (>= 500)
│       └── GoneError (410)
└── RequestFailedError (a future that resolved to a failure record)
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "APIConnectionError",
    "APIError",
    "APIResponseValidationError",
    "APIStatusError",
    "APITimeoutError",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "GoneError",
    "InternalServerError",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "RequestFailedError",
    "RequestTooLargeError",
    "TuneloopError",
    "UnprocessableEntityError",
    "UnsupportedMediaTypeError",
    "status_error",
]


class TuneloopError(Exception):
    """Root of every error the SDK raises on purpose."""


class APIError(TuneloopError):
    """A problem talking to the server."""


class APIConnectionError(APIError):
    """The request did not get an HTTP answer (refused, reset, DNS, ...)."""


class APITimeoutError(APIConnectionError):
    """The request got no answer in time."""


class APIResponseValidationError(APIError):
    """The server answered, but not with the shape the SDK expected."""


class APIStatusError(APIError):
    """The server answered with an error status; `body` is the decoded JSON body (or text)."""

    def __init__(self, message: str, *, status_code: int, body: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.body = body


class BadRequestError(APIStatusError):
    """400: the request is malformed or a field is invalid."""


class AuthenticationError(APIStatusError):
    """401: missing or unknown API key."""


class PermissionDeniedError(APIStatusError):
    """403: the key may not touch this resource."""


class NotFoundError(APIStatusError):
    """404: no such resource (or route)."""


class ConflictError(APIStatusError):
    """409: the resource is in a state that forbids the request."""


class GoneError(APIStatusError):
    """410: the session or future no longer exists."""


class RequestTooLargeError(APIStatusError):
    """413: the body is over the server's limit."""


class UnsupportedMediaTypeError(APIStatusError):
    """415: wrong Content-Type or Content-Encoding."""


class UnprocessableEntityError(APIStatusError):
    """422: the body parsed but did not validate."""


class RateLimitError(APIStatusError):
    """429: too many requests; the SDK retries these before raising."""


class InternalServerError(APIStatusError):
    """>= 500: the server failed."""


class RequestFailedError(TuneloopError):
    """A long operation was accepted but failed; `category` is "user", "server" or "unknown"."""

    def __init__(self, message: str, request_id: str, category: str = "unknown") -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.category = category

    def __str__(self) -> str:
        return f"{self.message} (request {self.request_id}, category {self.category})"


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    410: GoneError,
    413: RequestTooLargeError,
    415: UnsupportedMediaTypeError,
    422: UnprocessableEntityError,
    429: RateLimitError,
}


def status_error(message: str, status_code: int, body: Any = None) -> APIStatusError:
    """The APIStatusError subclass for `status_code` (InternalServerError for any 5xx)."""
    if status_code >= 500:
        cls: type[APIStatusError] = InternalServerError
    else:
        cls = _BY_STATUS.get(status_code, APIStatusError)
    return cls(message, status_code=status_code, body=body)
