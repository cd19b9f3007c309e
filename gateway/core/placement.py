"""Where a job runs: how many trainer slots a task needs (``slots_needed``) and which reward
functions its trainers must offer (``rewards_needed``), one trainer's
share of a job (``Share``: its address and ranks) and the whole (``Placement``, rank 0's share
first).

A job runs on one trainer, or, when no trainer has the slots for it (GRPO only: one process,
and one slot, per rank), on several: each trainer runs a contiguous range of its ranks, rank 0's
trainer streams its episodes and checkpoints, and the others join it at the rendezvous rank 0's
trainer announces (``gateway.core.shares``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.core.trainers import JobPlacement
from trainwire.contract import DEFAULT_GRPO_PROCESSES, REWARD_FUNCTIONS
from trainwire.v1 import episode_pb2


def rewards_needed(task: episode_pb2.TrainTask) -> tuple[str, ...]:
    """The reward functions a job of ``task`` needs that not every trainer of its kind has:
    a GRPO task's ``MODULE:FUNCTION`` rewards (from a trainer's ``--reward-module``), in order.
    Every GRPO trainer offers the built-in ones, and a task that names none trains with its
    trainer's default ones, which that trainer offers: it needs none."""
    if task.WhichOneof("kind") != "grpo":
        return ()
    return tuple(name for name in task.grpo.reward_functions if name not in REWARD_FUNCTIONS)


def slots_needed(task: episode_pb2.TrainTask) -> int:
    """Trainer slots a job of ``task`` takes: a GRPO job one per process (``grpo.num_processes``,
    0 meaning the contract's default, 1, which every trainer advertises as
    ``ProviderDefaults.grpo.num_processes``: a run's slots are counted before a trainer is
    chosen), any other job one."""
    if task.WhichOneof("kind") == "grpo":
        return max(1, task.grpo.num_processes or DEFAULT_GRPO_PROCESSES)
    return 1


@dataclass(frozen=True, slots=True)
class Share:
    """One trainer's share of a job: ranks ``first_rank`` to ``first_rank + processes - 1``.

    Attributes:
        address: The trainer's ``HOST:PORT``.
        first_rank: The rank of its first process.
        processes: Its processes (and slots), at least 1.
    """

    address: str
    first_rank: int
    processes: int

    @property
    def ranks(self) -> str:
        """``ranks A-B`` (for people)."""
        return f"ranks {self.first_rank}-{self.first_rank + self.processes - 1}"


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one job runs: its shares, rank 0's first, their ranks contiguous.

    Attributes:
        shares: One per trainer, in rank order.
    """

    shares: tuple[Share, ...]

    def __post_init__(self) -> None:
        if not self.shares:
            raise ValueError("a placement has at least one share")
        rank = 0
        for share in self.shares:
            if share.first_rank != rank or share.processes < 1:
                raise ValueError(f"shares must cover the ranks in order: {self.shares}")
            rank += share.processes

    @classmethod
    def of(cls, parts: Sequence[tuple[str, int]]) -> Placement:
        """The placement of ``(address, processes)`` parts, rank 0's first."""
        shares = []
        rank = 0
        for address, processes in parts:
            shares.append(Share(address, rank, processes))
            rank += processes
        return cls(tuple(shares))

    @property
    def world_size(self) -> int:
        """Processes in the whole job."""
        last = self.shares[-1]
        return last.first_rank + last.processes

    @property
    def rank0(self) -> Share:
        """Rank 0's share: its trainer streams the episodes, takes grants and controls."""
        return self.shares[0]

    @property
    def others(self) -> tuple[Share, ...]:
        """The other trainers' shares (none for a job on one trainer)."""
        return self.shares[1:]

    @property
    def spans(self) -> bool:
        """Whether the job spans several trainers."""
        return len(self.shares) > 1

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every trainer of the job, rank 0's first (``Run.trainers``)."""
        return tuple(s.address for s in self.shares)

    def job_placement(self, share: Share, rendezvous: str = "") -> JobPlacement | None:
        """The ``TrainRequest.placement`` of ``share``: None for a job on one trainer (the
        whole job runs there)."""
        if not self.spans:
            return None
        return JobPlacement(self.world_size, share.first_rank, share.processes, rendezvous)

    def who(self, share: Share) -> str:
        """``trainer HOST:PORT (ranks A-B of N)`` (for people)."""
        return f"trainer {share.address} ({share.ranks} of {self.world_size})"

    def describe(self) -> str:
        """``A`` for a job on one trainer, ``A (ranks 0-1), B (ranks 2-2)`` for one that spans
        trainers."""
        if not self.spans:
            return self.rank0.address
        return ", ".join(f"{s.address} ({s.ranks})" for s in self.shares)
