"""One trainer's share of a job whose ranks span several trainers: :class:`Placement` (from
``TrainRequest.placement``) and the request's rules for it (:func:`check_placement`).

A GRPO job of ``world_size`` ranks may run on several trainers, each running a contiguous range
of ranks (its *share*): ``first_rank`` to ``first_rank + processes - 1``, on ``processes`` of its
own slots. Rank 0's trainer hosts the job's rendezvous on its ``--rendezvous-host``, announces
it on its stream, streams the episodes and writes the checkpoints; every other trainer is
started with that address, streams heartbeats only and ends OK with the job.

This module imports neither grpc nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainwire.contract import FieldViolation, task_kind
from trainwire.v1 import trainer_service_pb2

#: Where a trainer hosts the rendezvous of its jobs that span trainers unless told otherwise
#: (``--rendezvous-host``): loopback, so several trainers of one machine can share a job.
DEFAULT_RENDEZVOUS_HOST = "127.0.0.1"

_FIELD = "placement"
#: How much of a bad rendezvous value a violation quotes.
_QUOTED = 80


@dataclass(frozen=True)
class Placement:
    """One trainer's share of a job whose ranks span trainers.

    Attributes:
        world_size: Ranks in the whole job.
        first_rank: The global rank of this share's first process.
        processes: Processes (and slots) of the share on this trainer.
        rendezvous: ``HOST:PORT`` of the job's rendezvous; empty on rank 0's trainer, which
            hosts it.
    """

    world_size: int
    first_rank: int
    processes: int
    rendezvous: str = ""

    @property
    def hosts_rendezvous(self) -> bool:
        """Whether this is rank 0's share: it hosts the rendezvous, streams the episodes and
        writes the checkpoints."""
        return self.first_rank == 0

    @property
    def ranks(self) -> range:
        """The global ranks of this share, in order."""
        return range(self.first_rank, self.first_rank + self.processes)

    @classmethod
    def from_proto(cls, message: trainer_service_pb2.JobPlacement) -> Placement:
        """The placement a request carries (checked by :func:`check_placement`)."""
        return cls(message.world_size, message.first_rank, message.processes, message.rendezvous)


def placement_of(request: trainer_service_pb2.TrainRequest) -> Placement | None:
    """The request's placement; ``None`` when the whole job runs on this trainer."""
    if not request.HasField("placement"):
        return None
    return Placement.from_proto(request.placement)


def split_host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``HOST:PORT`` (an IPv6 host in brackets); ``None`` when it is not one
    (no host, or a port outside 1..65535)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:  # an IPv6 host needs brackets
        return None
    if not host or any(c.isspace() or c in "[]/@" for c in host):
        return None
    return host, int(port)


def check_placement(request: trainer_service_pb2.TrainRequest) -> list[FieldViolation]:
    """Every bad field of the request's placement (none when it has no placement).

    The rules: only a grpo task's ranks span trainers; ``world_size`` is the task's
    ``grpo.num_processes`` (1 when 0); ``processes`` >= 1; ``first_rank`` >= 0; the share
    fits in the world (``first_rank + processes <= world_size``); ``rendezvous`` is empty on
    rank 0's trainer (``first_rank`` 0) and ``HOST:PORT`` on the others.
    """
    if not request.HasField("placement"):
        return []
    if task_kind(request.task) != "grpo":
        return [
            FieldViolation(
                _FIELD,
                "only a grpo job's processes can span trainers; leave placement unset for "
                f"a {task_kind(request.task) or 'task without a kind'}",
            )
        ]
    placement = Placement.from_proto(request.placement)
    out: list[FieldViolation] = []
    world = max(1, request.task.grpo.num_processes)
    if placement.world_size != world:
        out.append(
            FieldViolation(
                f"{_FIELD}.world_size",
                f"{placement.world_size}; must be the task's grpo.num_processes ({world})",
            )
        )
    if placement.processes < 1:
        out.append(FieldViolation(f"{_FIELD}.processes", f"{placement.processes}; need >= 1"))
    if placement.first_rank < 0:
        out.append(FieldViolation(f"{_FIELD}.first_rank", f"{placement.first_rank}; need >= 0"))
    elif placement.processes >= 1 and placement.first_rank + placement.processes > max(
        placement.world_size, 0
    ):
        out.append(
            FieldViolation(
                f"{_FIELD}.processes",
                f"ranks {placement.first_rank}..{placement.first_rank + placement.processes - 1} "
                f"do not fit in world_size {placement.world_size}: need first_rank + processes "
                "<= world_size",
            )
        )
    if placement.first_rank == 0 and placement.rendezvous:
        out.append(
            FieldViolation(
                f"{_FIELD}.rendezvous",
                "must be empty on rank 0's trainer (first_rank 0): it hosts the rendezvous and "
                "announces it on its stream",
            )
        )
    elif placement.first_rank > 0 and split_host_port(placement.rendezvous) is None:
        quoted = placement.rendezvous[:_QUOTED]
        out.append(
            FieldViolation(
                f"{_FIELD}.rendezvous",
                f"{quoted!r}; need HOST:PORT of the job's rendezvous (the address rank 0's "
                "trainer announced)",
            )
        )
    return out
