"""Checkpoint benchmark: what checkpoints cost a run, and how fast parking, resuming, recovery
and downloads are, for imitation and the tiny VLM's GRPO, side by side in one run.

(1) Overhead per step at the providers' default intervals (``DEFAULT_CHECKPOINT_EVERY``:
    imitation 500, GRPO 50), in process through the providers' ``run`` and the trainer's
    ``JobCheckpoints`` over a real directory store. A: the default interval; B: the same run
    (same seed) with ``checkpoint_every = max_episodes`` (only the final checkpoint).
    Interleaved ABAB. A run has ``k * every + 2`` episodes; its per-step time is the mean over
    the steps from its 1st to its ``(k * every + 1)``-th episode, a window that holds A's ``k``
    checkpoints and none of B's. Medians of the rounds; A/B is the median of the rounds' own
    ratios (an A and its B run back to back), with their range, the machine's noise. Then the
    mean time of one checkpoint write (from the provider taking a scratch directory to the
    commit in the store: its save plus the store's fsynced put), of which the put, and that
    write over ``every`` of B's steps: the overhead the interval implies. Target: <= 5 % of
    training time (checked on the implied overhead, which the noise does not drown).
(2) Pause -> slot free (parking): trainer processes of one slot each and the gateway in
    process with ``--park-after`` P; from the moment the park is due (pause + P) until the
    trainer's ``GetCapabilities`` reports the slot free, and until ``GetRun`` says parked; with
    the last episode the gateway received and the parking checkpoint's episode.
(3) Resume -> first new episode of that parked run: from ``ResumeRun`` until a trainer took
    the job, the gateway received an episode past those it had (``GetRun.trainer_episode``),
    and a watcher got it; with the checkpoint the job continued from and the episodes it
    trained again.
(4) kill -9 of the run's trainer -> first new episode from the other trainer, for each
    ``--heartbeat-timeout`` (a fresh run for each but the first), killed once the run trained a
    little past a checkpoint: when the gateway counted the restart, the other trainer took the
    job, the gateway received the first new episode and a watcher got it.
(5) Download of large checkpoints through the gateway: a real run's checkpoints plus random
    files (``CheckpointStore.put``, recorded with the gateway store's ``add_checkpoint``),
    fetched by a client process with the gRPC stream alone (chunks dropped), with
    ``trainwire.aio.GatewayClient.download_checkpoint`` (digest checked, tar extracted) and
    with HTTP GET ``.../checkpoints/{episode}:download``; MB/s against reading the same files
    straight from disk (page cache warm), beside the store's put and its tar reader with the
    digest in process; and the gateway process's peak RSS growth during each download, at
    two sizes (memory must stay flat in checkpoint size; target: <= 64 MiB).

Runs in (2)-(4) are unpaced (the trainer's speed, not a publication rate, sets what they
see); the trainer flags and the gateway settings are the defaults except the store, the data
root, one slot per trainer, a trainer heartbeat of 0.5 s (below the shortest timeout) and the
settings measured. Everything on the CPU, one torch thread per process.

Run: ``.venv/bin/python bench/checkpoints.py`` (about 4 minutes on 2 shared cores).
``--rounds``, ``--grpo-rounds``, ``--imitation-k``, ``--grpo-k`` make (1) longer;
``--grpo-all-timeouts`` adds GRPO to every timeout of (4); ``--only 1,5`` runs some parts;
``--workdir DIR`` keeps the store and every log (the gateway's at INFO). Exit status 1 when a
target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import pathlib
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import grpc  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

from gateway.core.settings import DEFAULTS  # noqa: E402
from gateway.core.store import CheckpointRecord  # noqa: E402
from tests.fakes.gateway_harness import Client, running_gateway, trainer_process  # noqa: E402
from trainer_service.core.checkpointing import JobCheckpoints, job_meta  # noqa: E402
from trainer_service.core.provider import TrainJob  # noqa: E402
from trainer_service.providers import grpo, imitation  # noqa: E402
from trainer_service.tools import make_demo_dataset, make_tiny_vlm  # noqa: E402
from trainwire.v1 import (  # noqa: E402
    episode_pb2,
    gateway_service_pb2,
    trainer_service_pb2,
    trainer_service_pb2_grpc,
)
from trainwire.v1.gateway_service_pb2 import Run  # noqa: E402
from trainwire_ops.checkpoints import CheckpointStore  # noqa: E402

pb = gateway_service_pb2
State = Run.State
T = TypeVar("T")

MODEL_DIR = "models/tiny-vlm"
DATASET = "datasets/colours/train.jsonl"
KINDS = ("imitation", "grpo")
DEFAULT_EVERY = {
    "imitation": imitation.DEFAULT_CHECKPOINT_EVERY,
    "grpo": grpo.DEFAULT_CHECKPOINT_EVERY,
}
OVERHEAD_TARGET = 0.05
#: Peak RSS growth of the gateway during a download that still counts as flat (MiB).
RSS_FLAT_MIB = 64.0
#: A trainer's heartbeat (s): below the shortest gateway timeout measured.
TRAINER_HEARTBEAT_S = "0.5"
#: Imitation runs of (2)-(4): long enough to outlive every measurement; stopped after it.
IMITATION_EPISODES = 5000
GRPO_STEPS = 200
#: How far past its latest checkpoint a run has trained when its trainer is killed (the
#: episodes the restart trains again).
KILL_PAST = {"imitation": 100, "grpo": 2}
POLL_S = 0.01
WAIT_S = 180.0
MB = 1e6


def _task(kind: str) -> episode_pb2.TrainTask:
    if kind == "imitation":
        return episode_pb2.TrainTask(
            imitation=episode_pb2.ImitationTask(rig_name="stickman", clip_name="wave")
        )
    return episode_pb2.TrainTask(
        grpo=episode_pb2.GrpoTask(
            model_path=MODEL_DIR, dataset_path=DATASET, reward_functions=["exact_match"]
        )
    )


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


# -- (1) overhead per step ---------------------------------------------------------------------


class TimedCheckpoints(JobCheckpoints):
    """The trainer's ``JobCheckpoints``, timing each write from its scratch directory (the
    provider starts saving) to its commit's end, and the commit (the store's put) alone."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.writes_s: list[float] = []
        self.puts_s: list[float] = []
        self.sizes: list[int] = []
        self._started = 0.0

    def scratch(self, episode: int) -> pathlib.Path:
        self._started = time.perf_counter()
        return super().scratch(episode)

    def commit(self, episode: int, best_reward: float, directory: pathlib.Path) -> None:
        put_start = time.perf_counter()
        super().commit(episode, best_reward, directory)
        end = time.perf_counter()
        self.puts_s.append(end - put_start)
        self.writes_s.append(end - self._started)
        event = self.of_episode(episode)
        if event is None or event.info is None:
            raise RuntimeError(f"checkpoint at episode {episode} failed: {event}")
        self.sizes.append(event.info.size_bytes)


