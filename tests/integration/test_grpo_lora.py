"""LoRA through the services: a real trainer process, the gateway in-process, a shared checkpoint
directory.

A LoRA run trains in the trainer's rank process and checkpoints its adapter. Its download is
the adapter in PEFT's format with the record of its base model: a fresh process that imports
transformers and peft only (no trainwire) loads the base model the record names and the adapter
onto it with ``PeftModel.from_pretrained``. The merged download (the CLI's ``--merged``, and
``?merged=true`` over HTTP) is made by the trainer in a process of its own: a fresh process that
can import neither peft nor trainwire loads it with ``AutoModelForImageTextToText`` and gives
the logits base + adapter gave. A fork of the run from its first checkpoint (the same path a run
restarted after its trainer died takes: a job resumed from a checkpoint) trains the steps after
it exactly as the run did. The seams (defaults, target layers, the strict adapter load, the
gateway's choice of trainer, refusals): ``tests/unit/test_grpo_lora.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import aiohttp
import pytest

from tests.fakes.gateway_harness import collect, running_gateway, trainer_process
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT
from tests.grpo_fixtures import DATASET_FILE, MODEL_DIR, grpo_data_root, tiny_grpo_task
from trainwire import aio
from trainwire.cli import main as cli_main
from trainwire.v1 import episode_pb2, gateway_service_pb2

pb = gateway_service_pb2
State = pb.Run.State
STEPS = 4
EVERY = 2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

__all__ = ["grpo_data_root"]  # the session fixture, re-exported for pytest

# Runs in a fresh interpreter (-I): the editable installs' import hooks removed and the named
# top-level packages made absent (None in sys.modules: importing one fails, and transformers'
# probes find none), then the logits of the first dataset row's last position, from the model
# in argv[2] (peft: base argv[1] + adapter argv[2]; else transformers alone).
_LOGITS = r"""
import json, sys
refused = set(sys.argv[4].split(","))
sys.modules.update(dict.fromkeys(refused))
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()]
from pathlib import Path
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
torch.set_num_threads(1)
base, model_dir, dataset = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
if "peft" in refused:
    model = AutoModelForImageTextToText.from_pretrained(model_dir, local_files_only=True)
else:
    from peft import PeftModel
    loaded = AutoModelForImageTextToText.from_pretrained(base, local_files_only=True)
    model = PeftModel.from_pretrained(loaded, model_dir)
model.eval()
processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
row = json.loads(dataset.read_text().splitlines()[0])
prompt = processor.apply_chat_template(row["prompt"], add_generation_prompt=True)
images = [Image.open(dataset.parent / p).convert("RGB") for p in row["image_paths"]]
inputs = processor(images=images, text=[prompt], return_tensors="pt")
with torch.no_grad():
    logits = model(**inputs).logits[0, -1]
    without = None
    if "peft" not in refused:
        with model.disable_adapter():
            without = model(**inputs).logits[0, -1].tolist()
