"""Checkpoints with real processes: trainer processes (imitation on the CPU) writing to a shared
checkpoint directory, the gateway in-process reading it.

What only processes show: kill -9 of the trainer that runs a run makes the run finish on the
other trainer from its checkpoint, exactly once for a watcher and with the rewards the
uninterrupted run has; a parked run frees its trainer's only slot for another run, then
resumes and finishes; a corrupted latest checkpoint is skipped on resume and the run says so;
a checkpoint the trainer cannot write (a file-size limit, as a full disk) is shown while
training goes on; retention keeps the latest checkpoints on disk, a download extracts the
trained policy, and DeleteRun removes the run's checkpoints; the same with an S3 store (moto's
server on 127.0.0.1); a checkpoint that rotted in the store is never downloaded whole. The
logic behind them (when to restart, park, drop re-trained episodes) is tested in virtual time
in ``tests/core/test_checkpoints.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import signal
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from safetensors.numpy import load_file

from tests import s3_fixtures
from tests.fakes.gateway_harness import Client, collect, get_run, running_gateway, trainer_process
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT, until
from trainwire import aio
from trainwire import client as tc
from trainwire.cli import main as cli_main
from trainwire.v1 import episode_pb2, gateway_service_pb2
from trainwire_ops.checkpoints import CheckpointStore

State = gateway_service_pb2.Run.State
pb = gateway_service_pb2
TRAINER_FLAGS = ("--heartbeat", "0.5", "--detach-grace", "60")
GATEWAY = {"heartbeat_timeout_s": 3.0, "schedule_poll_s": 0.2}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

s3_endpoint = s3_fixtures.s3_endpoint
s3_bucket = s3_fixtures.s3_bucket


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's checkpoint directory (every run has its own directory in it)."""
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def single(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One trainer of one slot on the module's store, for the tests that kill nothing."""
    log = tmp_path_factory.mktemp("single") / "t.log"
    with trainer_process(log, *TRAINER_FLAGS, "--checkpoint-store", str(store), slots=1) as (
        _,
        address,
    ):
        yield address


@pytest.fixture
def trainers(store: Path, tmp_path: Path) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """Two trainer processes of one slot each, sharing the checkpoint store."""
    with (
        trainer_process(
            tmp_path / "t1.log", *TRAINER_FLAGS, "--checkpoint-store", str(store), slots=1
        ) as one,
        trainer_process(
            tmp_path / "t2.log", *TRAINER_FLAGS, "--checkpoint-store", str(store), slots=1
        ) as two,
    ):
        yield [one, two]


def _request(max_episodes: int, rate: float, every: int, keep: int = 0) -> pb.CreateRunRequest:
    return pb.CreateRunRequest(
        task=episode_pb2.TrainTask(
            imitation=episode_pb2.ImitationTask(rig_name="stickman", clip_name="wave")
        ),
        config=episode_pb2.TrainConfig(
            max_episodes=max_episodes, seed=3, checkpoint_every=every, keep_checkpoints=keep
        ),
        episodes_per_second=rate,
    )


async def _create(client: Client, request: pb.CreateRunRequest) -> pb.Run:
    return (await client.stub.CreateRun(request, timeout=TIMEOUT)).run


async def _reached(
    client: Client, run_id: str, check: Callable[[pb.Run], bool], what: str
) -> pb.Run:
    async def found() -> pb.Run | None:
        run = await get_run(client.stub, run_id)
        return run if check(run) else None

    return await until(found, f"run {run_id}: {what}", JOB_TIMEOUT)


async def _reference_rewards(client: Client, max_episodes: int, every: int) -> list[float]:
    """The rewards of the same run trained without interruption."""
    run = await _create(client, _request(max_episodes, -1.0, every))
    watched = await collect(client.stub, run.id, timeout=JOB_TIMEOUT)
    assert watched.finished is not None and watched.finished.state == State.STATE_DONE
    return [e.reward for e in watched.episodes]


async def test_kill_9_of_the_trainer_finishes_the_run_on_the_other_from_its_checkpoint(
    trainers: list[tuple[subprocess.Popen[bytes], str]], store: Path
) -> None:
    addresses = tuple(address for _, address in trainers)
    async with running_gateway(addresses, checkpoint_store=str(store), **GATEWAY) as client:
        reference = await _reference_rewards(client, 300, 30)
        run = await _create(client, _request(300, 100.0, 30))
        watch = asyncio.create_task(collect(client.stub, run.id, timeout=JOB_TIMEOUT))
        running = await _reached(
            client, run.id, lambda r: r.checkpoint_episode >= 60 and r.episode >= 70, "trained"
        )
        victim = next(proc for proc, address in trainers if address == running.trainer)
        victim.send_signal(signal.SIGKILL)
        watched = await watch

        done = watched.finished
        assert done is not None and done.state == State.STATE_DONE, done
        assert done.restarts == 1
        assert done.trainer != running.trainer
        # Exactly once, and the rewards the uninterrupted run has: the restart continued the
        # training from the checkpoint instead of resetting it.
        assert [e.episode for e in watched.episodes] == list(range(1, 301))
        assert [e.reward for e in watched.episodes] == pytest.approx(reference, rel=1e-6)
        best = [e.best_reward for e in watched.episodes]
        assert best == sorted(best)


async def test_a_parked_run_frees_the_only_slot_then_resumes_and_finishes(
    store: Path, single: str
) -> None:
    async with running_gateway(
        (single,), checkpoint_store=str(store), park_after_s=1.0, **GATEWAY
    ) as client:
        reference = await _reference_rewards(client, 150, 25)
        first = await _create(client, _request(150, 50.0, 25))
        watch = asyncio.create_task(collect(client.stub, first.id, timeout=JOB_TIMEOUT))
        await _reached(client, first.id, lambda r: r.episode >= 30, "publishing")
        await client.stub.PauseRun(pb.PauseRunRequest(run_id=first.id), timeout=TIMEOUT)
        parked = await _reached(client, first.id, lambda r: r.parked, "parked")
        assert "parked at episode" in parked.state_detail
        assert parked.checkpoint_episode == parked.trainer_episode

        # The freed slot trains another run to its end while the first stays parked.
        second = await _create(client, _request(50, -1.0, 0))
        other = await collect(client.stub, second.id, timeout=JOB_TIMEOUT)
        assert other.finished is not None and other.finished.state == State.STATE_DONE
        assert (await get_run(client.stub, first.id)).parked

        await client.stub.ResumeRun(pb.ResumeRunRequest(run_id=first.id), timeout=TIMEOUT)
        watched = await watch
        assert watched.finished is not None and watched.finished.state == State.STATE_DONE
        assert [e.episode for e in watched.episodes] == list(range(1, 151))
        assert [e.reward for e in watched.episodes] == pytest.approx(reference, rel=1e-6)
        assert (watched.finished.parked, watched.finished.restarts) == (False, 0)


async def test_a_corrupted_latest_checkpoint_is_skipped_on_resume(store: Path, single: str) -> None:
    async with running_gateway(
        (single,), checkpoint_store=str(store), park_after_s=0.5, **GATEWAY
    ) as client:
        run = await _create(client, _request(150, 50.0, 10, keep=5))
        watch = asyncio.create_task(collect(client.stub, run.id, timeout=JOB_TIMEOUT))
        await _reached(client, run.id, lambda r: r.episode >= 25, "publishing")
        await client.stub.PauseRun(pb.PauseRunRequest(run_id=run.id), timeout=TIMEOUT)
        parked = await _reached(client, run.id, lambda r: r.parked, "parked")
        listed = await client.stub.ListCheckpoints(
            pb.ListCheckpointsRequest(run_id=run.id), timeout=TIMEOUT
        )
        *_, before, latest = listed.checkpoints
        assert latest.episode == parked.checkpoint_episode
        # Bit rot in the latest checkpoint's weights.
        weights = store / run.id / f"{latest.episode:012d}" / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))

        await client.stub.ResumeRun(pb.ResumeRunRequest(run_id=run.id), timeout=TIMEOUT)
        said = await _reached(client, run.id, lambda r: "skipped" in r.state_detail, "said")
        assert f"continued from the checkpoint at episode {before.episode}" in said.state_detail
        assert f"skipped the checkpoint at episode {latest.episode}" in said.state_detail
        watched = await watch
        assert watched.finished is not None and watched.finished.state == State.STATE_DONE
        assert [e.episode for e in watched.episodes] == list(range(1, 151))