@dataclass
class Timed:
    """One in-process training run of (1)."""

    start_s: float  # the job's start to its first episode
    per_step_s: float
    writes_s: list[float]
    puts_s: list[float]
    sizes: list[int]


def train_once(
    kind: str, root: pathlib.Path, store: CheckpointStore, every: int, k: int, name: str
) -> Timed:
    """One run of ``k * default + 2`` episodes checkpointed every ``every``; its per-step time
    over episodes 1 .. k * default + 1 (see the module docstring)."""
    default = DEFAULT_EVERY[kind]
    episodes = k * default + 2
    task = _task(kind)
    config = episode_pb2.TrainConfig(max_episodes=episodes, seed=0, checkpoint_every=every)
    checkpoints = TimedCheckpoints(
        store,
        name,
        kind,
        every=every,
        max_episodes=episodes,
        scratch_root=root / "scratch" / name,
        meta=job_meta(task, config),
    )
    job = TrainJob(
        run_id=name,
        task=task,
        config=config,
        device="cpu",
        data_root=root,
        image_cache_dir=None,
        stop_event=threading.Event(),
        checkpoints=checkpoints,
    )
    provider = imitation.run if kind == "imitation" else grpo.run
    stamps: list[float] = []
    start = time.perf_counter()
    try:
        for _ in provider(job):
            stamps.append(time.perf_counter())
    finally:
        checkpoints.close()
        store.delete_run(name)
    window = k * default
    if len(stamps) != episodes:
        raise RuntimeError(f"{name}: {len(stamps)} episodes of {episodes}")
    return Timed(
        stamps[0] - start,
        (stamps[window] - stamps[0]) / window,
        checkpoints.writes_s,
        checkpoints.puts_s,
        checkpoints.sizes,
    )


@dataclass
class Overhead:
    """(1) for one provider."""

    kind: str
    every: int
    episodes: int
    a: list[Timed] = field(default_factory=list)
    b: list[Timed] = field(default_factory=list)

    @property
    def a_step(self) -> float:
        return _median([t.per_step_s for t in self.a])

    @property
    def b_step(self) -> float:
        return _median([t.per_step_s for t in self.b])

    @property
    def write_s(self) -> float:
        return _mean([w for t in self.a + self.b for w in t.writes_s])

    @property
    def put_s(self) -> float:
        return _mean([p for t in self.a + self.b for p in t.puts_s])

    @property
    def size(self) -> float:
        return _mean([float(s) for t in self.a + self.b for s in t.sizes])

    @property
    def ratios(self) -> list[float]:
        """A / B of each round (its A and B ran back to back: the pair a drift spares)."""
        return [a.per_step_s / b.per_step_s for a, b in zip(self.a, self.b, strict=True)]

    @property
    def ratio(self) -> float:
        """The median of the rounds' A / B."""
        return _median(self.ratios)

    @property
    def ratio_range(self) -> str:
        """The smallest and largest A / B of one round."""
        ratios = self.ratios
        return f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"

    @property
    def implied(self) -> float:
        """One write over ``every`` steps of B's per-step time."""
        return self.write_s / (self.every * self.b_step)


def overhead(kind: str, root: pathlib.Path, rounds: int, k: int) -> Overhead:
    every = DEFAULT_EVERY[kind]
    episodes = k * every + 2
    store = CheckpointStore(str(root / "store-overhead"))
    found = Overhead(kind, every, episodes)
    if kind == "imitation":  # a process's first job pays once (its first optimizer imports
        # torch._dynamo); GRPO jobs run in processes of their own, each paying it
        train_once(kind, root, store, episodes, k, "warm-imitation")
    for index in range(rounds):
        found.a.append(train_once(kind, root, store, every, k, f"{kind}-a{index}"))
        found.b.append(train_once(kind, root, store, episodes, k, f"{kind}-b{index}"))
        print(
            f"  {kind} round {index + 1}: A {found.a[-1].per_step_s * 1e3:.2f} ms/step, "
            f"B {found.b[-1].per_step_s * 1e3:.2f} ms/step",
            flush=True,
        )
    return found


