"""The offline GRPO tools (tiny VLM, demo dataset) and the defaults shared with the contract."""

from __future__ import annotations

import collections
import json
import pathlib

import pytest
from PIL import Image

from trainer_service.tools import make_demo_dataset, make_tiny_vlm
from trainwire import contract
from trainwire.v1 import episode_pb2


def test_tokenizer_is_word_level_and_every_answer_is_one_token() -> None:
    tokenizer = make_tiny_vlm.build_tokenizer()
    ids = tokenizer("What COLOUR is it? Zorbly!", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["what", "colour", "is", "it", "?", "<unk>", "!"]
    for word in make_tiny_vlm.ANSWER_WORDS:
        assert len(tokenizer(word, add_special_tokens=False)["input_ids"]) == 1, word
    red = tokenizer.convert_tokens_to_ids("red")
    assert tokenizer.decode([red, tokenizer.eos_token_id], skip_special_tokens=True) == "red"
    assert len(set(make_tiny_vlm.VOCABULARY)) == len(make_tiny_vlm.VOCABULARY) == len(tokenizer)


def test_built_model_loads_offline_and_answer_words_end_a_completion(
    tmp_path: pathlib.Path,
) -> None:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig

    directory = make_tiny_vlm.build(tmp_path / "vlm", seed=3)
    again = make_tiny_vlm.build(tmp_path / "again", seed=3)
    assert (directory / "model.safetensors").read_bytes() == (
        again / "model.safetensors"
    ).read_bytes()
    processor = AutoProcessor.from_pretrained(directory, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(directory, local_files_only=True)
    stops = GenerationConfig.from_pretrained(directory, local_files_only=True).eos_token_id
    tokenizer = processor.tokenizer
    assert set(stops) == {
        tokenizer.eos_token_id,
        *tokenizer.convert_tokens_to_ids(list(make_tiny_vlm.ANSWER_WORDS)),
    }
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[Image.new("RGB", (40, 30), "red")], return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**inputs, do_sample=True, max_new_tokens=16)
    completion = out[0, inputs["input_ids"].shape[1] :].tolist()
    # Generation stops at the first answer word (or <|im_end|>), never after it.
    assert all(token not in stops for token in completion[:-1])


def test_demo_dataset_rows_are_balanced_and_images_show_the_answer(
    tmp_path: pathlib.Path,
) -> None:
    path = make_demo_dataset.build(tmp_path / "colours", rows=12, size=(48, 40), seed=2)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    counts = collections.Counter(row["solution"] for row in rows)
    assert counts == {answer: 3 for answer in make_demo_dataset.DEFAULT_ANSWERS["colour"]}
    for row in rows:
        assert row["solution"] == row["colour"] and row["shape"] in make_demo_dataset.SHAPES
        assert row["prompt"][0]["content"][0] == {"type": "image"}
        with Image.open(path.parent / row["image_paths"][0]) as image:
            pixels = list(image.convert("RGB").get_flattened_data())
        # The answer's colour is drawn: at least 5 % of the pixels are exactly that colour.
        share = pixels.count(make_demo_dataset.COLOURS[row["colour"]]) / len(pixels)
        assert share > 0.05, (row["colour"], share)
    shapes = make_demo_dataset.build(
        tmp_path / "shapes", rows=8, kind="shape", question="Name it.", distinct_images=3
    )
    shape_rows = [json.loads(line) for line in shapes.read_text().splitlines()]
    assert {row["solution"] for row in shape_rows} <= set(make_demo_dataset.SHAPES)
    assert all(row["solution"] == row["shape"] for row in shape_rows)
    assert len({row["image_paths"][0] for row in shape_rows}) == 3
    assert shape_rows[0]["prompt"][0]["content"][1]["text"] == "Name it."
    with pytest.raises(ValueError, match="at least two distinct"):
        make_demo_dataset.build(tmp_path / "bad", answers=["red", "mauve"])


def test_gray_ablation_keeps_rows_and_replaces_every_image(tmp_path: pathlib.Path) -> None:
    path = make_demo_dataset.build(tmp_path / "d", rows=4, images_per_row=2)
    gray = make_demo_dataset.write_gray_ablation(path)
    original = [json.loads(line) for line in path.read_text().splitlines()]
    ablated = [json.loads(line) for line in gray.read_text().splitlines()]
    assert [r["solution"] for r in ablated] == [r["solution"] for r in original]
    assert all(r["image_paths"] == [make_demo_dataset.GRAY_IMAGE] * 2 for r in ablated)
    with Image.open(gray.parent / make_demo_dataset.GRAY_IMAGE) as image:
        assert image.size == (48, 40) and image.getextrema() == ((128, 128),) * 3


def test_contract_and_provider_share_the_default_generations() -> None:
    from trainer_service.providers.grpo.settings import DEFAULT_NUM_GENERATIONS, Settings

    assert contract.DEFAULT_GRPO_GENERATIONS == DEFAULT_NUM_GENERATIONS
    task = episode_pb2.TrainTask(
        grpo=episode_pb2.GrpoTask(model_path="m", dataset_path="d.jsonl", batch_size=12)
    )
    violations = contract.check_task(task, episode_pb2.TrainConfig(max_episodes=1))
    assert [v.field for v in violations] == ["task.grpo.batch_size"]
    assert "num_generations 8" in violations[0].description
    settings = Settings.from_task(episode_pb2.GrpoTask())
    assert (settings.num_generations, settings.batch_size) == (8, 128)
    assert (settings.learning_rate, settings.max_completion_length) == (3e-3, 16)
    assert settings.temperature == 1.0
