"""The chaos soak's schedule and load (``bench/chaos.py``): what happens when, and what was seen.

``Plan.make(seed, seconds)`` draws, from the seed alone, the times and kinds of every fault and
action (and their durations and parameters); an action's target is an index into the runs
alive when it comes. ``Soak.run`` carries the plan out against a ``Cluster``, then heals every
fault and drains the runs to their end, and returns the ``History``: every run, every watcher's
sequence, every fault with the runs it hit and the episode each had reached, the samples of who
drives each run, and the processes killed trainers left.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import psutil
from _chaos_cluster import (
    DATASET_DIR,
    HEARTBEAT_TIMEOUT_S,
    MODEL_DIR,
    Cluster,
    Gateway,
    Trainer,
    alive,
)

from trainwire.v1 import episode_pb2, gateway_service_pb2, gateway_service_pb2_grpc
from trainwire_ops.fault_proxy import Fault

pb = gateway_service_pb2
State = pb.Run.State
FINAL = (State.STATE_DONE, State.STATE_STOPPED, State.STATE_ERROR)
RETRY_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
    }
)
CALL_TIMEOUT_S = 5.0
#: Runs alive at once (three trainers of two slots).
MAX_ACTIVE = 5
DRAIN_S = 300.0
#: Seconds a killed trainer's job processes may outlive it.
GONE_S = 10.0

FAULT_WEIGHTS = {
    "trainer_kill": 4,
    "trainer_stop": 2,
    "gateway_kill": 2,
    "postgres_restart": 1,
    "store_unwritable": 1,
    "store_full": 1,
    "proxy_delay": 1,
    "proxy_drop": 1,
    "proxy_reset": 1,
    "proxy_blackhole": 1,
}
ACTION_WEIGHTS = {
    "create": 6,
    "pause": 2,
    "resume": 3,
    "stop": 1,
    "fork": 2,
    "hyperparameters": 2,
    "speed": 2,
    "watch": 4,
}


@dataclass(frozen=True)
class Step:
    """One planned event: at ``at`` seconds, ``kind`` with its draws."""

    at: float
    kind: str
    target: int
    duration: float
    value: float


@dataclass
class Plan:
    """The schedule a seed gives (see the module docstring)."""

    seed: int
    seconds: float
    faults: list[Step]
    actions: list[Step]

    @classmethod
    def make(cls, seed: int, seconds: float) -> Plan:
        rng = random.Random(seed)
        faults: list[Step] = []
        t = rng.uniform(6.0, 10.0)
        kinds, weights = zip(*FAULT_WEIGHTS.items(), strict=True)
        while t < seconds - 5.0:
            kind = rng.choices(kinds, weights)[0]
            faults.append(Step(t, kind, rng.randrange(1000), 0.0, rng.random()))
            t += rng.uniform(8.0, 20.0)
        actions: list[Step] = []
        t = 1.0
        kinds, weights = zip(*ACTION_WEIGHTS.items(), strict=True)
        while t < seconds:
            kind = rng.choices(kinds, weights)[0]
            actions.append(Step(t, kind, rng.randrange(1000), rng.uniform(2.0, 20.0), rng.random()))
            t += rng.uniform(1.0, 3.5)
        # Durations of faults, drawn after (so the action schedule does not shift with them).
        sized = []
        for step in faults:
            if step.kind == "trainer_stop":
                # Shorter than the heartbeat timeout (the job goes on) or longer (it is lost).
                duration = rng.choice([0.5, 2.5]) * HEARTBEAT_TIMEOUT_S * rng.uniform(0.8, 1.0)
            elif step.kind == "proxy_blackhole":
                duration = rng.choice([0.5, 2.0]) * HEARTBEAT_TIMEOUT_S
            elif step.kind in ("trainer_kill", "gateway_kill"):
                duration = rng.uniform(1.0, 6.0)  # until the process is started again
            elif step.kind in ("store_unwritable", "store_full"):
                duration = rng.uniform(4.0, 12.0)
            elif step.kind == "proxy_delay":
                duration = rng.uniform(3.0, 10.0)
            elif step.kind in ("proxy_drop", "proxy_reset"):
                duration = rng.uniform(0.2, 2.0)
            else:
                duration = 0.0
            sized.append(Step(step.at, step.kind, step.target, duration, step.value))
        return cls(seed, seconds, sized, actions)


@dataclass
class WatchLog:
    """What one watcher saw."""

    name: str
    run_id: str
    kind: str  # grpc | sse
    slow_s: float
    start_after: int
    episodes: list[tuple[int, float]] = field(default_factory=list)  # (episode, reward)
    arrivals: dict[int, float] = field(default_factory=dict)  # episode -> monotonic
    finished: int | None = None  # the final state, when it saw ``finished``
    finished_episode: int = 0
    reconnects: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def last(self) -> int:
        return self.episodes[-1][0] if self.episodes else self.start_after


@dataclass
class RunLog:
    """One run of the soak."""

    id: str
    kind: str
    created: float
    max_episodes: int
    base: int  # a fork's first episode is base + 1
    checkpoint_every: int
    recorder: WatchLog
    final: Any = None  # pb.Run once it ended
    status: Any = None  # the latest pb.Run sampled
    stopped_by_us: bool = False
    paused_at: list[float] = field(default_factory=list)  # monotonic times of our pauses


@dataclass
class FaultLog:
    """One fault: when, what, and the runs it hit with the episode each had reached."""

    kind: str
    target: str
    start: float
    end: float
    hit: dict[str, int] = field(default_factory=dict)  # run id -> episode reached
    trainer_episode: dict[str, int] = field(default_factory=dict)
    note: str = ""
    wall: float = field(default_factory=time.time)  # when it started, Unix seconds


@dataclass
class History:
    """Everything the checks read."""

    plan: Plan
    started: float
    fault_phase_end: float = 0.0
    runs: dict[str, RunLog] = field(default_factory=dict)
    watchers: list[WatchLog] = field(default_factory=list)
    faults: list[FaultLog] = field(default_factory=list)
    actions: dict[str, int] = field(default_factory=dict)
    action_refusals: dict[str, int] = field(default_factory=dict)
    two_drivers: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)  # job processes that outlived a trainer
    helpers_left: list[str] = field(default_factory=list)  # its other processes that did
    undrained: list[str] = field(default_factory=list)

    def fault_failed(self, kind: str, logged: int, note: str) -> None:
        """A fault of ``kind`` raised (``note``): it stays one fault in the table. The log it
        started (the faults grew past ``logged``) takes the note and ends now; a fault that
        raised before it started its log gets one."""
        now = time.monotonic()
        if len(self.faults) > logged:
            log = self.faults[-1]
            log.note = note
            log.end = log.end or now
        else:
            self.faults.append(FaultLog(kind, "?", now, now, note=note))


def imitation_request(rng: random.Random, request_id: str) -> pb.CreateRunRequest:
    max_episodes = rng.randrange(150, 500)
    return pb.CreateRunRequest(
        task=episode_pb2.TrainTask(
            imitation=episode_pb2.ImitationTask(rig_name="stickman", clip_name="wave")
        ),
        config=episode_pb2.TrainConfig(
            max_episodes=max_episodes,
            seed=rng.randrange(1 << 20),
            checkpoint_every=rng.choice([10, 20, 50]),
            keep_checkpoints=3,
        ),
        episodes_per_second=rng.uniform(15.0, 40.0),
        request_id=request_id,
    )


def grpo_request(request_id: str, max_episodes: int) -> pb.CreateRunRequest:
    grpo = episode_pb2.GrpoTask(
        model_path=MODEL_DIR,
        dataset_path=f"{DATASET_DIR}/train.jsonl",
        reward_functions=["exact_match", "length"],
        num_generations=2,
        batch_size=2,
        max_completion_length=4,
        dataloader_num_workers=0,
    )
    return pb.CreateRunRequest(
        task=episode_pb2.TrainTask(grpo=grpo),
        config=episode_pb2.TrainConfig(
            max_episodes=max_episodes, seed=7, checkpoint_every=2, keep_checkpoints=2
        ),
        episodes_per_second=-1.0,
        request_id=request_id,
    )


class Soak:
    """Carries a plan out (see the module docstring)."""

    def __init__(self, cluster: Cluster, plan: Plan) -> None:
        self.cluster = cluster
        self.plan = plan
        self.rng = random.Random(plan.seed ^ 0x5EED)
        self.history = History(plan, time.monotonic())
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[gateway_service_pb2_grpc.GatewayServiceStub] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._http: aiohttp.ClientSession | None = None
        self._driving: dict[str, int] = {}  # run id -> samples in a row with two drivers
        self._done = asyncio.Event()

    # -- plumbing ----------------------------------------------------------------------------

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _up(self) -> list[int]:
        return [g.index for g in self.cluster.gateways if g.up]

    async def call(self, method: str, request: Any, timeout: float = 60.0) -> Any:
        """A unary call to a live replica, tried on the others while they are unreachable."""
        deadline = time.monotonic() + timeout
        order = list(range(len(self._stubs)))
        self.rng.shuffle(order)
        attempt = 0
        while True:
            index = order[attempt % len(order)]
            attempt += 1
            try:
                return await getattr(self._stubs[index], method)(request, timeout=CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRY_CODES or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.2)

    def _count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1

    # -- the soak ----------------------------------------------------------------------------

    async def run(self) -> History:
        options = [
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        for gateway in self.cluster.gateways:
            channel = grpc.aio.insecure_channel(gateway.address, options=options)
            self._channels.append(channel)
            self._stubs.append(gateway_service_pb2_grpc.GatewayServiceStub(channel))
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        try:
            self._spawn(self._sample_loop(), "chaos-sampler")
            self._spawn(self._memory_loop(), "chaos-memory")
            await self._create_grpo()
            await asyncio.gather(self._fault_loop(), self._action_loop())
            self.history.fault_phase_end = time.monotonic()
            await self._heal_all()
            await self._drain()
        finally:
            self._done.set()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._http.close()
            for channel in self._channels:
                await channel.close()
        return self.history

    def _elapsed(self) -> float:
        return time.monotonic() - self.history.started

    async def _until(self, at: float) -> None:
        wait = at - self._elapsed()
        if wait > 0:
            await asyncio.sleep(wait)

    # -- runs --------------------------------------------------------------------------------

    def _active(self) -> list[RunLog]:
        return [r for r in self.history.runs.values() if r.final is None]

    async def _create(self, request: pb.CreateRunRequest, kind: str, base: int = 0) -> None:
        try:
            reply = await self.call("CreateRun", request)
        except grpc.aio.AioRpcError as exc:
            self._count(self.history.action_refusals, f"create: {exc.code().name}")
            return
        run = reply.run
        if run.id in self.history.runs:
            return
        recorder = WatchLog(f"recorder-{run.id}", run.id, "grpc", 0.0, base)
        self.history.watchers.append(recorder)
        log = RunLog(
            run.id,
            kind,
            time.monotonic(),
            request.config.max_episodes,
            base,
            request.config.checkpoint_every,
            recorder,
        )
        self.history.runs[run.id] = log
        self._spawn(self._grpc_watch(recorder, None), f"chaos-recorder-{run.id}")

    async def _create_grpo(self) -> None:
        episodes = 4 if self.plan.seconds <= 90 else 8
        await self._create(grpo_request(f"grpo-{self.plan.seed}-0", episodes), "grpo")

    # -- watchers ----------------------------------------------------------------------------

    async def _grpc_watch(self, log: WatchLog, stay_s: float | None) -> None:
        until = None if stay_s is None else time.monotonic() + stay_s
        while not self._done.is_set():
            up = self._up() or [0]
            stub = self._stubs[self.rng.choice(up)]
            call = stub.WatchRun(
                pb.WatchRunRequest(run_id=log.run_id, after_episode=log.last), timeout=3600
            )
            try:
                async for message in call:
                    kind = message.WhichOneof("event")
                    now = time.monotonic()
                    if kind == "episode":
                        episodes = [message.episode]
                    elif kind == "batch":
                        episodes = list(message.batch.episodes)
                    else:
                        episodes = []
                    for episode in episodes:
                        log.episodes.append((episode.episode, episode.reward))
                        log.arrivals.setdefault(episode.episode, now)
                    if kind == "finished":
                        log.finished = message.finished.state
                        log.finished_episode = message.finished.episode
                        return
                    if log.slow_s:
                        await asyncio.sleep(log.slow_s)
                    if until is not None and now > until:
                        call.cancel()
                        return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.CANCELLED and self._done.is_set():
                    return
                log.errors.append(exc.code().name)
            log.reconnects += 1
            await asyncio.sleep(0.2)

    async def _sse_watch(self, log: WatchLog, stay_s: float) -> None:
        assert self._http is not None
        until = time.monotonic() + stay_s
        while not self._done.is_set():
            up = self._up() or [0]
            gateway = self.cluster.gateways[self.rng.choice(up)]
            url = f"http://127.0.0.1:{gateway.http_port}/v1/runs/{log.run_id}/events"
            try:
                async with self._http.get(
                    url, params={"after": str(log.last), "view": "scalars"}
                ) as response:
                    if response.status != 200:
                        log.errors.append(f"HTTP {response.status}")
                        raise aiohttp.ClientError(str(response.status))
                    event = ""
                    async for raw in response.content:
                        line = raw.decode().rstrip("\n")
                        if line.startswith("event: "):
                            event = line[7:]
                        elif line.startswith("data: ") and event == "episode":
                            data = __import__("json").loads(line[6:])
                            episode = int(data["episode"])
                            log.episodes.append((episode, float(data.get("reward", 0.0))))
                            log.arrivals.setdefault(episode, time.monotonic())
                        elif line.startswith("data: ") and event == "finished":
                            data = __import__("json").loads(line[6:])
                            log.finished = State.Value(data.get("state", "STATE_UNSPECIFIED"))
                            log.finished_episode = int(data.get("episode", 0))
                            return
                        if log.slow_s and line.startswith("data: "):
                            await asyncio.sleep(log.slow_s)
                        if time.monotonic() > until:
                            return
            except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
                log.errors.append(type(exc).__name__)
            log.reconnects += 1
            await asyncio.sleep(0.3)

    def _watch(self, run: RunLog, step: Step) -> None:
        kind = "sse" if step.value < 0.4 else "grpc"
        slow = 0.25 if step.target % 3 == 0 else 0.0
        after = 0 if step.target % 2 == 0 else max(run.base, run.recorder.last - 20)
        after = max(after, run.base) if after else 0
        log = WatchLog(f"{kind}-{len(self.history.watchers)}", run.id, kind, slow, after)
        if after == 0 and run.base:
            log.start_after = 0  # a fork's watch from the start begins at base + 1
        self.history.watchers.append(log)
        if kind == "sse":
            self._spawn(self._sse_watch(log, step.duration), log.name)
        else:
            self._spawn(self._grpc_watch(log, step.duration), log.name)

    # -- actions -----------------------------------------------------------------------------

    async def _action_loop(self) -> None:
        for step in self.plan.actions:
            await self._until(step.at)
            self._count(self.history.actions, step.kind)
            try:
                await self._act(step)
            except grpc.aio.AioRpcError as exc:
                self._count(self.history.action_refusals, f"{step.kind}: {exc.code().name}")

    async def _act(self, step: Step) -> None:
        runs = self._active()
        if step.kind == "create":
            if len(runs) < MAX_ACTIVE:
                request_id = f"chaos-{self.plan.seed}-{step.at:.3f}"
                draws = random.Random(request_id)  # the plan's, whatever happened before
                await self._create(imitation_request(draws, request_id), "imitation")
            return
        if step.kind == "fork":
            await self._fork(step)
            return
        if step.kind == "watch":
            candidates = list(self.history.runs.values())
            if candidates:
                self._watch(candidates[step.target % len(candidates)], step)
            return
        imitation = [r for r in runs if r.kind == "imitation"]
        if not imitation:
            return
        if step.kind == "resume":
            paused = [r for r in imitation if r.status and r.status.state == State.STATE_PAUSED]
            imitation = paused or imitation
        run = imitation[step.target % len(imitation)]
        if step.kind == "pause":
            run.paused_at.append(time.monotonic())
            await self.call("PauseRun", pb.PauseRunRequest(run_id=run.id))
        elif step.kind == "resume":
            await self.call("ResumeRun", pb.ResumeRunRequest(run_id=run.id))
        elif step.kind == "stop":
            run.stopped_by_us = True
            await self.call("StopRun", pb.StopRunRequest(run_id=run.id))
        elif step.kind == "speed":
            speed = 0.5 + 2.5 * step.value
            await self.call("SetRunSpeed", pb.SetRunSpeedRequest(run_id=run.id, speed=speed))
        elif step.kind == "hyperparameters":
            rate = 1e-3 + 9e-3 * step.value
            await self.call(
                "SetRunHyperparameters",
                pb.SetRunHyperparametersRequest(run_id=run.id, learning_rate=rate),
            )

    async def _fork(self, step: Step) -> None:
        if len(self._active()) >= MAX_ACTIVE:
            return
        parents = [r for r in self.history.runs.values() if r.kind == "imitation" and r.base == 0]
        if not parents:
            return
        parent = parents[step.target % len(parents)]
        listed = await self.call("ListCheckpoints", pb.ListCheckpointsRequest(run_id=parent.id))
        if not listed.checkpoints:
            return
        source = listed.checkpoints[-1]
        request_id = f"fork-{self.plan.seed}-{step.at:.3f}"
        draws = random.Random(request_id)
        request = imitation_request(draws, request_id)
        request.config.max_episodes = int(source.episode) + draws.randrange(60, 250)
        request.fork_from.run_id = parent.id
        request.fork_from.episode = source.episode
        await self._create(request, "imitation", base=int(source.episode))

    # -- faults ------------------------------------------------------------------------------

    def _trainer(self, step: Step) -> Trainer:
        """The fault's trainer: among those running something when there are any."""
        choices = [t for t in self._busy_trainers() if t.proc is not None and not t.stopped]
        choices = choices or self.cluster.trainers
        return choices[step.target % len(choices)]

    async def _snapshot(self, only: str | None = None) -> FaultLog:
        """The running runs now (on the trainer ``only`` when given) and the furthest episode
        each had reached: what either replica says it trained, or what its recorder saw."""
        log = FaultLog("", "", time.monotonic(), 0.0)
        for run in self._active():
            status = run.status
            if status is None or status.state != State.STATE_RUNNING:
                continue
            if only is not None and only not in (status.trainer, *status.trainers):
                continue
            trained = int(status.trainer_episode)
            for index in self._up():
                with contextlib.suppress(grpc.aio.AioRpcError):
                    reply = await self._stubs[index].GetRun(
                        pb.GetRunRequest(run_id=run.id), timeout=2.0
                    )
                    trained = max(trained, int(reply.run.trainer_episode))
            log.hit[run.id] = max(run.recorder.last, trained)
            log.trainer_episode[run.id] = trained
        log.start, log.wall = time.monotonic(), time.time()
        return log

    def _busy_trainers(self) -> list[Trainer]:
        """The trainers some running run is on now (a fault there hits something)."""
        busy = []
        for trainer in self.cluster.trainers:
            for run in self._active():
                status = run.status
                running = status is not None and status.state == State.STATE_RUNNING
                if running and trainer.address in (status.trainer, *status.trainers):
                    busy.append(trainer)
                    break
        return busy

    async def _fault_loop(self) -> None:
        for step in self.plan.faults:
            await self._until(step.at)
            logged = len(self.history.faults)
            try:
                await self._fault(step)
            except Exception as exc:  # a fault that could not be done is noted, not fatal
                self.history.fault_failed(step.kind, logged, repr(exc))

    async def _fault(self, step: Step) -> None:
        cluster = self.cluster
        kind = step.kind
        if kind.startswith("trainer_") or kind.startswith("proxy_"):
            trainer = self._trainer(step)
            if trainer.proc is None or trainer.stopped:
                return  # still down from an earlier fault
            log = await self._snapshot(trainer.address)
            log.kind, log.target = kind, f"trainer{trainer.index}"
            self.history.faults.append(log)
            if kind == "trainer_kill":
                left = await asyncio.to_thread(cluster.kill_trainer, trainer)
                self._spawn(self._gone(trainer, left), "chaos-gone")
                await asyncio.sleep(step.duration)
                await asyncio.to_thread(cluster.start_trainer, trainer)
            elif kind == "trainer_stop":
                await asyncio.to_thread(cluster.stop_trainer, trainer, True)
                await asyncio.sleep(step.duration)
                await asyncio.to_thread(cluster.stop_trainer, trainer, False)
            else:
                fault = {
                    "proxy_delay": Fault.DELAY,
                    "proxy_drop": Fault.DROP,
                    "proxy_reset": Fault.RESET,
                    "proxy_blackhole": Fault.BLACKHOLE,
                }[kind]
                delay = 0.05 + 0.45 * step.value
                await asyncio.to_thread(cluster.proxy_fault, trainer, fault, delay)
                await asyncio.sleep(step.duration)
                await asyncio.to_thread(cluster.proxy_fault, trainer, Fault.NONE)
            log.end = time.monotonic()
        elif kind == "gateway_kill":
            up = [g for g in cluster.gateways if g.up]
            if len(up) < len(cluster.gateways):
                return  # keep one replica up
            gateway = up[step.target % len(up)]
            log = await self._snapshot()
            log.hit = {r: e for r, e in log.hit.items() if self._drives(r) == gateway.index}
            log.kind, log.target = kind, f"gateway{gateway.index}"
            log.start, log.wall = time.monotonic(), time.time()
            self.history.faults.append(log)
            await asyncio.to_thread(cluster.kill_gateway, gateway)
            await asyncio.sleep(step.duration)
            await asyncio.to_thread(cluster.start_gateway, gateway)
            log.end = time.monotonic()
        elif kind == "postgres_restart":
            log = await self._snapshot()
            log.kind, log.target = kind, "postgres"
            log.start, log.wall = time.monotonic(), time.time()
            self.history.faults.append(log)
            await asyncio.to_thread(cluster.restart_postgres)
            log.end = time.monotonic()
        elif kind in ("store_unwritable", "store_full"):
            log = FaultLog(kind, "store", time.monotonic(), 0.0)
            self.history.faults.append(log)
            try:
                if kind == "store_unwritable":
                    await asyncio.to_thread(cluster.store_unwritable)
                elif not await asyncio.to_thread(cluster.store_full):
                    log.note = "not supported here (needs root for a tmpfs)"
                await asyncio.sleep(step.duration)
            finally:
                await asyncio.to_thread(cluster.heal_store)
                log.end = time.monotonic()

    async def _gone(self, trainer: Trainer, processes: list[psutil.Process]) -> None:
        """The processes of a killed trainer's jobs (GRPO ranks, which name themselves) must
        be gone within ``GONE_S``; its helpers (a forkserver) that are not are noted."""
        await asyncio.sleep(GONE_S)
        for process in processes:
            with contextlib.suppress(psutil.Error):
                if alive(process):
                    line = " ".join(process.cmdline())
                    what = (
                        f"pid {process.pid} ({line[:100]}) outlived trainer{trainer.index} by "
                        f"{GONE_S:g} s"
                    )
                    if "(GRPO rank" in line:
                        self.history.leftovers.append(what)
                    else:
                        self.history.helpers_left.append(what)

    # -- sampling ----------------------------------------------------------------------------

    def _drives(self, run_id: str) -> int | None:
        return self._driver_of.get(run_id)

    _driver_of: dict[str, int] = {}

    async def _sample_loop(self) -> None:
        self._driver_of = {}
        while True:
            await asyncio.sleep(1.0)
            for run in list(self.history.runs.values()):
                if run.final is not None:
                    continue
                drivers = []
                for index, gateway in enumerate(self.cluster.gateways):
                    if not gateway.up:
                        continue
                    try:
                        reply = await self._stubs[index].GetRun(
                            pb.GetRunRequest(run_id=run.id), timeout=2.0
                        )
                    except grpc.aio.AioRpcError:
                        continue
                    status = reply.run
                    run.status = status
                    if status.state in FINAL:
                        run.final = status
                        break
                    if self._driven_by(status, gateway):
                        drivers.append(index)
                if run.final is not None:
                    continue
                if len(drivers) == 1:
                    self._driver_of[run.id] = drivers[0]
                if len(drivers) > 1:
                    seen = self._driving.get(run.id, 0) + 1
                    self._driving[run.id] = seen
                    if seen == 3:
                        self.history.two_drivers.append(
                            f"run {run.id}: replicas {drivers} both drove it for 3 samples"
                        )
                else:
                    self._driving[run.id] = 0

    @staticmethod
    def _driven_by(status: Any, gateway: Gateway) -> bool:
        if status.state not in (State.STATE_RUNNING, State.STATE_PAUSED):
            return False
        detail = status.state_detail
        return "another gateway replica" not in detail and "waiting for a gateway" not in detail

    async def _memory_loop(self) -> None:
        while True:
            await asyncio.to_thread(self.cluster.sample_memory)
            await asyncio.sleep(5.0)

    # -- the end -----------------------------------------------------------------------------

    async def _heal_all(self) -> None:
        """Every fault undone, every process up (the fault loop has returned)."""
        cluster = self.cluster
        await asyncio.to_thread(cluster.heal_store)
        for trainer in cluster.trainers:
            await asyncio.to_thread(cluster.proxy_fault, trainer, Fault.NONE)
            if trainer.proc is None:
                await asyncio.to_thread(cluster.start_trainer, trainer)
            elif trainer.stopped:
                await asyncio.to_thread(cluster.stop_trainer, trainer, False)
        for gateway in cluster.gateways:
            if not gateway.up:
                await asyncio.to_thread(cluster.start_gateway, gateway)

    async def _drain(self) -> None:
        """Resumes and speeds up every run, then waits for each to end."""
        deadline = time.monotonic() + DRAIN_S
        while time.monotonic() < deadline:
            active = self._active()
            if not active:
                break
            for run in active:
                status = run.status
                with contextlib.suppress(grpc.aio.AioRpcError):
                    if status is not None and status.state == State.STATE_PAUSED:
                        await self.call("ResumeRun", pb.ResumeRunRequest(run_id=run.id), 10.0)
                    if status is not None and status.speed < 20.0:
                        await self.call(
                            "SetRunSpeed", pb.SetRunSpeedRequest(run_id=run.id, speed=20.0), 10.0
                        )
            await asyncio.sleep(2.0)
        for run in self._active():
            detail = "" if run.status is None else run.status.state_detail
            self.history.undrained.append(f"run {run.id} did not end: {detail}")
        # Recorders see ``finished`` just after the store says so.
        recorders = [
            t for t in self._tasks if t.get_name().startswith("chaos-recorder-") and not t.done()
        ]
        if recorders:
            await asyncio.wait(recorders, timeout=30.0)