async def test_a_checkpoint_that_cannot_be_written_is_shown_and_training_goes_on(
    store: Path, tmp_path: Path
) -> None:
    with trainer_process(
        tmp_path / "t.log",
        *TRAINER_FLAGS,
        "--checkpoint-store",
        str(store),
        slots=1,
        # A file-size limit far below a checkpoint's weights: every checkpoint write fails
        # partway, as on a full disk (Python ignores SIGXFSZ, so the write raises EFBIG).
        file_size_limit=512,
    ) as (_, address):
        async with running_gateway((address,), checkpoint_store=str(store), **GATEWAY) as client:
            run = await _create(client, _request(100, 50.0, 10))
            shown = await _reached(
                client, run.id, lambda r: "could not be written" in r.state_detail, "the failure"
            )
            assert shown.state == State.STATE_RUNNING
            watched = await collect(client.stub, run.id, timeout=JOB_TIMEOUT)
            assert watched.finished is not None and watched.finished.state == State.STATE_DONE
            assert [e.episode for e in watched.episodes] == list(range(1, 101))
            assert watched.finished.checkpoint_episode == 0
            # Nothing half-written was recorded, and nothing complete is on disk.
            listed = await client.stub.ListCheckpoints(
                pb.ListCheckpointsRequest(run_id=run.id), timeout=TIMEOUT
            )
            assert list(listed.checkpoints) == []
            assert not list(store.glob(f"{run.id}/*.json"))


