"""LoRA, gradient checkpointing and merged downloads at their seams.

The task's LoRA config with its defaults (settings, the client's request checks, what a fork may
change); the layers adapters go on, found in LLaVA, Qwen2-VL and Idefics3 models; the trainer's
check of a LoRA checkpoint; a LoRA job built as a rank builds it, in this process: it trains with
gradient checkpointing against its base model as reference, writes the adapter in PEFT's format
and resumes with every adapter tensor; the trainer core's merges over a real checkpoint store with
a scripted provider; the gateway's merged downloads over scripted trainers; the HTTP flag and the
CLI flag. The services with real processes, the merge's own and fresh loading processes included:
``tests/integration/test_grpo_lora.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import pathlib
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from gateway.core.checkpoints import CheckpointReads
from gateway.core.errors import (
    CheckpointCorrupt,
    CheckpointNotFound,
    IllegalTransition,
    TrainerUnavailable,
)
from gateway.core.hyperparameters import has_reference_model
from gateway.core.runs import TrainingRun
from gateway.core.store import CheckpointRecord
from gateway.core.trainers import (
    CheckpointSaved,
    MergedCheckpoint,
    TrainerLost,
    TrainerMergeFailed,
)
from tests.grpo_fixtures import MODEL_DIR, grpo_data_root, make_job, tiny_grpo_task
from trainer_service.core import errors as trainer_errors
from trainer_service.core.merging import CheckpointMerges
from trainer_service.core.provider import CheckpointUnusable, ProviderError, RestoredCheckpoint
from trainer_service.providers.grpo import checkpoint_files, merge
from trainer_service.providers.grpo.hyperparameters import (
    DEFAULT_LEARNING_RATE,
    DEFAULT_LORA_BETA,
    DEFAULT_LORA_LEARNING_RATE,
    check_hyperparameters,
    hyperparameters,
)
from trainer_service.providers.grpo.settings import LoraSettings, Settings
from trainwire.contract import check_task, fork_differences
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import episode_pb2
from trainwire_ops.checkpoints import CheckpointStore, canonical_tar, canonical_tar_digest

__all__ = ["grpo_data_root"]  # the session fixture, re-exported for pytest

LoraConfig = episode_pb2.LoraConfig


def _grpo(**fields: Any) -> episode_pb2.GrpoTask:
    return episode_pb2.GrpoTask(model_path="models/m", dataset_path="d.jsonl", **fields)


# -- the task's LoRA config ----------------------------------------------------------------------


def test_lora_settings_apply_the_defaults_and_refuse_values_out_of_range() -> None:
    assert LoraSettings.from_task(_grpo()) is None  # unset: full fine-tuning
    default = LoraSettings.from_task(_grpo(lora=LoraConfig()))
    assert default == LoraSettings(rank=16, alpha=32.0, dropout=0.0, target_modules=())
    mine = LoraSettings.from_task(
        _grpo(lora=LoraConfig(rank=4, alpha=3, dropout=0.1, target_modules=["q_proj"]))
    )
    assert mine == LoraSettings(rank=4, alpha=3.0, dropout=0.1, target_modules=("q_proj",))
    assert LoraSettings.from_task(_grpo(lora=LoraConfig(rank=8))).alpha == 16.0  # type: ignore[union-attr]
    with pytest.raises(ProviderError) as info:
        LoraSettings.from_task(_grpo(lora=LoraConfig(rank=257, dropout=1.0)))
    assert info.value.code == "INVALID_ARGUMENT"
    assert "task.grpo.lora.rank 257" in str(info.value)
    assert "task.grpo.lora.dropout 1.0" in str(info.value)

    # LoRA trains at its own default rate; the flag for recomputing activations goes through.
    settings = Settings.from_task(_grpo(lora=LoraConfig(), gradient_checkpointing=True), rows=8)
    assert settings.learning_rate == DEFAULT_LORA_LEARNING_RATE
    assert settings.gradient_checkpointing and settings.lora is not None
    full = Settings.from_task(_grpo(), rows=8)
    assert full.learning_rate == DEFAULT_LEARNING_RATE
    assert not full.gradient_checkpointing and full.lora is None
    assert Settings.from_task(_grpo(lora=LoraConfig(), learning_rate=0.5)).learning_rate == 0.5


def test_a_lora_job_can_take_a_kl_term_at_any_step() -> None:
    # The reference of a LoRA job is its base model, adapters disabled: beta may rise from 0.
    lora = episode_pb2.TrainTask(grpo=_grpo(lora=LoraConfig()))
    full = episode_pb2.TrainTask(grpo=_grpo())
    change = Hyperparameters(beta=0.1)
    assert check_hyperparameters(lora, change) == []
    assert [v.field for v in check_hyperparameters(full, change)] == ["beta"]
    assert has_reference_model(lora) and not has_reference_model(full)
    assert hyperparameters(lora).learning_rate == 1e-2


def test_a_lora_job_weighs_a_kl_term_unless_the_task_sets_beta() -> None:
    # Without one, adapters collapse onto one answer (bench/grpo_learning.py); full fine-tuning
    # keeps TRL's beta 0 and no reference model.
    assert Settings.from_task(_grpo(lora=LoraConfig()), rows=8).beta == DEFAULT_LORA_BETA == 0.04
    assert hyperparameters(episode_pb2.TrainTask(grpo=_grpo(lora=LoraConfig()))).beta == 0.04
    assert Settings.from_task(_grpo(lora=LoraConfig(), beta=0.0), rows=8).beta == 0.0
    assert Settings.from_task(_grpo(lora=LoraConfig(), beta=0.2), rows=8).beta == 0.2
    assert Settings.from_task(_grpo(), rows=8).beta == 0.0


def test_the_request_checks_name_each_bad_lora_field() -> None:
    config = episode_pb2.TrainConfig(max_episodes=3)

    def fields(lora: episode_pb2.LoraConfig) -> list[str]:
        task = episode_pb2.TrainTask(grpo=_grpo(lora=lora))
        return [v.field for v in check_task(task, config)]

    assert fields(LoraConfig()) == []
    assert fields(LoraConfig(rank=256, alpha=0.5, dropout=0.99, target_modules=["a.b_c"])) == []
    bad = LoraConfig(
        rank=257, alpha=-1, dropout=1.0, target_modules=["q_proj", "q_proj", "a b", ""]
    )
    assert fields(bad) == [
        "task.grpo.lora.rank",
        "task.grpo.lora.alpha",
        "task.grpo.lora.dropout",
        "task.grpo.lora.target_modules[1]",
        "task.grpo.lora.target_modules[2]",
        "task.grpo.lora.target_modules[3]",
    ]
    assert fields(LoraConfig(alpha=float("nan"), dropout=-0.1)) == [
        "task.grpo.lora.alpha",
        "task.grpo.lora.dropout",
    ]


def test_a_fork_trains_the_adapters_of_its_checkpoint() -> None:
    def task(**fields: Any) -> episode_pb2.TrainTask:
        return episode_pb2.TrainTask(grpo=_grpo(**fields))

    default = task(lora=LoraConfig())
    # The defaults filled in, and gradient checkpointing (no result changes) may differ.
    same = task(lora=LoraConfig(rank=16, alpha=32), gradient_checkpointing=True)
    assert fork_differences(default, same) == []
    # An empty LoRA config is LoRA: it does not fit a full fine-tuning checkpoint, nor the
    # other way round, nor adapters of another rank.
    (one,) = fork_differences(task(), default)
    assert one.field == "task.grpo.lora" and "the checkpoint's task has unset" in one.description
    (two,) = fork_differences(default, task())
    assert two.description.startswith("unset; the checkpoint's task has LoRA rank 16")
    (three,) = fork_differences(default, task(lora=LoraConfig(rank=8)))
    assert "LoRA rank 8, alpha 16" in three.description


# -- the layers adapters go on -------------------------------------------------------------------


def _qwen2_vl() -> Any:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 64,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "bos_token_id": None,
        "eos_token_id": None,
    }
    vision = {"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "patch_size": 4}
    return Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision))


def _idefics3() -> Any:
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    text = {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 64,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 8,
    }
    config = Idefics3Config(text_config=text, vision_config=vision, scale_factor=2)
    return Idefics3ForConditionalGeneration(config)


def _tiny_llava(root: pathlib.Path) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(root / MODEL_DIR, local_files_only=True)


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl", "idefics3"])
def test_the_default_targets_are_the_language_models_linear_layers(
    arch: str, grpo_data_root: pathlib.Path
) -> None:
    from trainer_service.providers.grpo import lora

    torch.set_num_threads(1)
    model = {
        "llava": lambda: _tiny_llava(grpo_data_root),
        "qwen2_vl": _qwen2_vl,
        "idefics3": _idefics3,
    }[arch]()
    names = lora.language_model_linears(model)
    language = {"llava": "language_model", "qwen2_vl": "language_model", "idefics3": "text_model"}
    prefix = f"model.{language[arch]}."
    everything = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    # Every linear layer under the language model, and nothing else: not the vision tower,
    # the projector or the LM head.
    assert set(names) == {n for n in everything if n.startswith(prefix)}
    assert len(names) == len(set(names)) >= 7
    assert everything - set(names) >= {"lm_head"}
    assert any(n.startswith(("model.vision", "model.visual")) for n in everything - set(names))
    config = lora.lora_config(LoraSettings(4, 8.0, 0.0, ()), model)
    assert set(config.target_modules) == set(names) and config.r == 4  # type: ignore[arg-type]


def test_named_targets_must_be_linear_layers_other_than_the_head(
    grpo_data_root: pathlib.Path,
) -> None:
    from trainer_service.providers.grpo import lora

    torch.set_num_threads(1)
    model = _tiny_llava(grpo_data_root)
    config = lora.lora_config(LoraSettings(2, 4.0, 0.0, ("q_proj", "mlp.up_proj")), model)
    assert sorted(config.target_modules) == ["mlp.up_proj", "q_proj"]  # type: ignore[arg-type]

    def refused(*targets: str) -> str:
        with pytest.raises(ProviderError) as info:
            lora.lora_config(LoraSettings(2, 4.0, 0.0, targets), model)
        assert info.value.code == "INVALID_ARGUMENT"
        assert info.value.user_message.startswith("task.grpo.lora.target_modules: ")
        return info.value.user_message

    message = refused("qproj", "q_proj")
    assert "'qproj' matches no module" in message and "q_proj" in message.split("named")[1]
    assert "'self_attn' matches CLIPAttention, LlamaAttention, not only" in refused("self_attn")
    assert "the LM head" in refused("lm_head")


# -- the trainer's check of a LoRA checkpoint ----------------------------------------------------


def _lora_checkpoint(
    directory: pathlib.Path, model: pathlib.Path, lora: bool
) -> RestoredCheckpoint:
    (directory / "model").mkdir(parents=True)
    (directory / "trainer").mkdir()
    names = checkpoint_files.ADAPTER_FILES if lora else ("config.json", "model.safetensors")
    for name in names:
        (directory / "model" / name).write_text("{}")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (directory / "trainer" / name).write_bytes(b"x")
    (directory / "trainer" / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    record = checkpoint_files.record(
        step=4,
        best_reward=1.0,
        last_reward=0.5,
        world_size=1,
        seed=1,
        epoch=0,
        batches_done=4,
        model_fingerprint=checkpoint_files.model_fingerprint(model),
        lora=lora,
    )
    (directory / "trainwire.json").write_text(json.dumps(record))
    return RestoredCheckpoint(directory, 4, 1.0)


def test_check_resume_knows_a_lora_checkpoint_from_a_whole_model(tmp_path: pathlib.Path) -> None:
    model = tmp_path / "base"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llava"}))
    adapter = _lora_checkpoint(tmp_path / "adapter", model, lora=True)
    whole = _lora_checkpoint(tmp_path / "whole", model, lora=False)
    assert checkpoint_files.check_resume(adapter, model, 1, lora=True)["lora"] is True
    assert checkpoint_files.check_resume(whole, model, 1, lora=False)["lora"] is False

    def refused(resume: RestoredCheckpoint, lora: bool) -> str:
        with pytest.raises(CheckpointUnusable) as info:
            checkpoint_files.check_resume(resume, model, 1, lora=lora)
        return str(info.value)

    assert (
        refused(adapter, lora=False) == "it holds a LoRA adapter, and this job trains every weight"
    )
    assert refused(whole, lora=True) == "it holds a whole model, and this job trains LoRA adapters"
    (adapter.directory / "model" / "adapter_model.safetensors").unlink()
    assert "model/adapter_model.safetensors" in refused(adapter, lora=True)


# -- a LoRA job, built as a rank builds it ---------------------------------------------------------


def _build(root: pathlib.Path, tmp: pathlib.Path, name: str, **job: Any) -> Any:
    from trainer_service.providers.grpo.build import build_trainer

    task = tiny_grpo_task(
        workers=0,
        max_completion_length=4,
        reward_functions=("exact_match", "length"),
        lora=LoraConfig(rank=4),
        gradient_checkpointing=True,
        beta=0.5,
    )
    return build_trainer(make_job(root, task, **job), output_dir=str(tmp / name))


def test_a_lora_job_trains_against_its_base_and_resumes_every_adapter_tensor(
    grpo_data_root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    from trl.trainer.utils import use_adapter

    from trainer_service.providers.grpo import lora

    torch.set_num_threads(1)
    trainer = _build(grpo_data_root, tmp_path, "first", max_episodes=2)
    model = trainer.model
    assert lora.is_lora(model) and list(model.peft_config) == ["default"]
    # The reference (beta > 0) is the base model with the adapters disabled: no copy of the
    # adapter ("ref") and no reference model of its own.
    assert trainer.ref_model is None
    trainable, total = lora.trainable_parameters(model)
    assert 0 < trainable < total // 4
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    trainer.train()
    # Gradient checkpointing reached the model, and the adapters learned through it.
    assert trainer.args.activation_checkpointing and model.is_activation_checkpointing
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    base = _tiny_llava(grpo_data_root).eval()
    ids = torch.tensor([[1, 5, 9, 12, 3]])
    with torch.no_grad(), use_adapter(model, adapter_name=None):
        reference = model.get_base_model().model(input_ids=ids).last_hidden_state
    with torch.no_grad():
        adapted = model.get_base_model().model(input_ids=ids).last_hidden_state
        pristine = base.model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(reference, pristine)
    assert not torch.allclose(adapted, pristine)

    # The checkpoint: the adapter in PEFT's format, the record of its base, the adapter's
    # optimizer state.
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    trainer.save_checkpoint(directory, 1.0, 0.5)
    names = {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}
    assert {
        "model/adapter_config.json",
        "model/adapter_model.safetensors",
        "model/base_model.json",
        "model/processor_config.json",
        "trainer/optimizer.pt",
        "trainwire.json",
    } <= names
    assert "model/model.safetensors" not in names
    base_record = json.loads((directory / "model" / "base_model.json").read_text())
    fingerprint = checkpoint_files.model_fingerprint(grpo_data_root / MODEL_DIR)
    assert base_record == {"model_path": MODEL_DIR, "model_fingerprint": fingerprint}
    adapter_config = json.loads((directory / "model" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == MODEL_DIR
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (4, 8)
    optimizer = torch.load(directory / "trainer" / "optimizer.pt", weights_only=False)
    assert len(optimizer["state"]) == sum(1 for p in model.parameters() if p.requires_grad)
    record = json.loads((directory / "trainwire.json").read_text())
    assert record["lora"] is True and record["step"] == 2

    # Resumed: the base from the task's model, every adapter tensor from the checkpoint.
    restored = RestoredCheckpoint(directory, 2, 1.0)
    resumed = _build(grpo_data_root, tmp_path, "second", max_episodes=4, resume=restored)
    mine = dict(resumed.model.named_parameters())
    for name, parameter in model.named_parameters():
        assert torch.equal(mine[name], parameter), name
    resumed.train(resume_from_checkpoint=str(directory / "trainer"))
    assert resumed.state.global_step == 4

    # An adapter that does not fit is refused, never half loaded.
    weights = directory / "model" / "adapter_model.safetensors"
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights))
    dropped = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, str(weights))
    with pytest.raises(CheckpointUnusable, match="does not fit the model: missing"):
        _build(grpo_data_root, tmp_path, "third", max_episodes=4, resume=restored)
    weights.write_bytes(b"not safetensors")
    with pytest.raises(CheckpointUnusable, match="its adapter does not load"):
        _build(grpo_data_root, tmp_path, "fourth", max_episodes=4, resume=restored)
    adapter_config["r"] = 8
    (directory / "model" / "adapter_config.json").write_text(json.dumps(adapter_config))
    with pytest.raises(CheckpointUnusable, match="not the task's: r 8, the task's 4"):
        _build(grpo_data_root, tmp_path, "fifth", max_episodes=4, resume=restored)


# -- the trainer's merges ------------------------------------------------------------------------


@dataclass
class ScriptedMerger:
    """A provider whose ``merge_checkpoint`` writes a file of what it was given."""

    calls: list[pathlib.Path] = field(default_factory=list)
    refuse: ProviderError | None = None

    def merge_checkpoint(
        self,
        checkpoint_dir: pathlib.Path,
        out_dir: pathlib.Path,
        data_roots: Sequence[pathlib.Path],
        stop: threading.Event,
    ) -> None:
        self.calls.append(checkpoint_dir)
        if self.refuse is not None:
            raise self.refuse
        (out_dir / "model").mkdir()
        text = (checkpoint_dir / "adapter.txt").read_text()
        (out_dir / "model" / "merged.txt").write_text(f"merged {text} onto {data_roots[0]}")


class Providers:
    def __init__(self, **providers: object) -> None:
        self._providers = providers

    def get(self, name: str) -> object | None:
        return self._providers.get(name)

    def unavailable_reason(self, name: str) -> str:
        return "" if name in self._providers else "not registered"

    def available(self) -> list[str]:
        return list(self._providers)


def test_the_trainer_merges_a_stored_checkpoint_through_its_provider(
    tmp_path: pathlib.Path,
) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    source = tmp_path / "source"
    source.mkdir()
    (source / "adapter.txt").write_text("adapter 5")
    info = store.put("run-1", 5, source, {"kind": "grpo", "best_reward": 0.5})
    store.put("run-1", 6, source, {"kind": "imitation", "best_reward": 0.5})
    provider = ScriptedMerger()
    roots = (tmp_path / "data",)
    merges = CheckpointMerges(Providers(grpo=provider), store, roots, tmp_path / "scratch")
    stop = threading.Event()

    merged = merges.merge("run-1", 5, info.sha256, stop)
    assert (merged.directory / "model" / "merged.txt").read_text() == (
        f"merged adapter 5 onto {roots[0]}"
    )
    data = b"".join(merged.chunks())
    assert (merged.info.sha256, merged.info.size_bytes) == canonical_tar_digest(merged.directory)
    assert hashlib.sha256(data).hexdigest() == merged.info.sha256
    assert (merged.info.episode, merged.info.create_time_ns) == (5, info.create_time_ns)
    # One merge at a time: the next waits until this one's stream is done.
    waiting = threading.Thread(target=lambda: merges.merge("run-1", 5, "", stop).close())
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive() and len(provider.calls) == 1
    merged.close()
    waiting.join(30)
    assert not waiting.is_alive() and len(provider.calls) == 2
    assert not merged.directory.exists()
    assert list((tmp_path / "scratch").iterdir()) == []

    def refused(error: type[Exception], *args: Any, into: Any = merges) -> str:
        with pytest.raises(error) as info:
            into.merge(*args, stop)
        return str(info.value)

    assert "no checkpoint at episode 7" in refused(
        trainer_errors.CheckpointNotFound, "run-1", 7, ""
    )
    assert "digest mismatch" in refused(trainer_errors.CheckpointCorrupt, "run-1", 5, "0" * 64)
    assert "cannot merge a checkpoint of a imitation run" in refused(ProviderError, "run-1", 6, "")
    assert "checkpoint.episode" in refused(trainer_errors.InvalidRequest, "run-1", 0, "")
    storeless = CheckpointMerges(Providers(grpo=provider), None, roots)
    assert "no checkpoint store" in refused(
        trainer_errors.CheckpointStoreUnavailable, "run-1", 5, "", into=storeless
    )
    provider.refuse = ProviderError("not LoRA", code="FAILED_PRECONDITION")
    assert refused(ProviderError, "run-1", 5, "") == "not LoRA"
    # A caller that is gone stops a merge that waits for its turn.
    provider.refuse = None
    held = merges.merge("run-1", 5, "", stop)
    gone = threading.Event()
    gone.set()
    with pytest.raises(ProviderError, match="cancelled") as cancelled:
        merges.merge("run-1", 5, "", gone)
    assert cancelled.value.code == "CANCELLED"
    held.close()
    assert list((tmp_path / "scratch").iterdir()) == []


def test_merge_checkpoint_refuses_what_it_cannot_merge(tmp_path: pathlib.Path) -> None:
    roots = (tmp_path / "data",)
    base = roots[0] / "models" / "base"
    base.mkdir(parents=True)
    (base / "config.json").write_text(json.dumps({"model_type": "llava"}))

    def checkpoint(name: str, lora: bool, model_path: str = "models/base") -> pathlib.Path:
        restored = _lora_checkpoint(tmp_path / name, base, lora=lora)
        record = {
            "model_path": model_path,
            "model_fingerprint": checkpoint_files.model_fingerprint(base),
        }
        (restored.directory / "model" / "base_model.json").write_text(json.dumps(record))
        return restored.directory

    def refused(directory: pathlib.Path) -> ProviderError:
        with pytest.raises(ProviderError) as info:
            merge.merge_checkpoint(directory, tmp_path / "out", roots, threading.Event())
        return info.value

    whole = refused(checkpoint("whole", lora=False))
    assert (whole.code, whole.reason) == ("FAILED_PRECONDITION", "BAD_TASK")
    assert "holds a whole model, not a LoRA adapter" in whole.user_message
    gone = refused(checkpoint("gone", lora=True, model_path="models/elsewhere"))
    assert (gone.code, gone.reason) == ("FAILED_PRECONDITION", "MODEL_NOT_FOUND")
    assert "'models/elsewhere' of this LoRA checkpoint is not on this trainer" in str(gone)
    adapter = checkpoint("changed", lora=True)
    (base / "config.json").write_text(json.dumps({"model_type": "llava", "hidden": 8}))
    assert "not the model this LoRA checkpoint was trained on" in str(refused(adapter))
    assert not (tmp_path / "out").exists()  # refused before any process started


# -- the gateway's merged downloads --------------------------------------------------------------


class Records:
    """The store's side of ``CheckpointReads``: one run's records."""

    def __init__(self, records: list[CheckpointRecord]) -> None:
        self.records = records

    async def list_checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        return list(self.records)


@dataclass
class ScriptedTrainers:
    """``CheckpointMerger`` over scripted trainers: each address fails as told, or sends
    ``payload`` (announced with ``announced`` as its digest)."""

    failures: dict[str, Exception]
    payload: list[bytes]
    announced: str = ""
    asked: list[str] = field(default_factory=list)
    cancelled: int = 0

    async def merge_checkpoint(
        self, address: str, run_id: str, checkpoint: CheckpointSaved, timeout: float
    ) -> MergedCheckpoint:
        self.asked.append(address)
        if address in self.failures:
            raise self.failures[address]
        data = b"".join(self.payload)
        digest = self.announced or hashlib.sha256(data).hexdigest()
        record = CheckpointSaved(checkpoint.episode, 77, len(data), digest)

        async def chunks() -> AsyncIterator[bytes]:
            for chunk in self.payload:
                await asyncio.sleep(0)
                yield chunk

        def cancel() -> None:
            self.cancelled += 1

        return MergedCheckpoint(record, chunks(), cancel)


def _run(lora: bool, trainer: str = "t2") -> TrainingRun:
    grpo = _grpo(lora=LoraConfig()) if lora else _grpo()
    return TrainingRun(
        id="run-9",
        task=episode_pb2.TrainTask(grpo=grpo),
        config=episode_pb2.TrainConfig(max_episodes=4),
        trainer=trainer,
        trainers=(trainer,),
    )


def _reads(
    run: TrainingRun, trainers: ScriptedTrainers | None, order: Callable[[], Sequence[str]]
) -> CheckpointReads:
    records = [CheckpointRecord("run-9", n, 10 * n, 100, "ab" * 32) for n in (2, 4)]

    async def get_run(run_id: str) -> TrainingRun:
        return run

    return CheckpointReads(Records(records), get_run, None, trainers, order)  # type: ignore[arg-type]


async def _read(chunks: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in chunks])


async def test_a_merged_download_asks_the_runs_trainer_first_then_the_others() -> None:
    refusal = TrainerMergeFailed(
        "t2: no base", "FAILED_PRECONDITION", "The base model is not here."
    )
    trainers = ScriptedTrainers(
        {"t2": refusal, "t1": TrainerLost("t1 gone")}, [b"merged ", b"model"]
    )
    reads = _reads(_run(lora=True), trainers, lambda: ("t1", "t2", "t3"))
    record, chunks = await reads.open("run-9", 0, merged=True)
    assert trainers.asked == ["t2", "t1", "t3"]  # its own, then in configured order
    assert (record.episode, record.create_time, record.size_bytes) == (4, 77, 12)
    assert record.sha256 == hashlib.sha256(b"merged model").hexdigest()
    assert await _read(chunks) == b"merged model"
    assert trainers.cancelled == 1  # the trainer's call is ended with the relay

    # No trainer that can merge: FAILED_PRECONDITION with the trainer's reason when one
    # refused, UNAVAILABLE when none answered.
    trainers = ScriptedTrainers({"t2": refusal, "t1": TrainerLost("gone")}, [])
    with pytest.raises(IllegalTransition, match="merged: The base model is not here"):
        await _reads(_run(lora=True), trainers, lambda: ("t1",)).open("run-9", 2, merged=True)
    trainers = ScriptedTrainers({"t2": TrainerLost("gone")}, [])
    with pytest.raises(TrainerUnavailable, match="no trainer that can merge"):
        await _reads(_run(lora=True), trainers, tuple).open("run-9", 2, merged=True)
    with pytest.raises(TrainerUnavailable, match="no trainer that can merge"):
        await _reads(_run(lora=True), None, lambda: ("t1",)).open("run-9", 2, merged=True)
    # The store's answers are the download's, from whichever trainer.
    missing = TrainerMergeFailed("gone", "NOT_FOUND", "no such checkpoint")
    with pytest.raises(CheckpointNotFound, match="gone from the checkpoint store"):
        await _reads(_run(lora=True), ScriptedTrainers({"t2": missing}, []), tuple).open(
            "run-9", 2, merged=True
        )
    with pytest.raises(CheckpointNotFound, match="no checkpoint at episode 3; it has 2, 4"):
        await _reads(_run(lora=True), trainers, tuple).open("run-9", 3, merged=True)


async def test_a_merged_download_is_refused_for_full_fine_tuning_and_checked_on_the_way() -> None:
    trainers = ScriptedTrainers({}, [b"x" * 10])
    with pytest.raises(IllegalTransition, match="run 'run-9': merged: the run trains every"):
        await _reads(_run(lora=False), trainers, lambda: ("t2",)).open("run-9", 0, merged=True)
    assert trainers.asked == []
    # A merged tar that does not match what its trainer announced is never delivered whole.
    damaged = ScriptedTrainers({}, [b"a" * 4, b"b" * 4], announced="0" * 64)
    _, chunks = await _reads(_run(lora=True), damaged, tuple).open("run-9", 0, merged=True)
    got = []
    with pytest.raises(CheckpointCorrupt, match="arrived damaged"):
        async for chunk in chunks:
            got.append(chunk)
    assert got == [b"a" * 4] and damaged.cancelled == 1


# -- the HTTP and CLI flags ----------------------------------------------------------------------


def test_the_http_merged_flag_and_the_cli_flag() -> None:
    from aiohttp.test_utils import make_mocked_request

    from gateway.http.api import query_flag
    from trainwire.cli._parser import build_parser

    def flag(query: str) -> bool:
        return query_flag(make_mocked_request("GET", f"/x:download{query}"), "merged")

    assert (flag(""), flag("?merged=true"), flag("?merged=1"), flag("?access_token=t")) == (
        False,
        True,
        True,
        False,
    )
    assert flag("?merged=false") is False
    for bad in ("?merged=yes", "?merged=true&merged=true"):
        with pytest.raises(Exception, match="merged") as info:
            flag(bad)
        assert type(info.value).__name__ == "InvalidRequest"
    parser = build_parser()
    args = parser.parse_args(["runs", "download", "r1", "--out", "d", "--merged"])
    assert args.merged is True
    assert parser.parse_args(["runs", "download", "r1", "--out", "d"]).merged is False


def test_canonical_tar_of_a_directory_is_what_the_store_records(tmp_path: pathlib.Path) -> None:
    (tmp_path / "files" / "model").mkdir(parents=True)
    (tmp_path / "files" / "model" / "a.json").write_text("{}")
    (tmp_path / "files" / "b.bin").write_bytes(bytes(range(256)) * 10)
    info = CheckpointStore(str(tmp_path / "store")).put("r", 1, tmp_path / "files")
    assert canonical_tar_digest(tmp_path / "files") == (info.sha256, info.size_bytes)
    assert sum(len(c) for c in canonical_tar(tmp_path / "files", 100)) == info.size_bytes
