"""A rank's side of the rendezvous of a GRPO job whose ranks span several trainers (imported by
ranks only: it needs torch).

The ranks meet in a torch ``TCPStore`` that rank 0 hosts on the listening socket its trainer
bound on ``--rendezvous-host`` (``master_listen_fd``): the trainer announces the address before
rank 0 has even started, and a rank that connects early waits in the socket's backlog. Every
other rank connects as a client. In the store each rank records where it starts (run id and
first step) and counts itself in; once all ``world_size`` are in and agree, they form the
process group (gloo on CPU, NCCL on CUDA) over a prefix of the same store, its collectives
timing out after :data:`COLLECTIVE_TIMEOUT_S`. Ranks that would start at different steps (one
resumed, one not) fail at once with ``FAILED_PRECONDITION``.

Controls: each trainer drives its own ranks over their pipes, but only rank 0's trainer
decides the steps. Rank 0 (:class:`ControlRelay`) publishes every control message it reads
from its pipe (``STEP``, ``STOP``, ``SAVE``, ``HYPER``) in order into the store
(``trainwire/ctl/0``, ``/1``, ...; those read before the store exists wait in the channel).
Every rank on another trainer (:class:`ControlFollower`) reads them in order with a store
client of its own, polling every :data:`POLL_S` (never ``store.wait``: a wait with a timeout
cannot tell a paused job from a dead one), and feeds them into the queue its pipe feeds. So
every rank runs the same steps, stops at the same boundary, and a paused job waits with no
collective pending. A follower acknowledges each message (``trainwire/ack/<rank>``): rank 0
deletes what every follower read, and before it exits at the job's end it waits (at most
:data:`DRAIN_S`) until they have read its last one, the ``STOP``. The ranks on rank 0's own
trainer read their pipe only.

Failures: a follower that loses the store (rank 0 or its trainer gone) reports a
``ProviderError`` (``PROCESS_DIED``) naming the rendezvous and exits. Rank 0 learns of a dead
peer in its next collective (gloo sees the connection close), or, while the job waits between
steps, from the follower's heartbeat in the store (``trainwire/beat/<rank>``, every
:data:`BEAT_S`) standing still for :data:`PEER_SILENT_S`. Either way a collective's failure
on a lost peer reads as ``PROCESS_DIED`` (:meth:`Meeting.explain`).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import torch
import torch.distributed as dist

from trainer_service.core.provider import ProviderError
from trainer_service.providers.grpo import wire
from trainer_service.providers.grpo.launch import FOLLOW, HOST

_LOGGER = logging.getLogger(__name__)

#: How long a collective may wait for a peer before it fails.
COLLECTIVE_TIMEOUT_S = 120.0
#: How long rank 0 waits for the ranks of the other trainers to join.
JOIN_TIMEOUT_S = 300.0
#: How long a store client tries to reach the store, and a store call may block.
STORE_TIMEOUT_S = 60.0
#: Seconds between a follower's looks for the next control.
POLL_S = 0.015
#: Seconds between a follower's heartbeats in the store.
BEAT_S = 1.0
#: A follower whose heartbeat stood still this long is taken for dead by rank 0.
PEER_SILENT_S = 10.0
#: At the job's end, how long rank 0 waits for the followers to read its last control.
DRAIN_S = 3.0

_PREFIX = "trainwire"
_CONTROL = _PREFIX + "/ctl/{}"
_ACK = _PREFIX + "/ack/{}"
_BEAT = _PREFIX + "/beat/{}"
_START = _PREFIX + "/start/{}"
_JOINED = _PREFIX + "/joined"
_GROUP_PREFIX = _PREFIX + "/pg"
#: What gloo (and NCCL) say when a peer's connection went away.
_LOST_PEER_SIGNS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote worker crashing",
)


class Controls(Protocol):
    """What the meeting needs of the rank's channel to its trainer (``worker.RankChannel``)."""

    stopped: threading.Event  #: set once a STOP arrived
    finishing: threading.Event  #: set once the rank is done

    def feed(self, kind: bytes, payload: bytes) -> None:
        """Hands a control message to the rank as if it came over the pipe."""
        ...

    def relay_to(self, publish: Callable[[bytes, bytes], None] | None) -> None:
        """Publishes every control read from the pipe (those held so far first); ``None``
        drops them."""
        ...

    def send_phase(self, phase: str) -> None:
        """Reports what the rank does."""
        ...