print(json.dumps({
    "model": type(model).__name__,
    "logits": logits.tolist(),
    "without_adapter": without,
    "peft_loaded": sys.modules.get("peft") is not None,
}))
"""


async def _logits(model_dir: Path, base: Path, data_root: Path, refused: str) -> dict[str, object]:
    result = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-I",
            "-c",
            _LOGITS,
            str(base),
            str(model_dir),
            str(data_root / DATASET_FILE),
            refused,
        ],
        cwd=model_dir.parent,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT,
        env={"PATH": os.environ.get("PATH", ""), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return found


def _request(**fields: object) -> pb.CreateRunRequest:
    task = tiny_grpo_task(
        workers=0,
        max_completion_length=4,
        reward_functions=("exact_match", "length"),
        lora=episode_pb2.LoraConfig(rank=4),
    )
    return pb.CreateRunRequest(
        task=task,
        config=episode_pb2.TrainConfig(max_episodes=STEPS, seed=3, checkpoint_every=EVERY),
        episodes_per_second=-1.0,
        **fields,  # type: ignore[arg-type]
    )


def _close(mine: list[float], theirs: list[float]) -> bool:
    return len(mine) == len(theirs) and all(
        abs(a - b) <= 1e-4 for a, b in zip(mine, theirs, strict=True)
    )


async def test_a_lora_run_downloads_its_adapter_and_its_merged_model(
    grpo_data_root: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    flags = ("--data-root", str(grpo_data_root), "--checkpoint-store", str(store))
    with trainer_process(tmp_path / "trainer.log", *flags, "--heartbeat", "0.5", slots=1) as (
        _,
        address,
    ):
        async with running_gateway(
            (address,), checkpoint_store=str(store), http_port=0, heartbeat_timeout_s=30.0
        ) as client:
            run = (await client.stub.CreateRun(_request(), timeout=TIMEOUT)).run
            watched = await collect(client.stub, run.id, timeout=JOB_TIMEOUT)
            done = watched.finished
            assert done is not None and done.state == State.STATE_DONE, done
            assert [e.episode for e in watched.episodes] == list(range(1, STEPS + 1))
            listed = await client.stub.ListCheckpoints(
                pb.ListCheckpointsRequest(run_id=run.id), timeout=TIMEOUT
            )
            assert [c.episode for c in listed.checkpoints] == [EVERY, STEPS]

            # The download: the adapter in PEFT's format and the record of its base model.
            adapter = tmp_path / "adapter"
            async with aio.GatewayClient(client.address) as gateway:
                record = await gateway.download_checkpoint(run.id, adapter)
            assert record == listed.checkpoints[-1]
            files = {p.name for p in (adapter / "model").iterdir()}
            assert {"adapter_config.json", "adapter_model.safetensors", "base_model.json"} <= files
            assert "model.safetensors" not in files
            base_record = json.loads((adapter / "model" / "base_model.json").read_text())
            assert base_record["model_path"] == MODEL_DIR
            assert json.loads((adapter / "trainwire.json").read_text())["lora"] is True

            # Merged, through the CLI (gRPC): the trainer merges, the gateway relays.
            merged = tmp_path / "merged"
            fetch = ["runs", "download", run.id, "--merged", "--out", str(merged)]
            command = ["--gateway", client.address, "--timeout", str(JOB_TIMEOUT), *fetch]
            assert await asyncio.to_thread(cli_main, command) == 0
            files = {p.name for p in (merged / "model").iterdir()}
            assert {"config.json", "model.safetensors", "processor_config.json"} <= files
            assert not files & {"adapter_config.json", "adapter_model.safetensors"}

            # ...and over HTTP, the older checkpoint: the tar the page would link to.
            assert client.gateway.http is not None
            url = f"{client.gateway.http.url}/v1/runs/{run.id}/checkpoints/{EVERY}:download"
            timeout = aiohttp.ClientTimeout(total=JOB_TIMEOUT)
            async with (
                aiohttp.ClientSession(timeout=timeout) as http,
                http.get(url, params={"merged": "true"}) as reply,
            ):
                assert reply.status == 200, await reply.text()
                data = await reply.read()
                headers = reply.headers
            assert headers["X-Checkpoint-Sha256"] == hashlib.sha256(data).hexdigest()
            assert "-merged.tar" in headers["Content-Disposition"]
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                names = set(tar.getnames())
            assert {"model/model.safetensors", "model/config.json", "trainwire.json"} <= names

            # A fork from the first checkpoint trains the later steps as the run did.
            source = pb.ForkSource(run_id=run.id, episode=EVERY)
            fork = (await client.stub.CreateRun(_request(fork_from=source), timeout=TIMEOUT)).run
            forked = await collect(client.stub, fork.id, timeout=JOB_TIMEOUT)
            assert forked.finished is not None and forked.finished.state == State.STATE_DONE
            assert [e.episode for e in forked.episodes] == list(range(EVERY + 1, STEPS + 1))
            for mine, theirs in zip(forked.episodes, watched.episodes[EVERY:], strict=True):
                assert mine.reward == theirs.reward, mine.episode
                assert list(mine.grpo.sample_completions) == list(theirs.grpo.sample_completions)

    # Fresh processes: peft loads the adapter onto the base model its record names; the merged
    # model loads with transformers alone and gives the same logits.
    base = grpo_data_root / base_record["model_path"]
    with_peft = await _logits(adapter / "model", base, grpo_data_root, "trainwire,trainer_service")
    alone = await _logits(merged / "model", base, grpo_data_root, "peft,trainwire,trainer_service")
    assert with_peft["peft_loaded"] and not alone["peft_loaded"]
    assert alone["model"] == "LlavaForConditionalGeneration"
    assert _close(alone["logits"], with_peft["logits"])  # type: ignore[arg-type]
    assert not _close(with_peft["logits"], with_peft["without_adapter"])  # type: ignore[arg-type]