def print_overhead(results: list[Overhead], rounds: dict[str, int]) -> None:
    print(
        "\n(1) checkpoint overhead per step, A: the default interval, B: only the final "
        "checkpoint; ABAB; per-step time over the window that holds A's checkpoints: medians "
        "of the rounds, A/B the median of the rounds' ratios"
    )
    print(
        f"  {'provider':<10}{'every':>6}{'episodes':>9}{'rounds':>7}{'start':>7}"
        f"{'A ms/step':>11}{'B ms/step':>11}{'A/B':>7}{'range':>11}{'write ms':>10}"
        f"{'put ms':>8}{'size':>9}{'write/step':>11}{'implied':>9}"
    )
    for r in results:
        start = _median([t.start_s for t in r.a + r.b])
        print(
            f"  {r.kind:<10}{r.every:>6}{r.episodes:>9}{rounds[r.kind]:>7}{start:>6.1f}s"
            f"{r.a_step * 1e3:>11.2f}{r.b_step * 1e3:>11.2f}{r.ratio:>7.3f}"
            f"{r.ratio_range:>11}{r.write_s * 1e3:>10.1f}{r.put_s * 1e3:>8.1f}"
            f"{r.size / MB:>7.2f}MB{r.write_s / r.b_step:>10.2f}x{r.implied * 100:>8.2f}%"
        )
    print(
        "  start: job start to its first episode; range: A/B of single rounds; write: one "
        "checkpoint, the provider's save + the store's put (fsynced), mean of all; "
        "write/step: in B's steps; implied: write / (every x B step), "
        f"target <= {OVERHEAD_TARGET:.0%}"
    )


# -- (2)-(4) with trainer processes --------------------------------------------------------------


@contextlib.contextmanager
def trainers(
    count: int, logs: pathlib.Path, store: pathlib.Path, data_root: pathlib.Path
) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """``count`` trainer processes of one slot each, started at once."""
    flags: tuple[str, ...] = ("--checkpoint-store", str(store), "--data-root", str(data_root))
    flags += ("--heartbeat", TRAINER_HEARTBEAT_S)
    managers = [
        trainer_process(logs / f"trainer-{i}.log", *flags, slots=1, env={"OMP_NUM_THREADS": "1"})
        for i in range(count)
    ]
    with contextlib.ExitStack() as stack:
        with ThreadPoolExecutor(count) as pool:
            futures = [pool.submit(manager.__enter__) for manager in managers]
        entered = []
        failed: BaseException | None = None
        for manager, future in zip(managers, futures, strict=True):
            try:
                entered.append(future.result())
            except BaseException as exc:  # the others started: the stack stops them
                failed = failed or exc
            else:
                stack.push(manager)
        if failed is not None:
            raise failed
        yield entered


async def poll(check: Callable[[], Awaitable[T | None]], what: str) -> tuple[T, float]:
    """Polls ``check`` every POLL_S until it returns something; returns it and when."""
    deadline = time.monotonic() + WAIT_S
    while True:
        found = await check()
        if found is not None:
            return found, time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {WAIT_S:g} s: {what}")
        await asyncio.sleep(POLL_S)


async def get_run(client: Client, run_id: str) -> Run:
    reply = await client.stub.GetRun(pb.GetRunRequest(run_id=run_id), timeout=10)
    return reply.run


async def run_where(client: Client, run_id: str, test: Callable[[Run], bool]) -> Run | None:
    run = await get_run(client, run_id)
    if run.state in (State.STATE_ERROR, State.STATE_DONE, State.STATE_STOPPED):
        state = State.Name(run.state)
        raise RuntimeError(f"run {run_id} ended {state} at {run.episode}: {run.error_message}")
    return run if test(run) else None


async def first_after(client: Client, run_id: str, after: int) -> float:
    """When a watcher from ``after`` gets its first episode."""
    call = client.stub.WatchRun(pb.WatchRunRequest(run_id=run_id, after_episode=after))
    async for message in call:
        kind = message.WhichOneof("event")
        if kind in ("episode", "batch"):
            call.cancel()
            return time.monotonic()
        if kind == "finished":
            break
    raise RuntimeError(f"run {run_id}: the watch from {after} ended without an episode")


def _continued_from(detail: str) -> int:
    """The checkpoint a job placed again continued from, as the run's detail says (0: none)."""
    match = re.search(r"continued from the checkpoint at episode (\d+)", detail)
    return int(match.group(1)) if match else 0


@dataclass
class Park:
    free_s: float  # park due -> trainer slot free
    parked_s: float  # park due -> GetRun parked
    granted: int  # how far the job was granted when paused (0: unknown)
    received: int  # the last episode the gateway received from the job (trainer_episode)
    checkpoint: int  # the parking checkpoint (checkpoint_episode)


@dataclass
class Resume:
    placed_s: float  # ResumeRun -> a trainer took the job (its first answer)
    received_s: float  # ResumeRun -> the gateway received an episode past the parked ones
    seen_s: float  # ResumeRun -> a watcher got it
    from_episode: int  # the checkpoint the job continued from (0: from scratch)
    retrained: int  # episodes the job trained again before the first new one


