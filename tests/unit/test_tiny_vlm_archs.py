"""The tiny VLM of each architecture (LLaVA, Qwen2.5-VL, SmolVLM/Idefics3) and the
``qwen2_5_vl_3b`` preset: what ``make_tiny_vlm`` writes loads back offline as the real classes,
its processor lays images out the way the model expects, and answer words end a completion. The
preset's shapes are checked on the meta device (no weights are made)."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from PIL import Image

from trainer_service.tools import make_tiny_vlm
from trainer_service.tools.tiny_vlm import llava, qwen2_vl, smolvlm
from trainer_service.tools.tiny_vlm import vocabulary as words


@dataclass(frozen=True)
class Arch:
    """What one architecture's tiny model must be, and how one 48x40 image must appear in its
    prompt."""

    name: str
    model_class: str
    processor_class: str
    vocabulary: tuple[str, ...]
    image_tokens: tuple[str, ...]


ARCHS = [
    Arch(
        "llava",
        "LlavaForConditionalGeneration",
        "LlavaProcessor",
        llava.VOCABULARY,
        ("<|image_pad|>",) * 16,  # (32 px / 8 px)^2 patches, the CLS token dropped
    ),
    Arch(
        "qwen2_vl",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLProcessor",
        qwen2_vl.VOCABULARY,
        # 48x40 fits the pixel budget as 48x32: 6x4 patches, merged 2x2 into 6 tokens.
        ("<|vision_start|>", *("<|image_pad|>",) * 6, "<|vision_end|>"),
    ),
    Arch(
        "smolvlm",
        "Idefics3ForConditionalGeneration",
        "Idefics3Processor",
        smolvlm.VOCABULARY,
        # 48x48: 6x6 patches, pixel-shuffled 2x2 into 9 tokens.
        (
            "<fake_token_around_image>",
            "<global-img>",
            *("<image>",) * 9,
            "<fake_token_around_image>",
        ),
    ),
]


def _ids(arch: Arch) -> str:
    return arch.name


def test_make_tiny_vlm_knows_the_three_architectures_and_the_preset() -> None:
    assert list(make_tiny_vlm.ARCHS) == ["llava", "qwen2_vl", "smolvlm"]
    assert list(make_tiny_vlm.PRESETS) == ["qwen2_5_vl_3b"]
    with pytest.raises(ValueError, match=r"unknown architecture 'blip'.*llava, qwen2_vl, smolvlm"):
        make_tiny_vlm.build(pathlib.Path("unused"), arch="blip")
    with pytest.raises(ValueError, match="unknown preset 'qwen_72b'"):
        make_tiny_vlm.build_preset(pathlib.Path("unused"), "qwen_72b")
    with pytest.raises(SystemExit):  # one or the other
        make_tiny_vlm.main(["out", "--arch", "qwen2_vl", "--preset", "qwen2_5_vl_3b"])


def test_the_command_line_builds_the_architecture_or_preset_it_names(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    built: list[tuple[str, pathlib.Path, int]] = []

    def builder(name: str) -> Callable[[pathlib.Path, int], pathlib.Path]:
        def build(directory: pathlib.Path, seed: int) -> pathlib.Path:
            built.append((name, directory, seed))
            return directory

        return build

    for name in make_tiny_vlm.ARCHS:
        monkeypatch.setitem(make_tiny_vlm.ARCHS, name, builder(name))
    monkeypatch.setitem(make_tiny_vlm.PRESETS, "qwen2_5_vl_3b", builder("preset"))
    assert make_tiny_vlm.main([str(tmp_path / "a")]) == 0
    assert make_tiny_vlm.main([str(tmp_path / "b"), "--arch", "smolvlm", "--seed", "4"]) == 0
    assert make_tiny_vlm.main([str(tmp_path / "c"), "--preset", "qwen2_5_vl_3b"]) == 0
    assert built == [
        ("llava", tmp_path / "a", 0),
        ("smolvlm", tmp_path / "b", 4),
        ("preset", tmp_path / "c", 0),
    ]
    assert capsys.readouterr().out.split() == [str(tmp_path / n) for n in "abc"]


def test_a_lecun_head_redraws_only_the_llava_head(tmp_path: pathlib.Path) -> None:
    import torch
    from safetensors.torch import load_file

    plain = load_file(make_tiny_vlm.build(tmp_path / "plain") / "model.safetensors")
    loud = make_tiny_vlm.build(tmp_path / "loud", head_std=make_tiny_vlm.LORA_HEAD_STD)
    tensors = load_file(loud / "model.safetensors")
    assert tensors.keys() == plain.keys()
    (head,) = [k for k in plain if k.endswith("lm_head.weight")]
    assert [k for k in plain if not torch.equal(plain[k], tensors[k])] == [head]
    assert 0.1 < float(tensors[head].std()) < 0.15 and float(plain[head].std()) < 0.03
    with pytest.raises(ValueError, match="only for llava"):
        make_tiny_vlm.build(tmp_path / "q", arch="qwen2_vl", head_std=0.1)
    with pytest.raises(SystemExit):
        make_tiny_vlm.main([str(tmp_path / "s"), "--arch", "smolvlm", "--head-std", "0.1"])


@pytest.mark.parametrize("arch", ARCHS, ids=_ids)
def test_each_tokenizer_keeps_its_special_tokens_whole_and_answers_one_token(arch: Arch) -> None:
    tokenizer = {"llava": llava, "qwen2_vl": qwen2_vl, "smolvlm": smolvlm}[
        arch.name
    ].build_tokenizer()
    assert len(set(arch.vocabulary)) == len(arch.vocabulary) == len(tokenizer)
    assert tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) == list(arch.vocabulary)
    specials = [t for t in arch.vocabulary if t.startswith("<") and len(t) > 1]
    text = "".join(specials) + "What COLOUR is it? Zorbly!"
    pieces = tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert pieces == [*specials, "what", "colour", "is", "it", "?", "<unk>", "!"]
    for word in words.ANSWER_WORDS:
        assert len(tokenizer(word, add_special_tokens=False)["input_ids"]) == 1, word


@pytest.mark.parametrize("arch", ARCHS, ids=_ids)
def test_each_arch_loads_back_offline_lays_out_two_images_and_stops_at_answer_words(
    arch: Arch, tmp_path: pathlib.Path
) -> None:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig

    torch.set_num_threads(1)
    directory = make_tiny_vlm.build(tmp_path / "vlm", seed=3, arch=arch.name)
    again = make_tiny_vlm.build(tmp_path / "again", seed=3, arch=arch.name)
    weights = (directory / "model.safetensors").read_bytes()
    assert weights == (again / "model.safetensors").read_bytes()
    processor = AutoProcessor.from_pretrained(directory, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(directory, local_files_only=True)
    assert (type(model).__name__, type(processor).__name__) == (
        arch.model_class,
        arch.processor_class,
    )
    assert model.config.get_text_config().vocab_size == len(arch.vocabulary)

    # Two images in one user turn, as TRL passes a row's "images" (image parts with the image).
    red, blue = Image.new("RGB", (48, 40), "red"), Image.new("RGB", (48, 40), "blue")
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": red},
                {"type": "image", "image": blue},
                {"type": "text", "text": "What colour?"},
            ],
        }
    ]
    inputs = processor.apply_chat_template(
        messages,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    tokens = processor.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0].tolist())
    first = tokens.index(arch.image_tokens[0])
    layout = arch.image_tokens * 2
    assert tuple(tokens[first : first + len(layout)]) == layout, tokens
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, len(tokens), len(arch.vocabulary))
    assert torch.isfinite(logits).all()

    stops = GenerationConfig.from_pretrained(directory, local_files_only=True).eos_token_id
    tokenizer = processor.tokenizer
    assert set(stops) == {
        tokenizer.eos_token_id,
        *tokenizer.convert_tokens_to_ids(list(words.ANSWER_WORDS)),
    }
    torch.manual_seed(0)
    out = model.generate(**inputs, do_sample=True, max_new_tokens=16)
    completion = out[0, inputs["input_ids"].shape[1] :].tolist()
    # Generation stops at the first answer word (or end of turn), never after it.
    assert all(token not in stops for token in completion[:-1])


def test_the_qwen2_5_vl_3b_preset_has_the_real_shapes() -> None:
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = qwen2_vl.preset_config()
    text, vision = config.text_config, config.vision_config
    assert config.model_type == "qwen2_5_vl" and config.tie_word_embeddings
    assert (
        text.hidden_size,
        text.num_hidden_layers,
        text.num_attention_heads,
        text.num_key_value_heads,
        text.intermediate_size,
        text.vocab_size,
    ) == (2048, 36, 16, 2, 11008, 151936)
    assert text.rope_parameters["mrope_section"] == [16, 24, 24]
    assert text.rope_parameters["rope_theta"] == 1e6
    assert (
        vision.depth,
        vision.hidden_size,
        vision.intermediate_size,
        vision.num_heads,
        vision.out_hidden_size,
        vision.patch_size,
        vision.spatial_merge_size,
        vision.window_size,
        list(vision.fullatt_block_indexes),
    ) == (32, 1280, 3420, 16, 2048, 14, 2, 112, [7, 15, 23, 31])
    # The tokenizer is the tiny one: its ids, far below the embedding's size.
    assert config.image_token_id == qwen2_vl.VOCABULARY.index("<|image_pad|>")

    with torch.device("meta"):  # shapes only: no memory for 3.75 billion weights
        model = Qwen2_5_VLForConditionalGeneration(config)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert model.num_parameters() == 3_754_622_976  # Qwen2.5-VL-3B-Instruct's count
    layer = model.model.language_model.layers[0].self_attn
    assert (layer.q_proj.out_features, layer.k_proj.out_features) == (2048, 256)
    assert model.model.visual.blocks[0].attn.qkv.out_features == 3 * 1280
    assert model.model.visual.merger.mlp[2].out_features == 2048

    processor = qwen2_vl.preset_processor()
    pixels = processor.image_processor(images=[Image.new("RGB", (448, 448))], return_tensors="pt")
    assert pixels["image_grid_thw"].tolist() == [[1, 32, 32]]  # 448 / 14; 256 tokens merged
    assert pixels["pixel_values"].shape == (1024, 3 * 2 * 14 * 14)
