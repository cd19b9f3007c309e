"""TRL's ``GRPOTrainer`` alone on a model and dataset, timed step by step: the baseline that
``bench/gpu_real_size.py`` holds a Trainwire job to.

``python bench/_bare_trl_grpo.py --spec SPEC.json --out RESULT.json`` trains, in this process,
one run per entry of the spec's ``runs`` (full fine-tuning, LoRA), each on the spec's model,
JSONL dataset and settings, and writes what each step took. Nothing of Trainwire is imported:
the model loads with ``AutoModelForImageTextToText`` (fp32 master weights; bf16 autocast on a
GPU, as a Trainwire job trains), the dataset is a ``datasets.Dataset`` whose images decode as
rows are read (in the DataLoader workers), the reward is a plain exact match, and LoRA is TRL's
``peft_config``. The settings mirror those a Trainwire job maps its task to
(``trainer_service/providers/grpo/settings.py``), so both sides train the same steps.

Per step (between two consecutive step logs, as a Trainwire job emits an episode at each):
the wall time, and inside it the time in generation (``_generate``: sampling and decoding), in
reward scoring (``_calculate_rewards``) and in the rest of scoring (log-probabilities, advantages:
the rest of ``_generate_and_score_completions``); the remainder is the loss, backward and
optimizer step. Plus TRL's own step log (``num_tokens``, ``completions/mean_length``...) and,
per run, the peak of the CUDA allocator.

Run with no arguments (``make bench`` runs every ``bench/*.py``) it says what it is and exits.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import re
import string
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def exact_match(completions: list[Any], solution: list[str], **_: Any) -> list[float | None]:
    """1.0 where the completion's answer (inside ``<answer>`` if present) equals the solution,
    ignoring case, edge whitespace and punctuation."""

    def norm(text: str) -> str:
        return text.strip().strip(string.punctuation + string.whitespace).lower()

    rewards: list[float | None] = []
    for completion, expected in zip(completions, solution, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        found = _ANSWER.search(text)
        rewards.append(1.0 if norm(found.group(1) if found else text) == norm(expected) else 0.0)
    return rewards


def load_rows(path: pathlib.Path) -> Any:
    """The JSONL rows as a ``datasets.Dataset``: prompt, image (decoded when read), solution."""
    from datasets import Dataset, Image

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    dataset = Dataset.from_dict(
        {
            "prompt": [row["prompt"] for row in rows],
            "image": [str(path.parent / row["image_paths"][0]) for row in rows],
            "solution": [row["solution"] for row in rows],
        }
    )
    return dataset.cast_column("image", Image())


def train(spec: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """Trains one run of the spec; returns its steps and peak memory."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = spec["device"].startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(spec["device"]))
        torch.cuda.reset_peak_memory_stats()
    else:
        torch.set_num_threads(1)
    split = {"generate": 0.0, "reward": 0.0, "score": 0.0}

    class TimedGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
        """GRPOTrainer that adds up where each step's time goes."""

        def _generate(self, prompts: list[Any]) -> Any:
            started = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                split["generate"] += time.perf_counter() - started

        def _calculate_rewards(self, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return super()._calculate_rewards(*args, **kwargs)
            finally:
                split["reward"] += time.perf_counter() - started

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            started = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                split["score"] += time.perf_counter() - started

    steps: list[dict[str, Any]] = []
    started = time.perf_counter()

    class Stamp(TrainerCallback):  # type: ignore[misc]
        """Notes each step's log: when it came, the split since the last one, TRL's values."""

        last = started

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> Any:
            if not logs or "train_runtime" in logs:
                return control
            now = time.perf_counter()
            record = {k: v for k, v in logs.items() if isinstance(v, int | float)}
            record.update(
                wall_s=now - self.last,
                generate_s=split["generate"],
                reward_s=split["reward"],
                score_other_s=split["score"] - split["generate"] - split["reward"],
            )
            steps.append(record)
            split.update(generate=0.0, reward=0.0, score=0.0)
            self.last = now
            return control

    model = AutoModelForImageTextToText.from_pretrained(
        spec["model"], local_files_only=True, dtype=torch.float32
    )
    processor = AutoProcessor.from_pretrained(
        spec["model"], local_files_only=True, padding_side="left", truncation_side="left"
    )
    peft_config = None
    if run.get("lora"):
        from peft import LoraConfig

        lora = run["lora"]
        peft_config = LoraConfig(
            r=lora["rank"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            target_modules=lora["target_modules"],
            bias="none",
        )
    workers = spec["dataloader_num_workers"]
    checkpointing = spec["gradient_checkpointing"]
    with tempfile.TemporaryDirectory(prefix="bare-trl-grpo-") as scratch:
        args = GRPOConfig(
            output_dir=scratch,
            max_steps=spec["steps"],
            per_device_train_batch_size=spec["batch_size"],
            num_generations=spec["num_generations"],
            max_completion_length=spec["max_completion_length"],
            learning_rate=spec["learning_rate"],
            beta=0.0,
            temperature=spec["temperature"],
            dataloader_num_workers=workers,
            dataloader_persistent_workers=workers > 0,
            seed=spec["seed"],
            data_seed=spec["seed"],
            use_cpu=not cuda,
            bf16=cuda and torch.cuda.is_bf16_supported(),
            gradient_checkpointing=checkpointing,
            activation_checkpointing=checkpointing,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            remove_unused_columns=False,
        )
        trainer = TimedGRPOTrainer(
            model=model,
            reward_funcs=[exact_match],
            args=args,
            train_dataset=load_rows(pathlib.Path(spec["dataset"])),
            processing_class=processor,
            callbacks=[Stamp()],
            peft_config=peft_config,
        )
        trainer.train()
    result: dict[str, Any] = {"name": run["name"], "steps": steps}
    if cuda:
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    del trainer, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    """Trains every run of ``--spec`` and writes the results to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=pathlib.Path, help="the runs and their settings (JSON)")
    parser.add_argument("--out", type=pathlib.Path, help="where the results go (JSON)")
    args = parser.parse_args(argv)
    if args.spec is None or args.out is None:
        print("bench/_bare_trl_grpo.py: bench/gpu_real_size.py runs it (--spec, --out)")
        return 0
    import transformers

    transformers.utils.logging.set_verbosity_error()
    spec = json.loads(args.spec.read_text())
    results = [train(spec, run) for run in spec["runs"]]
    args.out.write_text(json.dumps(results, indent=1))
    return 0


# DataLoader workers may re-import this file: guard the entry point.
if __name__ == "__main__":
    sys.exit(main())