@dataclass
class Kill:
    timeout_s: float
    restart_s: float  # kill -> GetRun restarts counted
    placed_s: float  # kill -> the other trainer took the job (its first answer)
    received_s: float  # kill -> trainer_episode past what the dead trainer sent
    seen_s: float  # kill -> a watcher got it
    from_episode: int  # the checkpoint the restart continued from
    retrained: int  # episodes the restart trained again before the first new one


class Scenario:
    """One run through its trainers and the gateway: park, resume, kill."""

    def __init__(
        self,
        client: Client,
        procs: dict[str, subprocess.Popen[bytes]],
        kind: str,
        park_after_s: float,
    ) -> None:
        self.client = client
        self.procs = procs
        self.kind = kind
        self.park_after_s = park_after_s
        self.run_id = ""
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def close(self) -> None:
        if self.run_id:
            with contextlib.suppress(grpc.RpcError):
                await self.client.stub.StopRun(pb.StopRunRequest(run_id=self.run_id), timeout=10)

            async def ended() -> Run | None:
                run = await get_run(self.client, self.run_id)
                active = (State.STATE_RUNNING, State.STATE_PAUSED, State.STATE_PENDING)
                return None if run.state in active else run

            await poll(ended, "the run stopped")
        for channel in self._channels.values():
            await channel.close()

    async def slots_free(self, address: str) -> int:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        stub = trainer_service_pb2_grpc.TrainerServiceStub(channel)
        reply = await stub.GetCapabilities(trainer_service_pb2.GetCapabilitiesRequest(), timeout=5)
        return int(reply.slots_free)

    async def start(self, min_episode: int) -> Run:
        steps = IMITATION_EPISODES if self.kind == "imitation" else GRPO_STEPS
        request = pb.CreateRunRequest(
            task=_task(self.kind),
            config=episode_pb2.TrainConfig(max_episodes=steps, seed=0),
            episodes_per_second=-1.0,
        )
        run = (await self.client.stub.CreateRun(request, timeout=10)).run
        self.run_id = run.id
        found, _ = await poll(
            lambda: run_where(
                self.client,
                run.id,
                lambda r: r.state == State.STATE_RUNNING and r.trainer_episode >= min_episode,
            ),
            f"run {run.id} trained {min_episode}",
        )
        return found

    async def park(self) -> Park:
        run = await get_run(self.client, self.run_id)
        trainer = run.trainer
        if await self.slots_free(trainer) != 0:
            raise RuntimeError(f"trainer {trainer} has a free slot while it runs {run.id}")
        paused_at = time.monotonic()
        await self.client.stub.PauseRun(pb.PauseRunRequest(run_id=self.run_id), timeout=10)
        due = paused_at + self.park_after_s
        detail = (await get_run(self.client, self.run_id)).state_detail
        match = re.search(r"granted through (\d+)", detail)
        granted = int(match.group(1)) if match else 0

        async def free() -> bool | None:
            return True if await self.slots_free(trainer) >= 1 else None

        (_, freed), (parked, parked_at) = await asyncio.gather(
            poll(free, f"slot free on {trainer}"),
            poll(lambda: run_where(self.client, self.run_id, lambda r: r.parked), "parked"),
        )
        return Park(
            freed - due,
            parked_at - due,
            granted,
            int(parked.trainer_episode),
            int(parked.checkpoint_episode),
        )

    async def resume(self) -> Resume:
        parked = await get_run(self.client, self.run_id)
        after = int(parked.trainer_episode)
        watcher = asyncio.create_task(first_after(self.client, self.run_id, after))
        await asyncio.sleep(0.2)  # the watch is attached and caught up
        start = time.monotonic()
        try:
            await self.client.stub.ResumeRun(pb.ResumeRunRequest(run_id=self.run_id), timeout=10)
            (_, placed), (moved, received) = await asyncio.gather(
                poll(
                    lambda: run_where(self.client, self.run_id, lambda r: not r.parked),
                    "placed",
                ),
                poll(
                    lambda: run_where(
                        self.client, self.run_id, lambda r: r.trainer_episode > after
                    ),
                    "a new episode",
                ),
            )
            seen = await asyncio.wait_for(watcher, WAIT_S)
        finally:
            watcher.cancel()
        origin = _continued_from(moved.state_detail)
        return Resume(placed - start, received - start, seen - start, origin, after - origin)

    async def kill(self, timeout_s: float) -> Kill:
        """Kills the run's trainer once the run has a checkpoint (at least the one it has now)
        and the trainer sent ``KILL_PAST`` episodes past its latest."""
        now = await get_run(self.client, self.run_id)
        base = max(1, int(now.checkpoint_episode))
        past = KILL_PAST[self.kind]
        running, _ = await poll(
            lambda: run_where(
                self.client,
                self.run_id,
                lambda r: (
                    r.checkpoint_episode >= base
                    and r.trainer_episode >= r.checkpoint_episode + past
                ),
            ),
            f"{past} past a checkpoint",
        )
        victim = running.trainer
        restarts = running.restarts
        killed = time.monotonic()
        self.procs[victim].send_signal(signal.SIGKILL)
        # What the dead trainer sent is all in by now; its replacement starts after the timeout.
        await asyncio.sleep(min(0.5, timeout_s / 4))
        dead = await get_run(self.client, self.run_id)
        received_at_kill = int(dead.trainer_episode)
        if dead.restarts != restarts:
            raise RuntimeError("restarted before the heartbeat timeout")
        watcher = asyncio.create_task(first_after(self.client, self.run_id, received_at_kill))
        try:
            (_, restarted), (_, placed), (moved, received) = await asyncio.gather(
                poll(
                    lambda: run_where(self.client, self.run_id, lambda r: r.restarts > restarts),
                    "restart counted",
                ),
                poll(
                    lambda: run_where(
                        self.client,
                        self.run_id,
                        lambda r: r.restarts > restarts and r.trainer not in ("", victim),
                    ),
                    "placed on another trainer",
                ),
                poll(
                    lambda: run_where(
                        self.client, self.run_id, lambda r: r.trainer_episode > received_at_kill
                    ),
                    "a new episode",
                ),
            )
            seen = await asyncio.wait_for(watcher, WAIT_S)
        finally:
            watcher.cancel()
        if moved.trainer == victim:
            raise RuntimeError(f"run {self.run_id} is still on the killed trainer {victim}")
        origin = _continued_from(moved.state_detail)
        return Kill(
            timeout_s,
            restarted - killed,
            placed - killed,
            received - killed,
            seen - killed,
            origin,
            received_at_kill - origin,
        )


