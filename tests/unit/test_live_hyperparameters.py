"""Live hyperparameters in the trainer: the job's mailbox, the imitation provider's next optimizer
step taking a new learning rate (bit for bit what a learner changed at that step computes), its
checkpoints recording the rate in effect and a resume taking the task's; the GRPO side: what a
job starts with and refuses, the learning rate of a running schedule, the temperature of TRL's
fused LM head, and ``HYPER`` through real rank processes (scripted training) to the episodes of
the step it applies to."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

from tests.fakes.grpo_rank import scripted_ranks
from tests.grpo_fixtures import make_job, tiny_grpo_task
from tests.unit.test_imitation_provider import make_job as imitation_job
from tests.unit.test_imitation_provider import wave_task
from trainer_service.core.hyperparameters import LiveHyperparameters, same_but_hyperparameters
from trainer_service.core.provider import RestoredCheckpoint
from trainer_service.providers import grpo, imitation
from trainer_service.providers.grpo import process
from trainwire.contract import StreamChecker
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import episode_pb2

pytestmark = pytest.mark.slow

__all__ = ["scripted_ranks"]  # the fixture, re-exported for pytest

torch.set_num_threads(1)


def test_the_mailbox_merges_changes_until_the_provider_takes_them() -> None:
    live = LiveHyperparameters(Hyperparameters(learning_rate=0.03, temperature=1.0, beta=0.0))
    assert live.take() is None
    assert live.request(Hyperparameters(learning_rate=0.01)) == Hyperparameters(0.01, 1.0, 0.0)
    assert live.request(Hyperparameters(beta=0.2)) == Hyperparameters(0.01, 1.0, 0.2)
    assert live.take() == Hyperparameters(learning_rate=0.01, beta=0.2)
    assert live.take() is None
    assert live.current == Hyperparameters(0.01, 1.0, 0.2)
    assert Hyperparameters(learning_rate=0.5).as_dict() == {"learning_rate": 0.5}


def test_a_reattach_may_carry_the_hyperparameters_the_gateway_changed() -> None:
    task = tiny_grpo_task("models/m", "d.jsonl", beta=0.04, temperature=0.9)
    changed = episode_pb2.TrainTask()
    changed.CopyFrom(task)
    changed.grpo.learning_rate, changed.grpo.temperature, changed.grpo.beta = 0.1, 2.0, 0.0
    assert same_but_hyperparameters(task, changed)
    changed.grpo.num_generations = 4
    assert not same_but_hyperparameters(task, changed)
    wave, faster = episode_pb2.TrainTask(imitation=wave_task()), episode_pb2.TrainTask()
    faster.CopyFrom(wave)
    faster.imitation.learning_rate = 0.2
    assert same_but_hyperparameters(wave, faster)


# -- imitation -----------------------------------------------------------------------------------


def _reference(steps_before: int, steps_after: int, rate: float | None) -> list[float]:
    """Rewards of a learner stepped by hand, its learning rate set to ``rate`` after
    ``steps_before`` steps (None: never)."""
    task = wave_task()
    learner = imitation.learner_for(task, seed=0, device="cpu")
    rewards = [learner.step().reward for _ in range(steps_before)]
    if rate is not None:
        learner.set_learning_rate(rate)
    rewards += [learner.step().reward for _ in range(steps_after)]
    return rewards


def test_the_next_optimizer_step_trains_with_the_new_learning_rate() -> None:
    job = imitation_job(wave_task(), max_episodes=12)
    job.hyperparameters.request(Hyperparameters())  # nothing set: nothing changes
    episodes = imitation.run(job)
    first = [next(episodes) for _ in range(5)]
    # The generator waits at its yield between two pulls, as a job blocked at its grant does.
    job.hyperparameters.request(Hyperparameters(learning_rate=0.004))
    rest = list(episodes)

    rates = [e.metrics["learning_rate"] for e in first + rest]
    assert rates == [imitation.DEFAULT_LEARNING_RATE] * 5 + [0.004] * 7
    rewards = [e.reward for e in first + rest]
    assert rewards == _reference(5, 7, 0.004)  # bit for bit: the step after used 0.004
    assert rewards[5:] != _reference(5, 7, None)[5:]


def test_a_checkpoint_records_the_rate_in_effect_and_a_resume_takes_the_tasks(
    tmp_path: pathlib.Path,
) -> None:
    learner = imitation.learner_for(wave_task(), seed=0, device="cpu")
    learner.step()
    learner.set_learning_rate(0.004)
    learner.step()
    directory = tmp_path / "ckpt"
    directory.mkdir()
    learner.save(directory, {"episode": 2, "best_reward": 0.1, "learning_rate": 0.004})
    assert '"learning_rate": 0.004' in (directory / imitation.INFO_FILE).read_text()

    resume = RestoredCheckpoint(directory, episode=2, best_reward=0.1)
    for task_rate, expected in ((0.0, imitation.DEFAULT_LEARNING_RATE), (0.2, 0.2)):
        task = wave_task(learning_rate=task_rate)
        job = dataclasses.replace(imitation_job(task, max_episodes=4), resume=resume)
        episodes = list(imitation.run(job))
        assert [e.episode for e in episodes] == [3, 4]
        assert {e.metrics["learning_rate"] for e in episodes} == {expected}


# -- grpo, in the trainer --------------------------------------------------------------------------


def test_grpo_starts_with_its_tasks_values_and_keeps_beta_0_without_a_reference_model() -> None:
    plain = tiny_grpo_task("m", "d.jsonl")
    assert grpo.hyperparameters(plain) == Hyperparameters(3e-3, 1.0, 0.0)
    kl = tiny_grpo_task("m", "d.jsonl", learning_rate=1e-4, temperature=0.7, beta=0.04)
    assert grpo.hyperparameters(kl) == Hyperparameters(1e-4, 0.7, 0.04)

    [refused] = grpo.check_hyperparameters(plain, Hyperparameters(beta=0.1))
    assert refused.field == "beta" and "reference model" in refused.description
    assert grpo.check_hyperparameters(plain, Hyperparameters(beta=0.0, temperature=2.0)) == []
    assert grpo.check_hyperparameters(kl, Hyperparameters(beta=0.0)) == []
    assert grpo.check_hyperparameters(kl, Hyperparameters(beta=0.5)) == []


# -- grpo, in a rank ---------------------------------------------------------------------------


def test_a_new_learning_rate_becomes_the_peak_of_the_running_schedule() -> None:
    from transformers import get_scheduler

    from trainer_service.providers.grpo.build import set_learning_rate

    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([{"params": [weight]}, {"params": [], "lr": 0.1}], lr=0.1)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=10)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(0.1 * 6 / 10)
    set_learning_rate(optimizer, scheduler, 0.01)
    assert [g["lr"] for g in optimizer.param_groups] == [pytest.approx(0.01 * 6 / 10)] * 2
    assert scheduler.get_last_lr() == [g["lr"] for g in optimizer.param_groups]
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(0.01 * 5 / 10)  # the decay goes on
    state = scheduler.state_dict()
    assert state["base_lrs"] == [0.01, 0.01]  # what a checkpoint keeps


def test_the_fused_lm_head_scores_with_the_new_temperature() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trainer_service.providers.grpo.build import set_fused_head_temperature

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).eval()
    ids = torch.tensor([[1, 5, 7, 3, 9]])

    def expected(temperature: float) -> torch.Tensor:
        logits = model(input_ids=ids).logits[:, :-1] / temperature
        return logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    add_fused_lm_head(model, temperature=1.0)

    def fused() -> torch.Tensor:
        return model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.reshape(1, -1)

    with torch.no_grad():
        assert torch.allclose(fused(), expected(1.0), atol=1e-5)
        set_fused_head_temperature(model, 0.5)
        assert torch.allclose(fused(), expected(0.5), atol=1e-5)
        assert not torch.allclose(fused(), expected(1.0), atol=1e-3)


def test_hyper_reaches_every_rank_before_the_step_it_applies_to(scripted_ranks: str) -> None:
    task = tiny_grpo_task("scripted", beta=0.04, num_processes=2)
    job = make_job(pathlib.Path("/nonexistent"), task, max_episodes=5)
    checker = StreamChecker.for_task(job.task, job.config, job.run_id)
    episodes = process.run(job)
    first = [next(episodes), next(episodes)]
    job.hyperparameters.request(Hyperparameters(learning_rate=1e-4, temperature=0.5, beta=0.0))
    rest = list(episodes)  # both ranks took HYPER (one that did not know it would fail the job)
    for episode in first + rest:
        checker.check(episode)
    checker.finish()
    values = [
        (e.episode, e.metrics["learning_rate"], e.metrics["temperature"], e.metrics["beta"])
        for e in first + rest
    ]
    assert values == [
        (1, 3e-3, 1.0, 0.04),
        (2, 3e-3, 1.0, 0.04),
        (3, 1e-4, 0.5, 0.0),
        (4, 1e-4, 0.5, 0.0),
        (5, 1e-4, 0.5, 0.0),
    ]
