"""The local channel between the trainer and a GRPO job's processes: kinds of message and the
:class:`ChannelEnd` that sends and receives them over a ``multiprocessing.connection``.

Each rank of a job holds one end of its own ``multiprocessing.Pipe()`` (on Linux a Unix stream
socket pair; the rank gets its end's descriptor as ``--fd``); the trainer holds the other ends.
A message is one kind byte followed by its payload, sent whole with ``send_bytes`` (the
connection frames it). The trainer sends the same sequence of control messages to every rank,
so every rank takes the same decision at every step boundary. In a job whose ranks span
trainers, rank 0's trainer is the one that decides: rank 0 relays each control message it
reads, as it is (kind byte and payload), to the ranks of the other trainers through the job's
rendezvous store (``relayed`` below; see ``rendezvous.py``), and their own trainer sends them
``JOB`` and, when it cancels its share, ``STOP``:

| kind | direction | payload |
| --- | --- | --- |
| ``JOB`` | trainer -> rank | the job spec (JSON, see ``launch.py``) |
| ``STEP`` | trainer -> rank, relayed | the optimizer step the ranks may run next (8-byte int) |
| ``STOP`` | trainer -> rank, relayed | nothing: stop at the next step boundary |
| ``SAVE`` | trainer -> rank, relayed | checkpoint the step just finished (JSON: ``step``, |
| | | ``directory``: rank 0's; the other ranks send it their RNG states) |
| ``HYPER`` | trainer -> rank, relayed | train the next step with these hyperparameters (JSON: |
| | | any of ``learning_rate``, ``temperature``, ``beta``); sent right before its ``STEP`` |
| ``PHASE`` | rank -> trainer | what the rank does (UTF-8), for heartbeats |
| ``BEAT`` | rank -> trainer | nothing: the rank is alive (sent every second) |
| ``EPISODE`` | rank 0 -> trainer | one serialized ``trainwire.v1.Episode`` |
| ``SAVED`` | rank 0 -> trainer | the checkpoint written, or why not (JSON, :func:`saved_payload`) |
| ``ERROR`` | rank -> trainer | why the rank failed (JSON, see :func:`error_payload`) |
| ``END`` | rank -> trainer | training returned: the last step the rank finished (8-byte int) |

End of file on a connection means the other side is gone: for a rank, that the trainer died (it
then kills its process group); for the trainer, that the rank died.

This module imports neither torch nor grpc.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import struct
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

__all__ = [
    "BEAT",
    "END",
    "EPISODE",
    "ERROR",
    "HYPER",
    "JOB",
    "MAX_MESSAGE",
    "PHASE",
    "SAVE",
    "SAVED",
    "STEP",
    "STOP",
    "ChannelEnd",
    "error_payload",
    "saved_payload",
]

JOB = b"J"
STEP = b"S"
STOP = b"Q"
PHASE = b"P"
BEAT = b"B"
EPISODE = b"E"
ERROR = b"X"
END = b"D"
SAVE = b"C"
SAVED = b"W"
HYPER = b"H"

_STEP = struct.Struct(">q")
#: Largest message accepted: an episode is at most ~40 KiB, a job spec a few KiB.
MAX_MESSAGE = 16 << 20


class ChannelEnd:
    """One end of a job's channel: thread-safe sends, and receives for one reader thread.

    Args:
        connection: A connected ``multiprocessing.connection.Connection``.

    Attributes:
        connection: The connection (``multiprocessing.connection.wait`` takes it).
        failure: Why the last receive gave up, if the connection broke rather than ended
            (a message over :data:`MAX_MESSAGE` from a broken peer, an I/O error).
    """

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.failure: str | None = None
        # Connection.send_bytes is not thread-safe: a rank sends from its main thread, its
        # heartbeat thread and its row check.
        self._send_lock = threading.Lock()

    @classmethod
    def pair(cls) -> tuple[ChannelEnd, Connection]:
        """A new channel: this process's end, and the connection to hand to the rank."""
        ours, theirs = multiprocessing.Pipe(duplex=True)
        return cls(ours), theirs

    @classmethod
    def from_fd(cls, fd: int) -> ChannelEnd:
        """The end whose connected socket is descriptor ``fd`` (a rank's ``--fd``)."""
        return cls(Connection(fd))

    def send(self, kind: bytes, payload: bytes = b"") -> bool:
        """Sends one message; returns False when the peer is gone (nothing is raised)."""
        with self._send_lock:
            try:
                self.connection.send_bytes(kind + payload)
            except OSError:
                return False
        return True

    def send_step(self, step: int) -> bool:
        """Sends ``STEP`` for optimizer step ``step``."""
        return self.send(STEP, step_payload(step))

    def send_json(self, kind: bytes, value: Any) -> bool:
        """Sends a message whose payload is ``value`` as JSON."""
        return self.send(kind, json.dumps(value).encode())

    def recv(self) -> tuple[bytes, bytes] | None:
        """The next ``(kind, payload)``, blocking; ``None`` at end of file or once broken."""
        try:
            return _split(self.connection.recv_bytes(MAX_MESSAGE))
        except EOFError:
            return None
        except OSError as exc:
            self.failure = str(exc)
            return None

    def read_available(self) -> tuple[list[tuple[bytes, bytes]], bool]:
        """Receives every message that has arrived, without waiting for more (call when the
        connection is readable).

        A message is sent whole, so one whose start has arrived completes at once.

        Returns:
            The messages and whether the peer closed its end (or the connection broke).
        """
        messages: list[tuple[bytes, bytes]] = []
        try:
            while self.connection.poll():
                messages.append(_split(self.connection.recv_bytes(MAX_MESSAGE)))
        except EOFError:
            return messages, True
        except OSError as exc:
            self.failure = str(exc)
            return messages, True
        return messages, False

    def close(self) -> None:
        """Closes this end (idempotent)."""
        with contextlib.suppress(OSError):
            self.connection.close()


def _split(message: bytes) -> tuple[bytes, bytes]:
    return message[:1], message[1:]


def step_payload(step: int) -> bytes:
    """The payload of a ``STEP`` or ``END`` message."""
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
    """The JSON of an ``ERROR`` message.

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


def saved_payload(step: int, *, seconds: float, size: int, error: str | None) -> dict[str, Any]:
    """The JSON of a ``SAVED`` message.

    Args:
        step: The step the checkpoint is of.
        seconds: How long writing took.
        size: Bytes written.
        error: Why it was not written (a full disk); ``None`` when it was.
    """
    return {"step": step, "seconds": seconds, "size": size, "error": error}
