"""One rank of a GRPO job: ``python -m trainer_service.providers.grpo.worker --fd N ...``.

The trainer starts one of these per process of a job (see :mod:`.process`; of a job that spans
trainers, per process of its share), forked by its rank launcher (:mod:`.launch`), which runs
this module as ``python -m`` would; all in one process group, each with its own end of the
job's channel (``--fd``, see :mod:`.wire`). A rank:

1. arms its lifeline first (:func:`.lifeline.arm_rank`: the group dies with the trainer), then
   reads its ``JOB`` spec and sets its logging up like the trainer's (before torch and friends
   are imported, so nothing they print at import escapes it);
2. joins torch.distributed when the job has several processes (gloo on CPU, NCCL on CUDA,
   rendezvous through a file in the job's scratch directory; a job whose ranks span trainers
   meets in rank 0's ``TCPStore`` instead, see :mod:`.rendezvous`) and builds the job's
   ``LazyGRPOTrainer`` (:mod:`.build`), the same on every rank: TRL's own sampler and gathering
   do the rest. Every rank decodes its own rows in its own DataLoader workers; the index stream
   comes from each rank's ``RepeatSampler`` (one seed for all ranks), never from a worker;
3. trains one optimizer step per ``STEP`` message. Its callback (:class:`.callback.StepGate`)
   waits for the next message at each step's ``on_log``, after the step's collectives are done,
   so a paused job waits with no collective pending (none can time out), and every rank reads
   the same messages, so all ranks run the same steps and stop at the same boundary (a
   ``STOP`` reaches every rank within one optimizer step). Rank 0 sends each step's episode
   before it waits. A ``SAVE`` read while waiting checkpoints the step just finished, on every
   rank at once (:mod:`.checkpoint`); rank 0 answers ``SAVED``, and the rank waits on; a
   ``HYPER`` changes the learning rate, temperature or beta of the next step, on every rank at
   the same boundary. In a job that spans trainers, rank 0 relays every control it reads to
   the ranks of the other trainers, which read them from the store into the same queue
   (:mod:`.rendezvous`); their pipe still brings ``JOB``, their own trainer's ``STOP`` and end
   of file. A job spec with ``resume`` builds the trainer from that checkpoint and resumes at
   its next step; a checkpoint that does not load is reported as such (``ERROR`` of kind
   ``checkpoint``);
4. reports ``END`` (with the last step it finished) when training returned, or ``ERROR`` (a
   ``ProviderError`` as it is, a failure with a known cause as the ``ProviderError`` that
   :func:`translate_error` makes of it, anything else as a crash with its traceback; in a job
   that spans trainers, a peer or rendezvous lost as ``PROCESS_DIED``), and exits at once.

Phases go to the trainer as ``PHASE`` messages and a ``BEAT`` goes out every second from a thread
of its own, so the trainer sees a slow load or step, and a rank that went silent.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import json
import logging
import os
import pathlib
import pickle
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from trainer_service.providers.grpo import lifeline, wire

if TYPE_CHECKING:
    from trainer_service.providers.grpo.rendezvous import Meeting
    from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger("trainer_service.providers.grpo.worker")

#: How long a rank waits for its job spec before giving up.
JOB_TIMEOUT_S = 60.0
#: What a user reads when a GPU ran out of memory.
OUT_OF_MEMORY_ADVICE = (
    "The GPU ran out of memory; try a smaller batch_size or max_completion_length."
)


class RankChannel:
    """A rank's side of the channel: a reader thread, a heartbeat thread and the step queue.

    The reader is the only thread that reads the channel. End of file there means the trainer
    is gone (or gave up on this job) while the rank still works: it kills the job's group.
    Until :meth:`relay_to` says where, the reader also holds every control it read, for rank 0
    of a job that spans trainers to publish once its store exists.

    Args:
        end: The rank's end of the job's channel.
        beat_s: Seconds between ``BEAT`` messages.
    """

    def __init__(self, end: wire.ChannelEnd, beat_s: float = 1.0) -> None:
        self.end = end
        self.beat_s = beat_s
        self.stopped = threading.Event()  #: set once a STOP arrived
        self.last_step = 0  #: the last optimizer step this rank finished (reported with END)
        self.finishing = threading.Event()  #: set once the rank is done: EOF is expected
        #: Writes the checkpoint a ``SAVE`` asks for (its JSON payload); set once training can.
        self.on_save: Callable[[Mapping[str, Any]], None] | None = None
        #: Applies the hyperparameters a ``HYPER`` carries; set once training can.
        self.on_hyperparameters: Callable[[Mapping[str, float]], None] | None = None
        self._job: queue.Queue[bytes] = queue.Queue(maxsize=1)
        self._controls: queue.Queue[tuple[bytes, bytes]] = queue.Queue()
        self._relay_lock = threading.Lock()
        self._held: list[tuple[bytes, bytes]] | None = []  # None: nothing to relay
        self._publish: Callable[[bytes, bytes], None] | None = None

    def start(self) -> None:
        """Starts the reader and heartbeat threads."""
        threading.Thread(target=self._read, name="trainwire-rank-reader", daemon=True).start()
        threading.Thread(target=self._beat, name="trainwire-rank-beat", daemon=True).start()

    def _read(self) -> None:
        while True:
            message = self.end.recv()
            if message is None:
                if not self.finishing.is_set():
                    lifeline.kill_own_group("the trainer closed this job's channel")
                self._controls.put((wire.STOP, b""))
                return
            kind, payload = message
            if kind == wire.JOB:
                self._job.put(payload)
            elif kind in (wire.STEP, wire.STOP, wire.SAVE, wire.HYPER):
                with self._relay_lock:  # relayed in the order read, before this rank acts
                    if self._publish is not None:
                        self._publish(kind, payload)
                    elif self._held is not None:
                        self._held.append(message)
                self.feed(kind, payload)

    def feed(self, kind: bytes, payload: bytes) -> None:
        """Queues a control message for the rank (from the pipe, or relayed from rank 0)."""
        if kind == wire.STOP:
            self.stopped.set()
        self._controls.put((kind, payload))

    def relay_to(self, publish: Callable[[bytes, bytes], None] | None) -> None:
        """Hands every control read so far, then each one read, to ``publish`` (called with
        the relay's lock held, in order); ``None``: this rank relays nothing."""
        with self._relay_lock:
            held, self._held = self._held or [], None
            if publish is not None:
                for kind, payload in held:
                    publish(kind, payload)
            self._publish = publish

    def _beat(self) -> None:
        while not self.finishing.wait(self.beat_s):
            if not self.end.send(wire.BEAT):
                return

    def job(self, timeout: float) -> dict[str, Any] | None:
        """The job spec; ``None`` when none came in time."""
        try:
            return dict(json.loads(self._job.get(timeout=timeout)))
        except queue.Empty:
            return None

    def wait_step(self, step: int) -> bool:
        """Blocks for the next ``STEP`` or ``STOP``: True for ``STEP step``, False for ``STOP``.
        A ``SAVE`` that comes first is handed to :attr:`on_save`, a ``HYPER`` to
        :attr:`on_hyperparameters`, and the wait goes on.

        Raises:
            RuntimeError: A ``STEP`` for another step, or a ``SAVE`` or ``HYPER`` before
                training started (the trainer broke the protocol).
        """
        while True:
            kind, payload = self._controls.get()
            if kind == wire.SAVE:
                if self.on_save is None:
                    raise RuntimeError("the trainer asked for a checkpoint before training started")
                self.on_save(dict(json.loads(payload)))
            elif kind == wire.HYPER:
                if self.on_hyperparameters is None:
                    raise RuntimeError("the trainer sent hyperparameters before training started")
                self.on_hyperparameters(dict(json.loads(payload)))
            else:
                break
        if kind == wire.STOP:
            return False
        granted = wire.step_of(payload)
        if granted != step:
            raise RuntimeError(f"the trainer granted step {granted} where {step} was next")
        return True

    def send_phase(self, phase: str) -> None:
        """Reports what the rank does."""
        self.end.send(wire.PHASE, phase.encode())

    def send_episode(self, episode: episode_pb2.Episode) -> None:
        """Sends one step's episode (rank 0)."""
        self.end.send(wire.EPISODE, episode.SerializeToString())


def _apply_logging(spec: Mapping[str, Any]) -> None:
    """Sets this process's logging up like the trainer's (format, level, library output)."""
    from trainer_service.providers.grpo.library_output import WorkerLogging

    log = spec.get("log") or {}
    formatter = None
    if log.get("formatter"):
        formatter = pickle.loads(base64.b64decode(log["formatter"]))  # the trainer's own formatter
    WorkerLogging(None, formatter, int(log.get("level", logging.INFO)))(0)


def _set_up_distributed(spec: Mapping[str, Any]) -> None:
    """Joins the job's process group (``world_size`` > 1, all ranks on this trainer)."""
    import torch
    import torch.distributed as dist

    rank, world = int(spec["rank"]), int(spec["world_size"])
    if spec["backend"] == "nccl":
        torch.cuda.set_device(int(spec.get("local_rank", rank)))
    dist.init_process_group(
        spec["backend"], init_method=spec["rendezvous"], rank=rank, world_size=world
    )


def _train(
    spec: Mapping[str, Any],
    channel: RankChannel,
    build: Callable[..., Any] | None,
    meeting: Meeting | None = None,
) -> None:
    """Builds the trainer and trains one step per ``STEP`` message (see the module docstring).

    ``meeting``: the rendezvous of a job that spans trainers (None: all ranks are here).
    """
    from trainer_service.core.provider import EpisodeCounter, RestoredCheckpoint, TrainJob
    from trainer_service.providers.grpo import checkpoint_files
    from trainwire.v1 import episode_pb2

    rank, world = int(spec["rank"]), int(spec["world_size"])
    # The spec first: a bad one fails in milliseconds, before seconds of imports.
    task = episode_pb2.TrainTask.FromString(base64.b64decode(spec["task"]))
    config = episode_pb2.TrainConfig.FromString(base64.b64decode(spec["config"]))
    cache = spec.get("image_cache_dir")
    resume = spec.get("resume")
    restored = None
    if resume:
        restored = RestoredCheckpoint(
            pathlib.Path(resume["directory"]), int(resume["episode"]), resume["best_reward"]
        )
    channel.send_phase("loading libraries")
    if build is None:
        from trainer_service.providers.grpo.build import build_trainer

        build = build_trainer
    from trainer_service.providers.grpo.callback import EpisodeMaker, StepGate
    from trainer_service.providers.grpo.rewards import CompletionTap

    first = restored.episode + 1 if restored else 1
    channel.last_step = first - 1
    if meeting is not None:
        if not meeting.join(first):
            return  # stopped while the job's ranks gathered
    elif world > 1:
        channel.send_phase(f"joining {world} processes")
        _set_up_distributed(spec)
    job = TrainJob(
        run_id=spec["run_id"],
        task=task,
        config=config,
        device=spec["device"],
        data_root=pathlib.Path(spec["data_roots"][0]),
        more_data_roots=tuple(pathlib.Path(root) for root in spec["data_roots"][1:]),
        image_cache_dir=pathlib.Path(cache) if cache else None,
        reward_modules=tuple(spec.get("reward_modules") or ()),
        stop_event=channel.stopped,
        set_phase=channel.send_phase,
        resume=restored,
    )
    tap = CompletionTap()
    maker = None
    if rank == 0:
        maker = EpisodeMaker(EpisodeCounter(config.max_episodes, restored), tap)
        if resume:
            maker.last_reward = resume.get("last_reward")
    gate = StepGate(maker, channel, config.max_episodes)
    scan_stop = threading.Event()
    try:
        trainer = build(job, [gate], output_dir=spec["output_dir"], tap=tap)
        channel.on_save = _checkpoint_writer(trainer, channel, maker, rank)
        channel.on_hyperparameters = lambda values: trainer.set_hyperparameters(**values)
        if maker is not None:
            maker.hyperparameters = trainer.sampling_hyperparameters
            maker.meter = trainer.step_meter
        if rank == 0 and trainer.lazy_dataset is not None:
            lazy = trainer.lazy_dataset

            def check_rows() -> None:
                # A bad row anywhere fails the job within seconds, not when training reads it.
                try:
                    lazy.check_rows(scan_stop)
                except Exception as exc:  # reported: the trainer ends the job
                    channel.end.send_json(wire.ERROR, _describe(exc))

            threading.Thread(target=check_rows, name="grpo-rows", daemon=True).start()
        if not channel.wait_step(first):
            return
        job.set_phase("training")
        _LOGGER.info(
            "run %s: GRPO training started (steps %d..%d), rank %d of %d on %s",
            job.run_id,
            first,
            config.max_episodes,
            rank,
            world,
            job.device,
            extra={"run_id": job.run_id},
        )
        if restored is None:
            trainer.train()
        else:
            trainer.train(
                resume_from_checkpoint=str(restored.directory / checkpoint_files.STATE_DIR)
            )
    finally:
        scan_stop.set()


def _checkpoint_writer(
    trainer: Any, channel: RankChannel, maker: Any, rank: int
) -> Callable[[Mapping[str, Any]], None]:
    """The rank's handler of ``SAVE``: every rank writes its part; rank 0 answers ``SAVED``.

    A write that fails with ``OSError`` (a full disk) is reported and training goes on; any
    other failure fails the rank.
    """

    def save(request: Mapping[str, Any]) -> None:
        step = int(request["step"])
        if step != channel.last_step:
            raise RuntimeError(
                f"the trainer asked for a checkpoint of step {step} after step {channel.last_step}"
            )
        started = time.monotonic()
        size, error = 0, None
        best = maker.counter.best_reward if maker is not None else None
        last = maker.last_reward if maker is not None else None
        try:
            size = trainer.save_checkpoint(pathlib.Path(request["directory"]), best, last)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
        if rank == 0:
            seconds = time.monotonic() - started
            payload = wire.saved_payload(step, seconds=seconds, size=size, error=error)
            channel.end.send_json(wire.SAVED, payload)

    return save


def _describe(exc: BaseException) -> dict[str, Any]:
    """The ``ERROR`` payload for a failure of this rank."""
    exc = translate_error(exc)
    from trainer_service.core.provider import CheckpointUnusable, ProviderError

    trace = "".join(traceback.format_exception(exc))
    if isinstance(exc, CheckpointUnusable):
        return wire.error_payload(
            "checkpoint", str(exc), detail=trace, exception=type(exc).__name__
        )
    if isinstance(exc, ProviderError):
        return wire.error_payload(
            "provider",
            exc.user_message,
            detail=f"{exc.detail}\n{trace}" if exc.detail else trace,
            code=exc.code,
            reason=exc.reason,
            exception=type(exc).__name__,
        )
    return wire.error_payload("crash", str(exc), detail=trace, exception=type(exc).__name__)


def translate_error(error: BaseException) -> BaseException:
    """What the user should read of a training failure: a ``ProviderError`` with a plain message
    where the cause is known (a dataset row, running out of memory), else ``error`` itself."""
    from trainer_service.core.provider import ProviderError
    from trainer_service.providers.grpo.rows import DatasetError

    if isinstance(error, DatasetError) and "Original Traceback" in error.user_message:
        # Raised in a DataLoader worker: torch re-raised it with the worker's traceback as the
        # message. The user gets the original message (its last line); the log gets the rest.
        last = error.user_message.strip().splitlines()[-1]
        message = last.split("DatasetError: ", 1)[-1]
        return DatasetError(message, detail=error.user_message)
    if isinstance(error, ProviderError):
        return error
    torch = sys.modules.get("torch")  # a CUDA out-of-memory comes from a torch that is loaded
    if torch is not None and isinstance(error, torch.cuda.OutOfMemoryError):
        return ProviderError(
            OUT_OF_MEMORY_ADVICE,
            detail=str(error),
            code="RESOURCE_EXHAUSTED",
            reason="OUT_OF_MEMORY",
        )
    if isinstance(error, MemoryError):
        return ProviderError(
            "The training process ran out of memory; try a smaller batch_size or "
            "max_completion_length.",
            detail=f"MemoryError: {error}",
            code="RESOURCE_EXHAUSTED",
            reason="OUT_OF_MEMORY",
        )
    return error


def main(argv: list[str] | None = None, build: Callable[..., Any] | None = None) -> int:
    """Runs one rank; returns its exit status.

    Args:
        argv: The command line (default: ``sys.argv[1:]``).
        build: Makes the trainer as :func:`.build.build_trainer` does (that by default).
    """
    parser = argparse.ArgumentParser(prog="python -m trainer_service.providers.grpo.worker")
    parser.add_argument("--fd", type=int, required=True, help="this rank's end of the channel")
    parser.add_argument("--parent-pid", type=int, required=True, help="the process that started it")
    parser.add_argument(
        "--listen-fd", type=int, help="rank 0 of a job that spans trainers: its rendezvous socket"
    )
    args = parser.parse_args(argv)
    lifeline.arm_rank(args.parent_pid)
    # No process the rank starts holds its channel: the trainer sees the rank's end close when
    # the rank dies, not when its last DataLoader worker does.
    os.set_inheritable(args.fd, False)
    os.register_at_fork(after_in_child=functools.partial(lifeline.release_in_child, args.fd))
    channel = RankChannel(wire.ChannelEnd.from_fd(args.fd))
    channel.start()
    spec = channel.job(JOB_TIMEOUT_S)
    if spec is None:
        print("grpo worker: no job spec arrived", file=sys.stderr)
        return 2
    _apply_logging(spec)
    if args.listen_fd is not None and spec.get("meeting"):
        spec["meeting"]["listen_fd"] = args.listen_fd
    channel.beat_s = float(spec.get("beat_s", channel.beat_s))
    meeting = None
    try:
        if spec.get("meeting"):
            channel.send_phase("loading libraries")  # the rendezvous imports torch
            from trainer_service.providers.grpo.rendezvous import Meeting

            def lost(error: BaseException) -> NoReturn:
                _exit(channel, wire.ERROR, json.dumps(_describe(error)).encode(), 1)

            meeting = Meeting(spec, channel, lost)
        if meeting is None or not meeting.relays_controls:
            channel.relay_to(None)
        _train(spec, channel, build, meeting)
    except BaseException as exc:  # reported, then the rank exits
        if meeting is not None:
            exc = meeting.explain(exc)
        _exit(channel, wire.ERROR, json.dumps(_describe(exc)).encode(), 1)
    if meeting is not None:
        meeting.drain()
    _exit(channel, wire.END, wire.step_payload(channel.last_step), 0)


def _exit(channel: RankChannel, kind: bytes, payload: bytes, status: int) -> NoReturn:
    """Reports the rank's end and exits at once.

    Nothing is left to do once the trainer has the report: it kills the job's group next.
    Tearing the interpreter down instead can hang (a collective's process group waiting for a
    peer in its destructor, seen here for a minute, with the GIL held) and costs seconds of
    torch teardown; the DataLoader workers follow the rank on their own (:mod:`.lifeline`).
    """
    channel.finishing.set()
    channel.end.send(kind, payload)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
