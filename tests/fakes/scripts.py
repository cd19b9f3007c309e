"""What one ``Train`` call of the fake trainer does: the ``Script`` and the rules it can break.

``tests.fakes.fake_trainer.FakeTrainer`` plays one ``Script`` per call; ``VIOLATIONS`` names the
contract rules ``Script.violate`` may break: ``tests.fakes.episodes.broken`` builds the bad
episodes, and ``done_missing`` and ``end_without_done`` end the stream early instead.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import grpc

from trainwire.v1 import episode_pb2

#: Contract rules a script can break (``Script.violate``).
VIOLATIONS = (
    "sequence",
    "finite",
    "metric_finite",
    "best_reward",
    "done",
    "done_missing",
    "detail_kind",
    "detail_size",
    "end_without_done",
)


@dataclass
class Script:
    """How one ``Train`` call behaves.

    Attributes:
        episodes: Episodes to send (default: the request's max_episodes).
        interval: Seconds between episodes (heartbeats are sent meanwhile).
        heartbeat_interval: Seconds between heartbeats while no episode goes out.
        silent: Send nothing at all (until cancelled).
        ignore_grants: Stream without waiting for grants.
        abort_after: Abort after this many episodes (``abort_code``; with ``localized`` the
            details carry a LocalizedMessage).
        abort_code: Status code of the abort.
        abort_reason: The abort's ErrorInfo reason (a rich status even without ``localized``);
            None: a plain status unless ``localized`` is given (then PROVIDER_FAILED).
        localized: The LocalizedMessage text for users.
        violate: A rule from ``VIOLATIONS`` broken at episode ``violate_at``.
        violate_at: Where the violation happens.
        hold_at: Before sending this episode, wait for ``release`` (or cancellation).
        detail_every: Imitation detail on every n-th episode and on the last.
        frames: Frames of the imitation detail.
        joints: Joints of the imitation detail (32 with 240 frames: the contract's largest).
        motion: Send ``scripted_episodes``: a reward curve that rises and, for imitation runs,
            the motion of the task's own rig and clip (the CLI's pictures need it).
        stream: Send these episodes instead (a valid stream the test built; ``episodes`` still
            cuts it).
    """

    episodes: int | None = None
    interval: float = 0.0
    heartbeat_interval: float = 0.05
    silent: bool = False
    ignore_grants: bool = False
    abort_after: int | None = None
    abort_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    abort_reason: str | None = None
    localized: str | None = None
    violate: str | None = None
    violate_at: int = 3
    hold_at: int | None = None
    release: threading.Event = field(default_factory=threading.Event)
    detail_every: int = 10
    frames: int = 60
    joints: int = 11
    motion: bool = False
    stream: tuple[episode_pb2.Episode, ...] | None = None