@dataclass(frozen=True)
class MeetingSpec:
    """The ``meeting`` part of a placed rank's job spec (``launch.job_spec``)."""

    run_id: str
    rank: int
    world_size: int
    local_rank: int
    backend: str
    role: str
    host: str
    port: int
    address: str
    listen_fd: int | None
    remote_ranks: tuple[int, ...]

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> MeetingSpec:
        meeting = spec["meeting"]
        fd = meeting.get("listen_fd")
        return cls(
            run_id=str(spec["run_id"]),
            rank=int(spec["rank"]),
            world_size=int(spec["world_size"]),
            local_rank=int(spec.get("local_rank", 0)),
            backend=str(spec.get("backend") or "gloo"),
            role=str(meeting["role"]),
            host=str(meeting["host"]),
            port=int(meeting["port"]),
            address=str(meeting["address"]),
            listen_fd=int(fd) if fd is not None else None,
            remote_ranks=tuple(int(r) for r in meeting.get("remote_ranks", ())),
        )


def _store(spec: MeetingSpec, *, master: bool = False) -> dist.TCPStore:
    timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
    if master:
        return dist.TCPStore(
            spec.host,
            spec.port,
            None,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=spec.listen_fd,
        )
    # Rank 0's trainer listens there before it tells anyone the address, so a refused
    # connection means rank 0 is gone; TCPStore would retry it until its timeout.
    socket.create_connection((spec.host, spec.port), timeout=STORE_TIMEOUT_S).close()
    return dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timeout)


def lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is a collective or store call failing on a peer that went away."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(sign in text for sign in _LOST_PEER_SIGNS)


