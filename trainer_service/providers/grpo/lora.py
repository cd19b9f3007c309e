"""LoRA adapters (``peft``) for a GRPO job: their config, the layers they adapt, and the adapter's
files in a checkpoint.

A LoRA job (``GrpoTask.lora`` set) trains low-rank adapters beside frozen base weights. TRL wraps
the model (``GRPOTrainer(peft_config=...)``, so its reference, when beta is above 0, is the base
model with the adapters disabled, never a copy of a resumed adapter). The config
(:func:`lora_config`) comes from :class:`.settings.LoraSettings`: the rank, alpha and dropout,
and the target modules, which default to every ``nn.Linear`` of the language model
(:func:`language_model_linears`: found in the loaded model through ``get_decoder()``, so the
vision tower, the projector and the LM head are left alone on LLaVA, Qwen2-VL and Idefics3 alike).
Named targets must each match at least one linear layer, none of them the LM head (TRL scores
completions from its weight directly, so an adapter there would never train).

A LoRA checkpoint's ``model/`` holds the adapter in PEFT's format (``adapter_config.json``,
``adapter_model.safetensors``: ``PeftModel.from_pretrained(base, model_dir)`` loads it), the
processor, and the base model's path as the task named it and its fingerprint
(:data:`.checkpoint_files.BASE_RECORD`; :func:`save_adapter`). Resuming loads the base from the
task's model and every adapter tensor from the checkpoint (:func:`load_adapter`).
:func:`merge_into_base` is what a merged download runs (in a process of its own, see
:mod:`.merge`).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import set_peft_model_state_dict
from safetensors.torch import load_file

from trainer_service.core.provider import CheckpointUnusable, ProviderError
from trainer_service.providers.grpo.checkpoint_files import ADAPTER_FILES, BASE_RECORD

if TYPE_CHECKING:  # settings imports TRL, which a merge's process has no use for
    from trainer_service.providers.grpo.settings import LoraSettings

#: The adapter files ``PeftModel.save_pretrained`` writes (and ``from_pretrained`` reads).
ADAPTER_CONFIG, ADAPTER_WEIGHTS = ADAPTER_FILES
#: The name peft gives the one adapter a job trains.
ADAPTER_NAME = "default"
_FIELD = "task.grpo.lora.target_modules"


def _bad_targets(message: str) -> ProviderError:
    return ProviderError(
        f"{_FIELD}: {message}", code="INVALID_ARGUMENT", reason="BAD_SETTINGS", detail=_FIELD
    )


def language_model_linears(model: Any) -> list[str]:
    """The qualified names of every ``nn.Linear`` of ``model``'s language model, sorted: the
    module ``get_decoder()`` finds (``language_model``, ``text_model``...), so not the vision
    tower, the projector or the LM head.

    Raises:
        ProviderError: The model names no language model of its own (``get_decoder()`` is the
            whole model), or it has no linear layer: the targets must be named.
    """
    inner = getattr(model, "model", model)
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else None
    if decoder is None or decoder is inner or decoder is model:
        raise _bad_targets(
            f"{type(model).__name__} has no separate language model to find the layers in; "
            "name the modules to adapt"
        )
    found = [name for name, module in model.named_modules() if module is decoder]
    prefix = found[0]
    names = sorted(
        f"{prefix}.{name}"
        for name, module in decoder.named_modules()
        if name and isinstance(module, torch.nn.Linear)
    )
    if not names:
        raise _bad_targets(f"the language model of {type(model).__name__} has no linear layer")
    return names


def _matches(name: str, target: str) -> bool:
    """peft's rule for a list of target names: the module's name, or a dotted suffix of it."""
    return name == target or name.endswith("." + target)


def check_targets(model: Any, targets: Iterable[str]) -> None:
    """Checks targets a task names: each matches at least one module, every module it matches is
    an ``nn.Linear``, and none is the LM head.

    Raises:
        ProviderError: ``INVALID_ARGUMENT`` naming ``task.grpo.lora.target_modules``, every
            bad name, and the model's linear layer names to choose from.
    """
    modules = dict(model.named_modules())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    problems = []
    for target in targets:
        matched = [(name, module) for name, module in modules.items() if _matches(name, target)]
        if not target or not matched:
            problems.append(f"{target!r} matches no module")
        elif any(not isinstance(module, torch.nn.Linear) for _, module in matched):
            kinds = sorted(
                {type(m).__name__ for _, m in matched if not isinstance(m, torch.nn.Linear)}
            )
            problems.append(f"{target!r} matches {', '.join(kinds)}, not only linear layers")
        elif head is not None and any(module is head for _, module in matched):
            problems.append(f"{target!r} matches the LM head, which GRPO cannot adapt")
    if problems:
        leaves = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, m in modules.items()
                if isinstance(m, torch.nn.Linear)
            }
        )
        raise _bad_targets(
            "; ".join(problems) + f" (the model's linear layers are named {', '.join(leaves)})"
        )


def lora_config(settings: LoraSettings, model: Any) -> LoraConfig:
    """The peft config of a job's adapters on ``model`` (targets checked or found).

    Raises:
        ProviderError: Bad target modules (see :func:`check_targets`).
    """
    if settings.target_modules:
        check_targets(model, settings.target_modules)
        targets: list[str] = list(settings.target_modules)
    else:
        targets = language_model_linears(model)
    alpha = settings.alpha
    return LoraConfig(
        r=settings.rank,
        # peft types alpha as an int and divides by the rank; a fractional alpha works as well.
        lora_alpha=int(alpha) if alpha.is_integer() else alpha,  # type: ignore[arg-type]
        lora_dropout=settings.dropout,
        target_modules=targets,
        bias="none",
    )


@contextlib.contextmanager
def quiet_wrapping() -> Iterator[None]:
    """Wrapping a model with adapters, without the deprecation warning peft's wrapper draws from
    transformers (it reads ``is_gradient_checkpointing``); nothing a user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
        )
        yield


