"""The Qwen2-VL family, built as Qwen2.5-VL: the tiny model, and the ``qwen2_5_vl_3b`` preset with
the real shapes of Qwen2.5-VL-3B-Instruct.

Both are ``Qwen2_5_VLForConditionalGeneration`` with ``Qwen2_5_VLProcessor``: Qwen's image
processor (each image resized to a multiple of patch x merge pixels within a pixel budget, cut
into patches of two frames) and its video processor, which the processor requires. The chat
template is ChatML and renders an image part as ``<|vision_start|><|image_pad|><|vision_end|>``;
the processor expands ``<|image_pad|>`` to one token per merged patch group, and the model finds
images by ``<|vision_start|>`` (its multimodal rotary positions).

Tiny recipe: vision tower of 2 blocks (hidden 64, 2 heads, patch 8, merge 2; block 0 attends
within windows of 32 px, block 1 to the whole image, as the real tower alternates window and
full attention), the patch merger, a text model of 2 layers (hidden 64, 4 heads, multimodal
rotary sections 2/3/3); images resized to between 32x32 and 48x48 pixels, so the demo's 48x40
images become 32x48 pixels and 6 image tokens. Initial scales as for every tiny VLM (LeCun-normal
merger and attention value/output projections, word embeddings with std 0.25).

Preset ``qwen2_5_vl_3b``: Qwen2.5-VL-3B-Instruct's configuration (text: hidden 2048, 36 layers,
16 heads, 2 key/value heads, intermediate 11008, vocabulary 151936, tied embeddings, multimodal
rotary sections 16/24/24, rope theta 1e6; vision: 32 blocks, hidden 1280, intermediate 3420, 16
heads, output 2048, patch 14, merge 2, windows of 112 px with full attention in blocks 7, 15, 23
and 31) and its image processor's pixel budget (56x56 to 12845056 pixels), with random weights
(the library's default initialisation, std 0.02) saved in bfloat16: about 3.75 billion
parameters, 7.5 GB. Its tokenizer is the tiny word-level one, so most of the 151936 embedding rows
have no word: the model may sample those ids, which decode to nothing. It measures memory and
speed at the real size; it learns nothing in a few steps.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

from trainer_service.tools.tiny_vlm import vocabulary as words

_LOGGER = logging.getLogger(__name__)

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
SPECIAL_TOKENS = (
    words.PAD_TOKEN,
    words.START_TOKEN,
    words.END_TOKEN,
    VISION_START,
    VISION_END,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
)
VOCABULARY = words.vocabulary(SPECIAL_TOKENS)
CHAT_TEMPLATE = words.chatml_template(VISION_START + IMAGE_TOKEN + VISION_END)
PATCH_SIZE = 8
MERGE_SIZE = 2
#: The tiny model's pixel budget per image (fewest, most).
MIN_PIXELS, MAX_PIXELS = 32 * 32, 48 * 48

PRESET = "qwen2_5_vl_3b"
#: Qwen2.5-VL-3B-Instruct's text and vision configuration (``config.json``), token ids aside.
PRESET_TEXT: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 128000,
    "max_window_layers": 70,
    "rms_norm_eps": 1e-6,
    "use_sliding_window": False,
    "sliding_window": 32768,
    "rope_parameters": {
        "rope_type": "default",
        "mrope_section": [16, 24, 24],
        "rope_theta": 1000000.0,
    },
}
PRESET_VISION: dict[str, Any] = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "hidden_act": "silu",
    "out_hidden_size": 2048,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "tokens_per_second": 2,
}
#: Qwen2.5-VL-3B-Instruct's image processor pixel budget (``preprocessor_config.json``).
PRESET_MIN_PIXELS, PRESET_MAX_PIXELS = 56 * 56, 28 * 28 * 16384


def build_tokenizer() -> Any:
    """The Qwen tokenizer of the tiny VLMs: :data:`VOCABULARY`, ChatML, ``<|im_end|>`` ends a
    turn."""
    return words.build_tokenizer(
        SPECIAL_TOKENS,
        eos_token=words.END_TOKEN,
        chat_template=CHAT_TEMPLATE,
        named_tokens={"image_token": IMAGE_TOKEN, "video_token": VIDEO_TOKEN},
    )


def _config(tokenizer: Any, text: dict[str, Any], vision: dict[str, Any], tied: bool) -> Any:
    from transformers import Qwen2_5_VLConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    text = {
        **text,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
    }
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_TOKEN],
        video_token_id=ids[VIDEO_TOKEN],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=tied,
    )


def _processor(
    tokenizer: Any, patch_size: int, merge_size: int, min_pixels: int, max_pixels: int
) -> Any:
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    settings: dict[str, Any] = {
        "patch_size": patch_size,
        "merge_size": merge_size,
        "temporal_patch_size": 2,
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
    }
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**settings),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**settings),
        chat_template=CHAT_TEMPLATE,
    )


def build(directory: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Writes the tiny Qwen2.5-VL into ``directory`` (created if missing) and returns it."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 512,
        # Sections of the 8 rotary frequency pairs of a 16-wide head: time, height, width.
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]},
    }
    vision = {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": 2,
        "window_size": 32,
        "fullatt_block_indexes": [1],
        "tokens_per_second": 2,
    }
    config = _config(tokenizer, text, vision, tied=False)
    processor = _processor(tokenizer, PATCH_SIZE, MERGE_SIZE, MIN_PIXELS, MAX_PIXELS)
    with words.seeded_on_one_thread(seed):
        model = Qwen2_5_VLForConditionalGeneration(config)
        merger = [m for m in model.model.visual.merger.mlp if hasattr(m, "in_features")]
        words.scale_for_learning(
            merger, model.model.language_model.layers, model.model.language_model.embed_tokens
        )
    words.stop_at_answer_words(model, tokenizer)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    _LOGGER.info("tiny Qwen2.5-VL written to %s (%d parameters)", directory, model.num_parameters())
    return directory


def preset_config() -> Any:
    """The ``qwen2_5_vl_3b`` preset's ``Qwen2_5_VLConfig`` (with the tiny tokenizer's ids)."""
    return _config(build_tokenizer(), PRESET_TEXT, PRESET_VISION, tied=True)


def preset_processor() -> Any:
    """The ``qwen2_5_vl_3b`` preset's processor: the tiny tokenizer, Qwen2.5-VL-3B's pixels."""
    return _processor(
        build_tokenizer(),
        PRESET_VISION["patch_size"],
        PRESET_VISION["spatial_merge_size"],
        PRESET_MIN_PIXELS,
        PRESET_MAX_PIXELS,
    )


def build_preset(directory: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Writes the ``qwen2_5_vl_3b`` preset into ``directory`` (created if missing) and returns it.

    Initialises 3,754,622,976 parameters in bfloat16 on the CPU, with every thread (so the
    weights depend on the seed and on the machine's core count; about 9 GB of memory), and
    writes 7.5 GB.
    """
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    directory.mkdir(parents=True, exist_ok=True)
    processor = preset_processor()
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration._from_config(preset_config(), dtype=torch.bfloat16)
    words.stop_at_answer_words(model, processor.tokenizer)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    _LOGGER.info(
        "%s preset written to %s (%d parameters)", PRESET, directory, model.num_parameters()
    )
    return directory