@dataclass
class Processes:
    """(2)-(4)."""

    park: dict[str, Park] = field(default_factory=dict)
    resume: dict[str, Resume] = field(default_factory=dict)
    kill: list[tuple[str, Kill]] = field(default_factory=list)


def _gateway_settings(store: pathlib.Path, park_after_s: float, timeout_s: float) -> dict[str, Any]:
    """The gateway's defaults (``running_gateway`` sets test values) but the store and the
    settings measured."""
    return {
        "checkpoint_store": str(store),
        "park_after_s": park_after_s,
        "heartbeat_timeout_s": timeout_s,
        "schedule_poll_s": DEFAULTS.schedule_poll_s,
        "trainer_call_timeout_s": DEFAULTS.trainer_call_timeout_s,
        "keepalive_s": DEFAULTS.keepalive_s,
    }


async def processes_part(
    root: pathlib.Path,
    kinds: tuple[str, ...],
    park_after_s: float,
    timeouts: list[float],
    grpo_all: bool,
    parking: bool,
    killing: bool,
) -> Processes:
    """(2) and (3) when ``parking``, then (4) when ``killing``: one run per provider at the
    first timeout, one more per provider and later timeout for (4)."""
    store = root / "store"
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    scenarios = [(kind, timeouts[0]) for kind in kinds]
    if killing:
        scenarios += [
            (kind, t) for t in timeouts[1:] for kind in kinds if kind == "imitation" or grpo_all
        ]
    found = Processes()
    # One trainer more than kills: two are alive for each.
    count = len(scenarios) + 1 if killing else 1
    with trainers(count, logs, store, root) as started:
        procs = {address: proc for proc, address in started}
        for t_index, timeout_s in enumerate(timeouts):
            alive = tuple(a for a in procs if procs[a].poll() is None)
            settings = _gateway_settings(store, park_after_s, timeout_s)
            async with running_gateway(alive, **settings) as client:
                for kind in kinds:
                    if (kind, timeout_s) not in scenarios:
                        continue
                    scenario = Scenario(client, procs, kind, park_after_s)
                    try:
                        await scenario.start(min_episode=300 if kind == "imitation" else 2)
                        if t_index == 0 and parking:
                            park = found.park[kind] = await scenario.park()
                            print(f"  {kind}: slot free {park.free_s:.2f} s after due", flush=True)
                            resume = found.resume[kind] = await scenario.resume()
                            print(f"  {kind}: resumed in {resume.seen_s:.2f} s", flush=True)
                        if killing:
                            kill = await scenario.kill(timeout_s)
                            found.kill.append((kind, kill))
                            print(
                                f"  {kind}: kill -9, timeout {timeout_s:g} s: first new episode "
                                f"in {kill.seen_s:.2f} s",
                                flush=True,
                            )
                    finally:
                        await scenario.close()
    return found


def print_processes(found: Processes, park_after_s: float, timeout_s: float) -> None:
    print(
        f"\n(2) pause -> slot free, --park-after {park_after_s:g} s, --heartbeat-timeout "
        f"{timeout_s:g} s; from the moment the park is due (pause + {park_after_s:g} s)"
    )
    print(
        f"  {'provider':<10}{'slot free':>10}{'parked':>9}{'granted':>9}{'received':>10}"
        f"{'checkpoint':>11}"
    )
    for kind, park in found.park.items():
        print(
            f"  {kind:<10}{park.free_s:>9.2f}s{park.parked_s:>8.2f}s{park.granted:>9}"
            f"{park.received:>10}{park.checkpoint:>11}"
        )
    print(
        "  granted: how far the job was granted when paused; received: the last episode the "
        "gateway got from the job; checkpoint: the parking checkpoint (a resume may use it "
        "only if it is <= received)"
    )
    print("\n(3) resume of a parked run -> first new episode; from ResumeRun")
    print(
        f"  {'provider':<10}{'placed':>9}{'received':>10}{'watcher':>9}{'from ckpt':>10}"
        f"{'retrained':>10}"
    )
    for kind, resume in found.resume.items():
        print(
            f"  {kind:<10}{resume.placed_s:>8.2f}s{resume.received_s:>9.2f}s{resume.seen_s:>8.2f}s"
            f"{resume.from_episode:>10}{resume.retrained:>10}"
        )
    print(
        "  placed: a trainer took the job (its first answer); received: the gateway got an "
        "episode past those it had; watcher: a watch stream delivered it; from ckpt: where the "
        "job continued (0: from scratch); retrained: episodes trained again before it"
    )
    print("\n(4) kill -9 of the run's trainer -> first new episode on the other; from the kill")
    print(
        f"  {'provider':<10}{'timeout':>8}{'restart':>9}{'placed':>8}{'received':>10}"
        f"{'watcher':>9}{'- timeout':>10}{'from ckpt':>10}{'retrained':>10}"
    )
    for kind, kill in found.kill:
        print(
            f"  {kind:<10}{kill.timeout_s:>7.1f}s{kill.restart_s:>8.2f}s{kill.placed_s:>7.2f}s"
            f"{kill.received_s:>9.2f}s{kill.seen_s:>8.2f}s{kill.seen_s - kill.timeout_s:>9.2f}s"
            f"{kill.from_episode:>10}{kill.retrained:>10}"
        )
    print("  restart: the gateway counted the restart (GetRun.restarts)")


