"""The exceptions acb raises. Every one derives from :class:`AcbError`."""

from __future__ import annotations


class AcbError(Exception):
    """Base class of every error acb raises on purpose."""


class InvalidRequestError(AcbError, ValueError):
    """A prompt or sampling value is invalid; raised by the call that submitted it.

    ``param`` names the offending field (``"prompt"``, ``"temperature"``, ...) when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        if param is None:
            # messages name their field first ("top_p must be in (0, 1], got 2")
            first = message.split(" ", 1)[0].rstrip(":")
            param = first if first.isidentifier() and first.islower() and first not in ("a", "the") else None
        self.param = param


class EngineStoppedError(AcbError):
    """The engine is not running (never started, stopping, or hard-stopped)."""


class EngineClosedError(EngineStoppedError):
    """The engine was closed with ``aclose()``; it cannot be started again."""


class RequestFailedError(AcbError):
    """The model step failed for this request. ``__cause__`` holds the original error."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
