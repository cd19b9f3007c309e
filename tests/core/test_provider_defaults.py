"""The gateway learns each provider's defaults from its trainers (``GetCapabilitiesResponse.
provider_defaults``) instead of keeping a copy: a run whose config leaves ``checkpoint_every`` at
0 keeps the details of its checkpoints at the interval the trainer it runs on advertises (and
that trainer checkpoints at), a run placed on a trainer that advertises none takes another
trainer's, and a run's own interval wins. In virtual time, scaled down as in test_long_runs."""

from __future__ import annotations

import dataclasses

from gateway.core.details import DetailRetention
from gateway.core.hyperparameters import has_reference_model
from gateway.core.runs import RunState
from tests.fakes.core_harness import Core, running_core
from tests.fakes.memory_trainer import JobScript, MemoryTrainer
from tests.fakes.virtual_time import VIRTUAL_TIME
from trainer_service.providers.defaults import GRPO, IMITATION, grpo_proto, imitation_proto
from trainwire.v1 import episode_pb2, trainer_service_pb2

pytestmark = VIRTUAL_TIME

LIVE = 64
DETAILS = 200
EPISODES = 3000  # stride 15
DETAIL_EVERY = 10
SMALL = {"live_episodes": LIVE, "details_per_run": DETAILS}


def advertising(every: int) -> dict[str, trainer_service_pb2.ProviderDefaults]:
    """The imitation provider's real defaults, but checkpointing every ``every`` episodes (not a
    multiple of the stride, so only the checkpoint rule keeps those details)."""
    return {"imitation": imitation_proto(dataclasses.replace(IMITATION, checkpoint_every=every))}


def retention(core: Core, run_id: str) -> DetailRetention:
    driver = core.registry.table.get(run_id)
    assert driver is not None and driver.publisher.details is not None
    return driver.publisher.details


async def test_a_run_keeps_the_details_of_its_trainer_s_default_checkpoints() -> None:
    first = MemoryTrainer("t1", slots_total=1, provider_defaults=advertising(70))
    second = MemoryTrainer("t2", slots_total=1, provider_defaults=advertising(110))
    async with running_core(first, second, **SMALL) as core:
        runs = []
        for trainer in (first, second):
            trainer.script(JobScript(detail_every=DETAIL_EVERY))
        for _ in range(2):
            # keep_checkpoints 1: older checkpoints are deleted long before their stretch of
            # details is settled, so only the interval keeps their details.
            run = await core.create(
                max_episodes=EPISODES, episodes_per_second=1000.0, keep_checkpoints=1
            )
            runs.append(run.id)
        on_first, on_second = runs
        await core.wait_episode(on_first, 100)
        await core.wait_episode(on_second, 100)
        assert (await core.run(on_first)).trainer == "t1"
        assert (await core.run(on_second)).trainer == "t2"
        assert retention(core, on_first).checkpoint_every == 70
        assert retention(core, on_second).checkpoint_every == 110
        for run_id in runs:
            await core.wait_state(run_id, RunState.DONE)
        replays = {run_id: core.watch(run_id) for run_id in runs}
        for watch in replays.values():
            await watch.ended()

    # Each trainer checkpointed at its own default; the gateway's retention deleted all but the
    # newest, and still kept those episodes' details.
    store = core.connector.checkpoints
    for run_id, every in ((on_first, 70), (on_second, 110)):
        written = sorted({e for r, e in [*store.saved, *store.deleted] if r == run_id})
        assert written[:3] == [every, 2 * every, 3 * every]
        assert (run_id, every) in store.deleted
    for run_id, every in ((on_first, 70), (on_second, 110)):
        kept = {e.episode for e in replays[run_id].episodes() if e.HasField("imitation")}
        multiples = {n for n in range(every, EPISODES + 1, every) if n % DETAIL_EVERY == 0}
        assert multiples <= kept, sorted(multiples - kept)[:5]


async def test_a_trainer_that_advertises_no_defaults_takes_another_trainer_s() -> None:
    old = MemoryTrainer("old", slots_total=1, provider_defaults={})
    new = MemoryTrainer("new", slots_total=1, provider_defaults=advertising(70))
    async with running_core(old, new, **SMALL) as core:
        scheduler = core.registry.scheduler
        await scheduler.first_round(5.0)
        assert scheduler.provider_defaults("imitation", "old") == advertising(70)["imitation"]
        assert scheduler.provider_defaults("imitation", "new") == advertising(70)["imitation"]
        assert scheduler.provider_defaults("imitation") == advertising(70)["imitation"]
        assert scheduler.provider_defaults("grpo", "old") is None  # nobody offers grpo
        run = await core.create(max_episodes=EPISODES, episodes_per_second=100.0)
        await core.wait_episode(run.id, 5)
        assert (await core.run(run.id)).trainer == "old"
        assert retention(core, run.id).checkpoint_every == 70
        # The run's own interval wins over any default.
        own = await core.create(
            max_episodes=EPISODES, episodes_per_second=100.0, checkpoint_every=30
        )
        await core.wait_episode(own.id, 5)
        assert retention(core, own.id).checkpoint_every == 30
        await core.registry.stop(run.id)
        await core.registry.stop(own.id)


async def test_without_any_advertised_default_only_recorded_checkpoints_count() -> None:
    old = MemoryTrainer("old", provider_defaults={})
    async with running_core(old, **SMALL) as core:
        run = await core.create(max_episodes=EPISODES, episodes_per_second=100.0)
        await core.wait_episode(run.id, 5)
        details = retention(core, run.id)
        assert details.active and details.checkpoint_every == 0
        assert not details.keeps(70, done=False) and details.keeps(75, done=False)
        await core.registry.stop(run.id)


def test_whether_a_job_has_a_reference_model_follows_its_trainer_s_default_beta() -> None:
    full = episode_pb2.TrainTask(grpo=episode_pb2.GrpoTask(model_path="m", dataset_path="d"))
    lora = episode_pb2.TrainTask()
    lora.CopyFrom(full)
    lora.grpo.lora.SetInParent()
    real = grpo_proto()
    kl = grpo_proto(dataclasses.replace(GRPO, beta=0.1))
    # Unset beta: the trainer's default (0 for full fine-tuning, as the real provider's), and
    # without advertised defaults the contract's 0.
    assert not has_reference_model(full, real) and not has_reference_model(full)
    assert has_reference_model(full, kl)
    # A beta the task sets, and LoRA, decide whatever the default.
    full.grpo.beta = 0.0
    assert not has_reference_model(full, kl)
    assert has_reference_model(lora, real) and has_reference_model(lora)
    imitation = episode_pb2.TrainTask(imitation=episode_pb2.ImitationTask(clip_name="wave"))
    assert has_reference_model(imitation)