# -- (5) download ------------------------------------------------------------------------------

# A client process (so that its memory is not the gateway's): one download, timed from the
# request to the last byte; prints {"seconds": ..., "bytes": ...}.
_CLIENT = r"""
import asyncio, http.client, json, sys, time, urllib.parse
import grpc
from trainwire import aio
from trainwire.v1 import gateway_service_pb2 as pb, gateway_service_pb2_grpc as pb_grpc

mode, address, base, run_id, episode, out = sys.argv[1:]
episode = int(episode)

async def grpc_stream():
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GatewayServiceStub(channel)
        size = 0
        call = stub.DownloadCheckpoint(pb.DownloadCheckpointRequest(run_id=run_id, episode=episode))
        async for message in call:
            size += len(message.chunk)
        return size

async def client():
    async with aio.GatewayClient(address) as gateway:
        record = await gateway.download_checkpoint(run_id, out, episode=episode)
    return record.size_bytes

def http_get():
    url = urllib.parse.urlsplit(f"{base}/v1/runs/{run_id}/checkpoints/{episode}:download")
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    conn.request("GET", url.path)
    reply = conn.getresponse()
    assert reply.status == 200, reply.status
    size = 0
    while chunk := reply.read(1 << 20):
        size += len(chunk)
    return size

start = time.perf_counter()
if mode == "grpc":
    size = asyncio.run(grpc_stream())
elif mode == "client":
    size = asyncio.run(client())
else:
    size = http_get()
print(json.dumps({"seconds": time.perf_counter() - start, "bytes": size}))
"""
DOWNLOADS = (
    ("grpc", "gRPC stream, chunks dropped"),
    ("client", "GatewayClient.download_checkpoint (digest, extract)"),
    ("http", "HTTP GET :download, body dropped"),
)


class PeakRss:
    """Samples this process's RSS in a thread; ``peak`` is the largest seen since ``start``."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self.base = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.base = self.peak = self._process.memory_info().rss
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def stop(self) -> float:
        """Stops; returns the peak growth in MiB."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)
        return (self.peak - self.base) / (1 << 20)


@dataclass
class Download:
    size: int
    put_s: float
    disk_s: float
    reader_s: float
    rows: dict[str, tuple[float, float]] = field(default_factory=dict)  # mode: (s, MiB)


def _random_files(directory: pathlib.Path, total: int, files: int = 8) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    each = total // files
    for index in range(files):
        with open(directory / f"blob-{index}.bin", "wb") as out:
            left = each
            while left:
                piece = min(left, 1 << 24)
                out.write(os.urandom(piece))
                left -= piece


def _read_tar(store: CheckpointStore, run_id: str, episode: int) -> float:
    """Seconds to stream the checkpoint's tar from the store and digest it, as the gateway's
    reader does (without the event loop and the network)."""
    start = time.perf_counter()
    digest = hashlib.sha256()
    for chunk in store.tar_chunks(run_id, episode, 1 << 20):
        digest.update(chunk)
    return time.perf_counter() - start


def _read_files(directory: pathlib.Path) -> tuple[float, int]:
    start = time.perf_counter()
    size = 0
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as source:
                while chunk := source.read(1 << 20):
                    size += len(chunk)
    return time.perf_counter() - start, size


async def _client_download(
    client: Client, http_url: str, mode: str, run_id: str, episode: int, out: pathlib.Path
) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CLIENT,
        mode,
        client.address,
        http_url,
        run_id,
        str(episode),
        str(out),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    stdout, stderr = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} download failed: {stderr.decode()[-2000:]}")
    result: dict[str, Any] = json.loads(stdout.decode().strip().splitlines()[-1])
    return result


async def _downloads(
    client: Client, http_url: str, root: pathlib.Path, run_id: str, episode: int, size: int
) -> dict[str, tuple[float, float]]:
    """Each kind of download of one checkpoint: (seconds, gateway RSS peak growth in MiB)."""
    rows = {}
    for mode, _ in DOWNLOADS:
        out = root / f"out-{mode}-{episode}"
        rss = PeakRss()
        rss.start()
        try:
            got = await _client_download(client, http_url, mode, run_id, episode, out)
        finally:
            growth = rss.stop()
        await asyncio.to_thread(_remove, out)
        if got["bytes"] != size:
            raise RuntimeError(f"{mode}: {got['bytes']} bytes of {size}")
        rows[mode] = (float(got["seconds"]), growth)
    return rows