def is_lora(model: Any) -> bool:
    """Whether ``model`` (unwrapped from accelerate) carries peft adapters."""
    return isinstance(model, PeftModel)


def trainable_parameters(model: Any) -> tuple[int, int]:
    """(parameters the optimizer trains, all parameters) of ``model``."""
    trainable = total = 0
    for parameter in model.parameters():
        total += parameter.numel()
        if parameter.requires_grad:
            trainable += parameter.numel()
    return trainable, total


def save_adapter(
    model: PeftModel, model_dir: pathlib.Path, base_model_path: str, base_fingerprint: str
) -> None:
    """Writes the adapter in PEFT's format and the base model's record into ``model_dir``.

    ``adapter_config.json`` names the base model by the task's path (relative to the trainer's
    data root), as :data:`BASE_RECORD` does, rather than the trainer's absolute path.
    """
    config = model.peft_config[ADAPTER_NAME]
    config.base_model_name_or_path = base_model_path
    # No embedding layer is a target (targets are linear layers), and "auto" would look the
    # base model's path up on the Hub to find out.
    model.save_pretrained(
        str(model_dir),
        safe_serialization=True,
        selected_adapters=[ADAPTER_NAME],
        save_embedding_layers=False,
    )
    record = {"model_path": base_model_path, "model_fingerprint": base_fingerprint}
    (model_dir / BASE_RECORD).write_text(json.dumps(record, indent=1), encoding="utf-8")


def _adapter_misfits(saved: Mapping[str, Any], live: Any) -> list[str]:
    """How a checkpoint's ``adapter_config.json`` differs from the job's adapter config."""
    out = []
    for key, mine in (
        ("r", live.r),
        ("lora_alpha", live.lora_alpha),
        ("lora_dropout", live.lora_dropout),
    ):
        if saved.get(key) != mine:
            out.append(f"{key} {saved.get(key)!r}, the task's {mine!r}")
    theirs = saved.get("target_modules")
    theirs_set = set(theirs) if isinstance(theirs, list) else theirs
    mine_targets = live.target_modules
    mine_set = mine_targets if isinstance(mine_targets, str) else set(mine_targets or ())
    if theirs_set != mine_set:
        out.append("other target modules")
    return out


def load_adapter(model: Any, model_dir: pathlib.Path) -> None:
    """Loads a checkpoint's adapter into ``model``'s adapter, every tensor of it (peft's own
    loading would leave a missing tensor at its initial value and only warn).

    Raises:
        CheckpointUnusable: The adapter is of another config than the job's, does not load, or
            not every tensor fits.
    """
    try:
        saved = json.loads((model_dir / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise CheckpointUnusable(f"its {ADAPTER_CONFIG} is unreadable ({exc})") from exc
    misfits = _adapter_misfits(saved, model.peft_config[ADAPTER_NAME])
    if misfits:
        raise CheckpointUnusable(f"its adapter is not the task's: {'; '.join(misfits)}")
    try:
        state = load_file(str(model_dir / ADAPTER_WEIGHTS))
        result: Any = set_peft_model_state_dict(model, state, adapter_name=ADAPTER_NAME)
    except Exception as exc:  # safetensors and shape errors alike: the files are bad
        raise CheckpointUnusable(
            f"its adapter does not load ({type(exc).__name__}: {exc})"
        ) from exc
    wanted = {
        name
        for name, parameter in model.named_parameters()
        if parameter.requires_grad or f".{ADAPTER_NAME}." in name
    }
    missing = sorted(wanted & set(result.missing_keys))
    unexpected = sorted(result.unexpected_keys)
    if missing or unexpected or not state:
        raise CheckpointUnusable(
            f"its adapter does not fit the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}"
        )


def merge_into_base(
    base_dir: pathlib.Path, adapter_dir: pathlib.Path, out_dir: pathlib.Path
) -> None:
    """Merges the adapter in ``adapter_dir`` into the base model in ``base_dir`` and saves the
    merged model, in the base model's own dtype, with the adapter's processor, into
    ``out_dir``: ``from_pretrained`` loads it with transformers alone.

    Raises:
        CheckpointUnusable: The adapter does not load strictly into the base.
        OSError, ValueError: The base model or the processor does not load.
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor

    base = AutoModelForImageTextToText.from_pretrained(
        base_dir, local_files_only=True, dtype=torch.float32
    )
    config = LoraConfig.from_pretrained(str(adapter_dir))
    with quiet_wrapping():
        model = get_peft_model(base, config, adapter_name=ADAPTER_NAME)
    load_adapter(model, adapter_dir)
    merged = model.merge_and_unload()
    saved_dtype = json.loads((base_dir / "config.json").read_text(encoding="utf-8"))
    dtype = getattr(torch, str(saved_dtype.get("dtype") or saved_dtype.get("torch_dtype")), None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        merged = merged.to(dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out_dir, safe_serialization=True)
    processor = AutoProcessor.from_pretrained(adapter_dir, local_files_only=True)
    processor.save_pretrained(out_dir)
