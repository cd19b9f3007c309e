"""The ``grpo`` provider's training run in a thread: GRPOTrainer, episode streaming, errors.

:func:`run` is a generator. It builds the trainer in the calling thread (:mod:`.build`: errors
surface as :class:`ProviderError` with a plain message), then runs ``GRPOTrainer.train()`` in a
worker thread and yields the episodes that :class:`~.callback.StreamingCallback` hands over, one
per optimizer step, as steps complete. Closing the generator (the consumer went away) or setting
``job.stop_event`` stops training after the current step; the worker thread is always joined
before the generator returns. While training starts, a background thread checks every dataset
row and fails the job (naming the line and image) if one is bad.

:func:`translate_error` turns a training failure into what a user reads, here and in a job's
processes (:mod:`.worker`). The settings and their defaults are :mod:`.settings`.
"""

from __future__ import annotations

import gc
import logging
import tempfile
import threading
from collections.abc import Iterator

import torch

from trainer_service.core.provider import EpisodeCounter, ProviderError, TrainJob
from trainer_service.providers.grpo.build import build_trainer, use_cuda_device
from trainer_service.providers.grpo.callback import EpisodeHandoff, StreamingCallback, _End
from trainer_service.providers.grpo.lazy_images import DatasetError
from trainer_service.providers.grpo.rewards import CompletionTap
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)

#: What a user reads when a GPU ran out of memory.
OUT_OF_MEMORY_ADVICE = (
    "The GPU ran out of memory; try a smaller batch_size or max_completion_length."
)


def run(job: TrainJob) -> Iterator[episode_pb2.Episode]:
    """Trains ``job`` and yields one episode per optimizer step as steps complete.

    Raises:
        ProviderError: Model/dataset problems (plain user messages) and bad image rows.
    """
    counter = EpisodeCounter(job.config.max_episodes)
    handoff = EpisodeHandoff()
    tap = CompletionTap()
    callback = StreamingCallback(counter, handoff, job.stop_event, tap)
    with tempfile.TemporaryDirectory(prefix=f"grpo-{job.run_id}-") as scratch:
        # Held in a dict so the finally below can drop the last reference (GPU memory).
        held = {"trainer": build_trainer(job, [callback], output_dir=scratch, tap=tap)}
        if job.stop_event.is_set():
            return
        job.set_phase("training")

        def train() -> None:
            try:
                if job.device.startswith("cuda"):
                    use_cuda_device(job.device)
                else:
                    torch.set_num_threads(1)
                held["trainer"].train()
            except BaseException as exc:  # handed to the consumer, which re-raises it
                handoff.finish(exc)
            else:
                handoff.finish()

        lazy = held["trainer"].lazy_dataset
        scan_stop = threading.Event()

        def check_rows() -> None:
            # The first batch does not wait for this; a bad row anywhere still fails the job
            # within seconds rather than when training first reads it.
            try:
                checked = lazy.check_rows(scan_stop) if lazy is not None else 0
            except DatasetError as exc:
                handoff.finish(exc)
            else:
                _LOGGER.debug("run %s: %d dataset rows checked", job.run_id, checked)

        worker = threading.Thread(target=train, name=f"grpo-{job.run_id}", daemon=True)
        scanner = threading.Thread(target=check_rows, name=f"grpo-rows-{job.run_id}", daemon=True)
        worker.start()
        scanner.start()
        _LOGGER.info("run %s: GRPO training started (%d steps)", job.run_id, counter.max_episodes)
        try:
            while True:
                item = handoff.get()
                if isinstance(item, _End):
                    if item.error is not None:
                        raise translate_error(item.error) from item.error
                    break
                yield item
        finally:
            scan_stop.set()
            handoff.close()
            worker.join()
            scanner.join()
            held.clear()
            if job.device.startswith("cuda"):
                gc.collect()  # model and optimizer sit in reference cycles
                torch.cuda.empty_cache()
            _LOGGER.info(
                "run %s: GRPO training ended after %d steps", job.run_id, callback.last_step
            )
        if not counter.finished and not job.stop_event.is_set():
            raise ProviderError(
                "Training ended before the requested number of steps.",
                detail=f"{counter.episode} of {counter.max_episodes} steps",
                code="INTERNAL",
                reason="ENDED_EARLY",
            )


def translate_error(error: BaseException) -> BaseException:
    """Turns a training failure into what the consumer should see: a ``ProviderError`` with a
    plain message where one is known (a dataset row, running out of memory), else ``error``."""
    if isinstance(error, DatasetError) and "Original Traceback" in error.user_message:
        # Raised in a DataLoader worker: torch re-raised it with the worker's traceback as the
        # message. The user gets the original message (its last line); the log gets the rest.
        last = error.user_message.strip().splitlines()[-1]
        message = last.split("DatasetError: ", 1)[-1]
        return DatasetError(message, detail=error.user_message)
    if isinstance(error, ProviderError):
        return error
    if isinstance(error, torch.cuda.OutOfMemoryError):
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