async def download_part(root: pathlib.Path, sizes_mb: tuple[int, ...]) -> list[Download]:
    """One row per size, in order, all through one gateway."""
    store_dir = root / "store-download"
    store = CheckpointStore(str(store_dir))
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    found = []
    keep = len(sizes_mb) + 1
    with trainers(1, logs, store_dir, root) as started:
        address = started[0][1]
        async with running_gateway(
            (address,), checkpoint_store=str(store_dir), http_port=0
        ) as client:
            assert client.gateway.http is not None and client.gateway.core is not None
            http_url = client.gateway.http.url
            # A real run's checkpoints (every 10 episodes), each then made large.
            request = pb.CreateRunRequest(
                task=_task("imitation"),
                config=episode_pb2.TrainConfig(
                    max_episodes=10 * len(sizes_mb),
                    seed=0,
                    checkpoint_every=10,
                    keep_checkpoints=keep,
                ),
                episodes_per_second=-1.0,
            )
            run = (await client.stub.CreateRun(request, timeout=10)).run
            await poll(lambda: _ended(client, run.id), f"run {run.id} done")
            for index, size_mb in enumerate(sizes_mb):
                episode = 10 * (index + 1)
                files = root / f"download-{episode}"
                await asyncio.to_thread(store.fetch, run.id, episode, files)
                await asyncio.to_thread(_random_files, files / "extra", size_mb * 1_000_000)
                start = time.perf_counter()
                info = await asyncio.to_thread(store.put, run.id, episode, files, {})
                put_s = time.perf_counter() - start
                await asyncio.to_thread(_remove, files)
                record = CheckpointRecord(
                    run.id, episode, info.create_time_ns, info.size_bytes, info.sha256
                )
                await client.gateway.core._store.add_checkpoint(record, keep)
                disk_s, _ = await asyncio.to_thread(
                    _read_files, store_dir / run.id / f"{episode:012d}"
                )
                reader_s = await asyncio.to_thread(_read_tar, store, run.id, episode)
                row = Download(info.size_bytes, put_s, disk_s, reader_s)
                row.rows = await _downloads(
                    client, http_url, root, run.id, episode, info.size_bytes
                )
                found.append(row)
                print(
                    f"  {size_mb} MB: "
                    + ", ".join(f"{m} {t:.2f} s +{g:.1f} MiB" for m, (t, g) in row.rows.items()),
                    flush=True,
                )
    return found


async def _ended(client: Client, run_id: str) -> Run | None:
    run = await get_run(client, run_id)
    return run if run.state == State.STATE_DONE else None


