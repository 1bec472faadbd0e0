"""The exceptions acb raises. Every one derives from :class:`AcbError`."""

from __future__ import annotations

from typing import TypeVar


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


class EngineOverloadedError(AcbError):
    """The engine's waiting queue is full (``EngineConfig.max_waiting_requests``): raised
    by the submitting call at once, nothing queued. ``retry_after`` is a hint in seconds
    (``acb serve`` answers 429 with it as ``Retry-After``)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestFailedError(AcbError):
    """The model step failed for this request. ``__cause__`` holds the original error."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class DeviceError(AcbError):
    """The device failed in a way that leaves it unusable (a CUDA error, a device-side
    assert). The engine stops: every unfinished request fails with ``RequestFailedError``
    whose cause is this error, and new submissions raise ``EngineStoppedError``."""


E = TypeVar("E", bound=BaseException)

_FATAL_MARKERS = ("CUDA error", "device-side assert", "illegal memory access", "unspecified launch failure",
                  "CUBLAS_STATUS_EXECUTION_FAILED", "CUDNN_STATUS_EXECUTION_FAILED", "ECC error")


def caused(error: E, cause: BaseException) -> E:
    """``error`` with ``cause`` attached as its ``__cause__`` (for errors made, not raised)."""
    error.__cause__ = cause
    return error


def as_device_error(error: BaseException) -> DeviceError | None:
    """``error`` as a DeviceError when it means the device is unusable, else None."""
    if isinstance(error, DeviceError):
        return error
    if isinstance(error, RuntimeError) and any(m in str(error) for m in _FATAL_MARKERS):
        return caused(DeviceError(f"the device failed: {error}"), error)
    return None