class Meeting:
    """A placed rank's rendezvous: the store, the join, and rank 0's relay or a follower.

    Args:
        spec: The rank's job spec (with ``meeting``).
        controls: The rank's channel to its trainer.
        on_lost: Reports a fatal failure found off the main thread and exits the rank.
    """

    def __init__(
        self,
        spec: Mapping[str, Any],
        controls: Controls,
        on_lost: Callable[[ProviderError], NoReturn],
    ) -> None:
        self.spec = MeetingSpec.from_spec(spec)
        if self.spec.listen_fd is not None:
            # Rank 0's alone: a DataLoader worker holding it would keep the port open after
            # rank 0 is gone, and the other trainers' ranks would wait instead of failing.
            os.set_inheritable(self.spec.listen_fd, False)
        self.controls = controls
        self.on_lost = on_lost
        self.store: dist.TCPStore | None = None
        self.lost_store = threading.Event()  #: a follower found the store gone
        self.relay: ControlRelay | None = None

    @property
    def relays_controls(self) -> bool:
        """Whether this rank relays its controls to the other trainers' ranks (rank 0)."""
        return self.spec.role == HOST

    def join(self, first_step: int) -> bool:
        """Connects to the store, waits for every rank of the job and forms the process group.

        Args:
            first_step: The step this rank trains first (1, or a checkpoint's step + 1).

        Returns:
            False when the rank was stopped while it waited.

        Raises:
            ProviderError: The others did not join in time, or would start elsewhere.
            RuntimeError: The store is unreachable (see :meth:`explain`).
        """
        spec = self.spec
        world = spec.world_size
        self.store = store = _store(spec, master=spec.role == HOST)
        if spec.role == HOST:
            self.relay = ControlRelay(spec, self.on_lost)
            self.controls.relay_to(self.relay.publish)
        elif spec.role == FOLLOW:
            ControlFollower(spec, self.controls, self._lost).start()
        store.set(
            _START.format(spec.rank), json.dumps({"run_id": spec.run_id, "start": first_step})
        )
        store.add(_JOINED, 1)
        others = world - 1
        self.controls.send_phase(
            f"waiting for {others} process{'es' if others != 1 else ''} of the job at "
            f"{spec.address}"
        )
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while store.add(_JOINED, 0) < world:
            if self.controls.stopped.is_set():
                return False
            if time.monotonic() > deadline:
                raise ProviderError(
                    f"The job's processes on the other trainers did not join it within "
                    f"{JOIN_TIMEOUT_S:g} s.",
                    detail=f"rank {spec.rank}: {store.add(_JOINED, 0)} of {world} at "
                    f"{spec.address}",
                    code="INTERNAL",
                    reason="PROCESS_DIED",
                )
            time.sleep(POLL_S)
        self._check_starts(store)
        if world > 1:
            if spec.backend == "nccl":
                torch.cuda.set_device(spec.local_rank)
            dist.init_process_group(
                spec.backend,
                store=dist.PrefixStore(_GROUP_PREFIX, store),
                rank=spec.rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
            )
        if self.relay is not None:
            self.relay.watch_followers()
        _LOGGER.info(
            "run %s: rank %d of %d joined the job at %s",
            spec.run_id,
            spec.rank,
            world,
            spec.address,
            extra={"run_id": spec.run_id},
        )
        return True

    def _check_starts(self, store: dist.TCPStore) -> None:
        starts = {
            rank: json.loads(store.get(_START.format(rank))) for rank in range(self.spec.world_size)
        }
        if len({(s["run_id"], s["start"]) for s in starts.values()}) == 1:
            return
        where = ", ".join(f"rank {r} at step {s['start']}" for r, s in starts.items())
        runs = {s["run_id"] for s in starts.values()}
        raise ProviderError(
            "The job's processes on different trainers would not start from the same "
            f"checkpoint ({where}); every trainer must restore the checkpoint rank 0 restores.",
            detail=f"runs {sorted(runs)} at {self.spec.address}",
        )

    def _lost(self, error: BaseException) -> NoReturn:
        self.lost_store.set()
        self.on_lost(self.lost_rendezvous(error))

    def lost_rendezvous(self, error: BaseException) -> ProviderError:
        """The failure of a rank that lost the job's store (rank 0 or its trainer gone)."""
        spec = self.spec
        return ProviderError(
            f"Training process rank {spec.rank} of {spec.world_size} lost the job's "
            f"rendezvous at {spec.address}: rank 0 or its trainer is gone.",
            detail=f"{type(error).__name__}: {error}",
            code="INTERNAL",
            reason="PROCESS_DIED",
        )

    def explain(self, error: BaseException) -> BaseException:
        """What a failure of this rank means in a job that spans trainers: a store or collective
        lost to a peer that went away is ``PROCESS_DIED``; anything else is ``error``."""
        spec = self.spec
        if self.lost_store.is_set() or (spec.role != HOST and self._store_gone(error)):
            return self.lost_rendezvous(error)
        if not lost_peer(error):
            return error
        return ProviderError(
            f"Training process rank {spec.rank} of {spec.world_size} lost contact with "
            "another process of the job: it, or the trainer running it, stopped.",
            detail=f"{type(error).__name__}: {error}",
            code="INTERNAL",
            reason="PROCESS_DIED",
        )

    def _store_gone(self, error: BaseException) -> bool:
        """Whether rank 0's store is out of reach (``error``: what this rank failed with)."""
        store = self.store
        if store is None:  # it never connected
            return lost_peer(error) or isinstance(error, OSError)
        try:
            store.check([_JOINED])
        except RuntimeError:
            return True
        return False

    def drain(self) -> None:
        """Rank 0 at the job's end: lets the followers read the last control (bounded)."""
        if self.relay is not None:
            self.relay.drain(DRAIN_S)


