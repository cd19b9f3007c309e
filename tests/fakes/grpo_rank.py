"""A GRPO rank whose training is scripted: the real worker (its channel, step gate, lifeline and
reports) around a trainer that loads no model.

``python -m tests.fakes.grpo_rank --fd N --parent-pid P`` is what a job's processes run once a
test points ``launch.WORKER_MODULE`` here (the :func:`scripted_ranks` fixture), so the trainer's
side of a job (``process.run``) is exercised with real processes in about a second each. The
job's ``task.grpo.model_path`` is the script:

- ``scripted``: one step per step granted, each logging a reward of step / 10;
- ``scripted:fail-at=N``: step N raises ``RuntimeError("boom")``;
- ``scripted:step-s=S``: each step takes S seconds;
- ``scripted:save-fails``: every checkpoint fails as on a full disk.

Its live hyperparameters start at the task's (defaults applied, as the provider reports them);
a ``HYPER`` changes them, and each step logs the ``learning_rate`` it trained with, as TRL does
(without a schedule).

A checkpoint (the trainer's ``SAVE``) is one file, ``scripted.json``, written by rank 0: the
step and the rewards the rank was given.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

MODULE = "tests.fakes.grpo_rank"


class ScriptedTrainer:
    """Calls its callbacks' ``on_log`` once per step, as Trainer's loop does after each optimizer
    step, and stops when one of them asks it to."""

    lazy_dataset = None  # no rows for the rank's background check
    step_meter = None  # no step metrics

    def __init__(self, job: Any, callbacks: Sequence[Any], **kwargs: Any) -> None:
        del kwargs
        self.callbacks = list(callbacks)
        self.steps = job.config.max_episodes
        parts = job.task.grpo.model_path.split(":")[1:]
        script = dict(part.split("=", 1) for part in parts if "=" in part)
        self.fail_at = int(script.get("fail-at", 0))
        self.step_s = float(script.get("step-s", 0))
        self.save_fails = "save-fails" in parts
        self.step = 0
        from trainer_service.providers.grpo.hyperparameters import hyperparameters

        self.values = hyperparameters(job.task).as_dict()

    def set_hyperparameters(self, **values: float) -> None:
        self.values.update(values)

    def sampling_hyperparameters(self) -> dict[str, float]:
        return {"temperature": self.values["temperature"], "beta": self.values["beta"]}

    def save_checkpoint(
        self, directory: pathlib.Path, best_reward: float | None, last_reward: float | None
    ) -> int:
        if self.save_fails:
            raise OSError(errno.ENOSPC, "No space left on device")
        if os.environ.get("RANK", "0") != "0":
            return 0  # rank 0 writes, as the real trainer's ranks do
        record = {"step": self.step, "best_reward": best_reward, "last_reward": last_reward}
        (directory / "scripted.json").write_text(json.dumps(record))
        return len(json.dumps(record))

    def train(self) -> None:
        from transformers import TrainerControl, TrainerState

        state, control = TrainerState(), TrainerControl()
        for step in range(1, self.steps + 1):
            if step == self.fail_at:
                raise RuntimeError("boom")
            time.sleep(self.step_s)
            state.global_step = self.step = step
            logs = {
                "loss": 1.0 / step,
                "reward": step / 10,
                "learning_rate": self.values["learning_rate"],
            }
            for callback in self.callbacks:
                control = callback.on_log(None, state, control, logs=logs) or control
            if control.should_training_stop:
                return


@pytest.fixture
def scripted_ranks(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Makes the GRPO jobs of this test run scripted ranks; yields their module name."""
    from trainer_service.providers.grpo import launch

    monkeypatch.setattr(launch, "WORKER_MODULE", MODULE)
    yield MODULE


if __name__ == "__main__":
    from trainer_service.providers.grpo import worker

    sys.exit(worker.main(build=ScriptedTrainer))