async def test_retention_download_and_delete(store: Path, single: str, tmp_path: Path) -> None:
    async with running_gateway(
        (single,), checkpoint_store=str(store), http_port=0, **GATEWAY
    ) as client:
        run = await _create(client, _request(200, -1.0, 20, keep=2))
        watched = await collect(client.stub, run.id, timeout=JOB_TIMEOUT)
        assert watched.finished is not None and watched.finished.state == State.STATE_DONE
        listed = await client.stub.ListCheckpoints(
            pb.ListCheckpointsRequest(run_id=run.id), timeout=TIMEOUT
        )
        assert [c.episode for c in listed.checkpoints] == [180, 200]
        assert watched.finished.checkpoint_episode == 200

        async def only_the_kept_on_disk() -> bool:
            kept = sorted(p.name for p in (store / run.id).iterdir() if p.is_dir())
            return kept == [f"{180:012d}", f"{200:012d}"]

        await until(only_the_kept_on_disk, "retention on disk")

        out = tmp_path / "model"
        async with aio.GatewayClient(client.address) as gateway:
            record = await gateway.download_checkpoint(run.id, out)
        assert record == listed.checkpoints[-1]
        meta = json.loads((out / "checkpoint.json").read_text())
        assert meta["episode"] == 200
        weights = load_file(str(out / "model.safetensors"))
        assert weights, "no tensors in the policy"

        # The same over HTTP: the JSON list, and the tar itself (what the page links to).
        assert client.gateway.http is not None
        base = f"{client.gateway.http.url}/v1/runs/{run.id}/checkpoints"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as http:
            async with http.get(base) as reply:
                assert reply.status == 200
                body = await reply.json()
            assert [int(c["episode"]) for c in body["checkpoints"]] == [180, 200]
            async with http.get(f"{base}/180:download") as reply:
                assert reply.status == 200
                assert reply.content_type == "application/x-tar"
                data = await reply.read()
            assert hashlib.sha256(data).hexdigest() == listed.checkpoints[0].sha256
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                assert "model.safetensors" in tar.getnames()
            async with http.get(f"{base}/7:download") as reply:
                assert reply.status == 404
                error = (await reply.json())["error"]
            assert "180, 200" in error["message"]

        # The CLI (the synchronous client): the list, and a download of the older one.
        gateway_flag = ["--gateway", client.address]
        cli_out = tmp_path / "cli-model"
        listing = ["runs", "checkpoints", run.id]
        assert await asyncio.to_thread(cli_main, [*gateway_flag, *listing]) == 0
        fetch = ["runs", "download", run.id, "--episode", "180", "--out", str(cli_out)]
        assert await asyncio.to_thread(cli_main, [*gateway_flag, *fetch]) == 0
        assert json.loads((cli_out / "checkpoint.json").read_text())["episode"] == 180
        assert await asyncio.to_thread(cli_main, [*gateway_flag, *fetch]) == 1  # not empty

        # A stored checkpoint that rotted is never delivered whole: DATA_LOSS, nothing left.
        rotten = store / run.id / f"{180:012d}" / "model.safetensors"
        data = bytearray(rotten.read_bytes())
        data[len(data) // 2] ^= 0xFF
        rotten.write_bytes(bytes(data))
        async with aio.GatewayClient(client.address) as gateway:
            with pytest.raises(tc.CheckpointCorrupt, match="damaged"):
                await gateway.download_checkpoint(run.id, tmp_path / "rotten", episode=180)
        assert not (tmp_path / "rotten").exists()
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".rotten")] == []

        await client.stub.DeleteRun(pb.DeleteRunRequest(run_id=run.id), timeout=TIMEOUT)
        await until(lambda: not (store / run.id).exists(), "the run's checkpoints deleted")


async def test_an_s3_store_through_the_local_endpoint(
    s3_bucket: s3_fixtures.S3Bucket, tmp_path: Path
) -> None:
    url = s3_bucket.url()
    with trainer_process(
        tmp_path / "t.log",
        *TRAINER_FLAGS,
        "--checkpoint-store",
        url,
        slots=1,
        env=s3_bucket.env,
    ) as (_, address):
        async with running_gateway((address,), checkpoint_store=url, **GATEWAY) as client:
            run = await _create(client, _request(100, -1.0, 20, keep=2))
            watched = await collect(client.stub, run.id, timeout=JOB_TIMEOUT)
            assert watched.finished is not None and watched.finished.state == State.STATE_DONE
            listed = await client.stub.ListCheckpoints(
                pb.ListCheckpointsRequest(run_id=run.id), timeout=TIMEOUT
            )
            assert [c.episode for c in listed.checkpoints] == [80, 100]

            store = CheckpointStore(url)
            await until(lambda: store.episodes(run.id) == [80, 100], "retention in the bucket")
            out = tmp_path / "model"
            async with aio.GatewayClient(client.address) as gateway:
                record = await gateway.download_checkpoint(run.id, out, episode=80)
            assert record.sha256 == listed.checkpoints[0].sha256
            assert json.loads((out / "checkpoint.json").read_text())["episode"] == 80

            await client.stub.DeleteRun(pb.DeleteRunRequest(run_id=run.id), timeout=TIMEOUT)
            await until(lambda: store.episodes(run.id) == [], "the run's objects deleted")