class ControlRelay:
    """Rank 0's publisher of its controls (see the module docstring), with a store client of
    its own, and its watch over the followers' heartbeats."""

    def __init__(self, spec: MeetingSpec, on_lost: Callable[[ProviderError], NoReturn]) -> None:
        self.spec = spec
        self.on_lost = on_lost
        self._store = _store(spec)
        self._lock = threading.Lock()  # one client, used by the pipe reader and the watcher
        self._published = 0  #: controls published so far
        self._deleted = 0  #: controls below this index are deleted from the store
        self._stop_published = threading.Event()

    def publish(self, kind: bytes, payload: bytes) -> None:
        """Publishes the next control (called by the pipe reader, in the order it read them).

        Never raises: the store is this rank's own, and the reader must go on reading its
        pipe; a follower that misses a control fails in the step's collective.
        """
        with self._lock:
            try:
                # bytes as they are (the stubs say str; the binding takes both)
                self._store.set(_CONTROL.format(self._published), kind + payload)  # type: ignore[arg-type]
            except RuntimeError:
                _LOGGER.exception("run %s: could not relay a control", self.spec.run_id)
                return
            self._published += 1
        if kind == wire.STOP:
            self._stop_published.set()

    def watch_followers(self) -> None:
        """Starts the thread that takes a follower whose heartbeat stood still for dead, and
        deletes the controls every follower has read."""
        if self.spec.remote_ranks:
            threading.Thread(target=self._watch, name="trainwire-relay-watch", daemon=True).start()

    def _acks(self) -> list[int]:
        """The last control index each follower read (-1: none yet); call with the lock."""
        keys = [_ACK.format(rank) for rank in self.spec.remote_ranks]
        return [int(self._store.get(key)) if self._store.check([key]) else -1 for key in keys]

    def _watch(self) -> None:
        ranks = self.spec.remote_ranks
        beats: dict[int, tuple[int, float]] = {}
        while not self._stop_published.wait(BEAT_S):
            now = time.monotonic()
            try:
                with self._lock:
                    counts = [self._store.add(_BEAT.format(rank), 0) for rank in ranks]
                    read = min(self._acks())
                    for index in range(self._deleted, read + 1):
                        self._store.delete_key(_CONTROL.format(index))
                    self._deleted = max(self._deleted, read + 1)
            except RuntimeError:  # this rank's own store: only gone with the rank
                return
            for rank, count in zip(ranks, counts, strict=True):
                seen = beats.get(rank)
                if seen is None or seen[0] != count:
                    beats[rank] = (count, now)
                elif now - seen[1] > PEER_SILENT_S and not self._stop_published.is_set():
                    self.on_lost(
                        ProviderError(
                            f"Training process rank {rank} of {self.spec.world_size} (on "
                            f"another trainer) stopped responding for {PEER_SILENT_S:g} s: "
                            "it, or the trainer running it, is gone.",
                            detail=f"its heartbeat in the store at {self.spec.address} "
                            f"stood at {count}",
                            code="INTERNAL",
                            reason="PROCESS_DIED",
                        )
                    )

    def drain(self, timeout: float) -> None:
        """Waits until every follower read every control published (at most ``timeout``)."""
        deadline = time.monotonic() + timeout
        last = self._published - 1
        while self.spec.remote_ranks:
            try:
                with self._lock:
                    acks = self._acks()
            except RuntimeError:
                return
            if min(acks) >= last or time.monotonic() > deadline:
                if min(acks) < last:
                    _LOGGER.warning(
                        "run %s: the job's ranks on other trainers read controls up to %s "
                        "of %d before rank 0 ended",
                        self.spec.run_id,
                        acks,
                        last,
                        extra={"run_id": self.spec.run_id},
                    )
                return
            time.sleep(POLL_S)


class ControlFollower:
    """A rank of another trainer: reads rank 0's controls from the store into its own queue
    (see the module docstring), and beats in the store.

    Args:
        spec: The rank's meeting.
        controls: Where the controls go (the rank's channel).
        on_lost: Called (and exits the rank) when the store cannot be reached.
    """

    def __init__(
        self,
        spec: MeetingSpec,
        controls: Controls,
        on_lost: Callable[[BaseException], NoReturn],
    ) -> None:
        self.spec = spec
        self.controls = controls
        self.on_lost = on_lost
        self._store = _store(spec)

    def start(self) -> None:
        """Starts the follower thread."""
        threading.Thread(target=self._follow, name="trainwire-follower", daemon=True).start()

    def _follow(self) -> None:
        store, rank = self._store, self.spec.rank
        index, beat_at = 0, 0.0
        while True:
            try:
                key = _CONTROL.format(index)
                if store.check([key]):
                    message = store.get(key)
                    kind, payload = message[:1], message[1:]
                    self.controls.feed(kind, payload)
                    store.set(_ACK.format(rank), str(index))
                    index += 1
                    if kind == wire.STOP:
                        return  # nothing follows a stop
                    continue
                now = time.monotonic()
                if now - beat_at >= BEAT_S:
                    store.add(_BEAT.format(rank), 1)
                    beat_at = now
            except RuntimeError as exc:  # DistNetworkError and friends: the store is gone
                if self.controls.finishing.is_set():
                    return
                self.on_lost(exc)
            time.sleep(POLL_S)