def _remove(path: pathlib.Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def print_downloads(found: list[Download]) -> None:
    print(
        "\n(5) checkpoint download through the gateway, the client in another process; disk: "
        "the same files read in 1 MiB chunks (page cache warm, as the gateway reads them)"
    )
    print(f"  {'size':>8}  {'how':<52}{'MB/s':>8}{'/ disk':>8}{'gateway RSS peak':>18}")
    for row in found:
        disk = row.size / row.disk_s / MB
        size = f"{row.size / MB:.0f} MB"
        print(f"  {size:>8}  {'disk read':<52}{disk:>8.0f}{1:>8.2f}")
        put = row.size / row.put_s / MB
        print(f"  {'':>8}  {'store put (copy, digest, fsync)':<52}{put:>8.0f}{put / disk:>8.2f}")
        reader = row.size / row.reader_s / MB
        label = "store tar_chunks + SHA-256, in process"
        print(f"  {'':>8}  {label:<52}{reader:>8.0f}{reader / disk:>8.2f}")
        for mode, label in DOWNLOADS:
            seconds, growth = row.rows[mode]
            rate = row.size / seconds / MB
            print(f"  {'':>8}  {label:<52}{rate:>8.0f}{rate / disk:>8.2f}{growth:>14.1f} MiB")
    print(
        "  one gateway serves the sizes in this order: growth that its first MB-sized download "
        "causes (allocator pools for the 1 MiB chunks in flight) is not repeated by the larger"
    )


# -- main --------------------------------------------------------------------------------------


def summary(
    over: list[Overhead],
    procs: Processes | None,
    downloads: list[Download],
    park_after_s: float,
) -> bool:
    """Prints the compact table, providers side by side; returns whether every target is
    met (the implied overhead, since A/B is within the machine's noise; the download's RSS)."""
    ok = True
    rows: list[tuple[str, dict[str, str]]] = []
    for r in over:
        ok = ok and r.implied <= OVERHEAD_TARGET
    if over:
        rows.append(
            (
                "(1) per-step time A/B (rounds' range)",
                {r.kind: f"{r.ratio:.3f} ({r.ratio_range})" for r in over},
            )
        )
        rows.append(
            (
                "(1) one checkpoint write / one step",
                {r.kind: f"{r.write_s * 1e3:.1f} ms / {r.b_step * 1e3:.1f} ms" for r in over},
            )
        )
        rows.append(
            (
                "(1) implied overhead at the default interval",
                {r.kind: f"{r.implied * 100:.2f} % (every {r.every})" for r in over},
            )
        )
    if procs is not None:
        rows.append(
            (
                f"(2) pause -> slot free, after pause + {park_after_s:g} s",
                {k: f"{p.free_s:.2f} s" for k, p in procs.park.items()},
            )
        )
        rows.append(
            (
                "(3) resume -> first new episode",
                {k: f"{r.seen_s:.2f} s (retrained {r.retrained})" for k, r in procs.resume.items()},
            )
        )
        for timeout in sorted({kill.timeout_s for _, kill in procs.kill}):
            rows.append(
                (
                    f"(4) kill -9 -> first new episode, timeout {timeout:g} s",
                    {
                        k: f"{kill.seen_s:.2f} s (+{kill.seen_s - timeout:.2f})"
                        for k, kill in procs.kill
                        if kill.timeout_s == timeout
                    },
                )
            )
    kinds = [k for k in KINDS if any(k in cells for _, cells in rows)]
    print("\nsummary")
    if rows:
        print(f"  {'':<48}" + "".join(f"{k:>24}" for k in kinds))
        for label, cells in rows:
            print(f"  {label:<48}" + "".join(f"{cells.get(k, '-'):>24}" for k in kinds))
    for row in downloads:
        disk = row.size / row.disk_s / MB
        parts = []
        for mode, _ in DOWNLOADS:
            seconds, growth = row.rows[mode]
            parts.append(f"{mode} {row.size / seconds / MB:.0f} MB/s +{growth:.0f} MiB")
            ok = ok and growth <= RSS_FLAT_MIB
        print(
            f"  (5) {row.size / MB:.0f} MB download, gateway RSS growth: {', '.join(parts)}; "
            f"disk {disk:.0f} MB/s"
        )
    print(
        f"  targets: implied overhead <= {OVERHEAD_TARGET:.0%}, gateway RSS growth during a "
        f"download <= {RSS_FLAT_MIB:g} MiB: {'all met' if ok else 'MISSED'}"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", default="1,2,3,4,5", help="parts to run (default all; 2 and 3 go together)"
    )
    parser.add_argument("--kinds", default="imitation,grpo", help="providers (default both)")
    parser.add_argument("--rounds", type=int, default=3, help="(1) imitation AB rounds")
    parser.add_argument("--grpo-rounds", type=int, default=2, help="(1) GRPO AB rounds")
    parser.add_argument(
        "--imitation-k", type=int, default=4, help="(1) imitation: intervals per measured window"
    )
    parser.add_argument(
        "--grpo-k", type=int, default=1, help="(1) GRPO: intervals per measured window"
    )
    parser.add_argument("--park-after", type=float, default=1.0, help="(2) gateway --park-after")
    parser.add_argument(
        "--heartbeat-timeouts", default="3,10", help="(4) gateway --heartbeat-timeout values"
    )
    parser.add_argument(
        "--grpo-all-timeouts", action="store_true", help="(4) GRPO at every timeout, not the first"
    )
    parser.add_argument("--download-mb", default="32,256", help="(5) checkpoint sizes (MB)")
    parser.add_argument(
        "--workdir",
        type=pathlib.Path,
        help="keep the store, the trainers' logs and the gateway's (gateway.log, INFO) here "
        "instead of a temporary directory",
    )
    args = parser.parse_args(argv)
    if min(args.rounds, args.grpo_rounds, args.imitation_k, args.grpo_k) < 1:
        parser.error("--rounds, --grpo-rounds, --imitation-k and --grpo-k must be >= 1")
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    kinds = tuple(k for k in KINDS if k in args.kinds.split(","))
    timeouts = [float(t) for t in args.heartbeat_timeouts.split(",")]
    sizes = tuple(int(s) for s in args.download_mb.split(","))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    from trainer_service.providers.grpo.library_output import route_library_output

    route_library_output()
    began = time.perf_counter()
    print(
        f"cpu: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; one torch thread per "
        f"process; gateway defaults (schedule poll {DEFAULTS.schedule_poll_s:g} s, lead "
        f"{DEFAULTS.lead_s:g} s) but the values measured; trainer heartbeat "
        f"{TRAINER_HEARTBEAT_S} s"
    )
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            root = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-")))
        else:
            root = args.workdir.resolve()
            root.mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(root / "gateway.log")
            handler.setFormatter(
                logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
            )
            handler.setLevel(logging.INFO)
            logging.getLogger().addHandler(handler)
            logging.getLogger().setLevel(logging.INFO)
            logging.getLogger().handlers[0].setLevel(logging.ERROR)
        if "grpo" in kinds and parts & {"1", "2", "3", "4"}:
            make_tiny_vlm.build(root / MODEL_DIR)
            make_demo_dataset.build(root / "datasets" / "colours")
        over: list[Overhead] = []
        if "1" in parts:
            rounds = {"imitation": args.rounds, "grpo": args.grpo_rounds}
            ks = {"imitation": args.imitation_k, "grpo": args.grpo_k}
            print(f"(1) overhead ({time.perf_counter() - began:.0f} s)", flush=True)
            for kind in kinds:
                over.append(overhead(kind, root, rounds[kind], ks[kind]))
            print_overhead(over, rounds)
        procs = None
        if parts & {"2", "3", "4"}:
            print(f"\n(2)-(4) processes ({time.perf_counter() - began:.0f} s)", flush=True)
            procs = asyncio.run(
                processes_part(
                    root,
                    kinds,
                    args.park_after,
                    timeouts,
                    args.grpo_all_timeouts,
                    parking=bool(parts & {"2", "3"}),
                    killing="4" in parts,
                )
            )
            print_processes(procs, args.park_after, timeouts[0])
        downloads: list[Download] = []
        if "5" in parts:
            print(f"\n(5) downloads ({time.perf_counter() - began:.0f} s)", flush=True)
            downloads = asyncio.run(download_part(root, sizes))
            print_downloads(downloads)
        ok = summary(over, procs, downloads, args.park_after)
    print(f"total {time.perf_counter() - began:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
