"""The local channel between the trainer and a GRPO job's processes: length-prefixed frames.

Each rank of a job holds one end of its own ``socketpair`` (``AF_UNIX``, ``SOCK_STREAM``); the
trainer holds the other ends. A frame is one kind byte, a 4-byte big-endian payload length and
the payload. The trainer sends the same sequence of control frames to every rank, so every rank
takes the same decision at every step boundary:

| kind | direction | payload |
| --- | --- | --- |
| ``JOB`` | trainer -> rank | the job spec (JSON, see ``launch.py``) |
| ``STEP`` | trainer -> rank | the optimizer step the ranks may run next (8-byte int) |
| ``STOP`` | trainer -> rank | nothing: stop at the next step boundary |
| ``PHASE`` | rank -> trainer | what the rank does (UTF-8), for heartbeats |
| ``BEAT`` | rank -> trainer | nothing: the rank is alive (sent every second) |
| ``EPISODE`` | rank 0 -> trainer | one serialized ``trainwire.v1.Episode`` |
| ``ERROR`` | rank -> trainer | why the rank failed (JSON, see :func:`error_payload`) |
| ``END`` | rank -> trainer | training returned: the last step the rank finished (8-byte int) |

End of file on a socket means the other side is gone: for a rank, that the trainer died (it then
kills its process group); for the trainer, that the rank died.

This module imports neither torch nor grpc.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = [
    "BEAT",
    "END",
    "EPISODE",
    "ERROR",
    "JOB",
    "MAX_FRAME",
    "PHASE",
    "STEP",
    "STOP",
    "FrameReader",
    "FrameSocket",
    "error_payload",
]

JOB = b"J"
STEP = b"S"
STOP = b"Q"
PHASE = b"P"
BEAT = b"B"
EPISODE = b"E"
ERROR = b"X"
END = b"D"

_HEADER = struct.Struct(">cI")
_STEP = struct.Struct(">q")
#: Largest payload accepted: an episode is at most ~40 KiB, a job spec a few KiB.
MAX_FRAME = 16 << 20


class FrameReader:
    """Reassembles frames from the bytes of a stream, in order.

    Raises:
        ValueError: From :meth:`feed`, a frame larger than :data:`MAX_FRAME` (a broken peer).
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Adds bytes; yields every ``(kind, payload)`` completed by them."""
        self._buffer += data
        while len(self._buffer) >= _HEADER.size:
            kind, size = _HEADER.unpack_from(self._buffer)
            if size > MAX_FRAME:
                raise ValueError(f"frame of {size} bytes exceeds {MAX_FRAME}")
            end = _HEADER.size + size
            if len(self._buffer) < end:
                return
            payload = bytes(self._buffer[_HEADER.size : end])
            del self._buffer[:end]
            yield kind, payload


class FrameSocket:
    """One end of a channel: thread-safe sends, and blocking receives for one reader thread.

    Args:
        sock: A connected stream socket.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self._reader = FrameReader()
        self._pending: list[tuple[bytes, bytes]] = []

    def fileno(self) -> int:
        """The socket's descriptor (for selectors)."""
        return self.sock.fileno()

    def send(self, kind: bytes, payload: bytes = b"") -> bool:
        """Sends one frame; returns False when the peer is gone (nothing is raised)."""
        frame = _HEADER.pack(kind, len(payload)) + payload
        with self._send_lock:
            try:
                self.sock.sendall(frame)
            except OSError:
                return False
        return True

    def send_step(self, step: int) -> bool:
        """Sends ``STEP`` for optimizer step ``step``."""
        return self.send(STEP, step_payload(step))

    def send_json(self, kind: bytes, value: Any) -> bool:
        """Sends a frame whose payload is ``value`` as JSON."""
        return self.send(kind, json.dumps(value).encode())

    def recv(self) -> tuple[bytes, bytes] | None:
        """The next frame, blocking; ``None`` at end of file (or when the socket failed).

        Raises:
            ValueError: An oversized frame.
        """
        while not self._pending:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                return None
            if not data:
                return None
            self._pending.extend(self._reader.feed(data))
        return self._pending.pop(0)

    def read_available(self) -> tuple[list[tuple[bytes, bytes]], bool]:
        """Reads what is there without blocking (call when the socket is readable).

        Returns:
            The completed frames and whether the peer closed its end.
        """
        try:
            data = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return [], False
        except OSError:
            return [], True
        if not data:
            return [], True
        return list(self._reader.feed(data)), False

    def close(self) -> None:
        """Closes the socket (idempotent)."""
        with contextlib.suppress(OSError):
            self.sock.close()


def step_payload(step: int) -> bytes:
    """The payload of a ``STEP`` or ``END`` frame."""
    return _STEP.pack(step)


def step_of(payload: bytes) -> int:
    """The step number of a ``STEP`` or ``END`` payload."""
    return int(_STEP.unpack(payload)[0])


def error_payload(
    kind: str,
    user_message: str,
    *,
    detail: str = "",
    code: str = "INTERNAL",
    reason: str = "PROVIDER_FAILED",
    exception: str = "",
) -> dict[str, Any]:
    """The JSON of an ``ERROR`` frame.

    Args:
        kind: ``provider`` (a ``ProviderError``: shown as is) or ``crash`` (anything else).
        user_message: What the user reads (``provider``) or the exception's text (``crash``).
        detail: For the trainer's log (a traceback).
        code: A ``grpc.StatusCode`` name.
        reason: The ``ErrorInfo`` reason.
        exception: The exception's type name.
    """
    return {
        "kind": kind,
        "user_message": user_message,
        "detail": detail,
        "code": code,
        "reason": reason,
        "exception": exception,
        # CLOCK_MONOTONIC is one clock for the whole machine: the trainer orders the reports
        # of several ranks by it, so the first failure (the cause) wins over its echoes.
        "at": time.monotonic(),
    }
