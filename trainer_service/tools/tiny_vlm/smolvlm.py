"""The tiny SmolVLM: Idefics3's architecture (SmolVLM's first generation is exactly it), a
SigLIP-style vision tower, the pixel-shuffle connector and a tiny Llama.

``Idefics3ForConditionalGeneration`` with ``Idefics3Processor`` (SmolVLM2's ``smolvlm`` model type
differs in its video handling, and its processor needs the ``num2words`` package). The chat
template is SmolVLM's: ``<|im_start|>User:<image>question<end_of_utterance>`` then
``Assistant:``; the processor expands each ``<image>`` to ``<fake_token_around_image>
<global-img>``, one ``<image>`` per connector output and ``<fake_token_around_image>``.
``<end_of_utterance>`` ends a turn.

Recipe: vision tower of 2 layers (image 48 px, patch 8, hidden 64, 2 heads: 36 patches), the
connector's pixel shuffle (scale factor 2: 9 image tokens of 4 patches each) and projection, a
Llama of 2 layers (hidden 64, 4 heads); image splitting off, every image resized to 48x48.
Initial scales as for every tiny VLM (LeCun-normal connector projection and attention
value/output projections, word embeddings with std 0.25). With 32-pixel images (4 image
tokens) it learned the colour demo more slowly and less surely across seeds.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

from trainer_service.tools.tiny_vlm import vocabulary as words

_LOGGER = logging.getLogger(__name__)

IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
SPECIAL_TOKENS = (
    words.PAD_TOKEN,
    words.START_TOKEN,
    END_OF_UTTERANCE,
    FAKE_IMAGE_TOKEN,
    GLOBAL_IMAGE_TOKEN,
    IMAGE_TOKEN,
)
VOCABULARY = words.vocabulary(SPECIAL_TOKENS)
#: SmolVLM's chat template (without its video parts).
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}"
    "{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
IMAGE_SIZE = 48
PATCH_SIZE = 8
SCALE_FACTOR = 2
#: Image tokens per image: the connector's outputs.
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2


def build_tokenizer() -> Any:
    """The tiny SmolVLM's tokenizer: :data:`VOCABULARY`, ``<end_of_utterance>`` ends a turn."""
    return words.build_tokenizer(
        SPECIAL_TOKENS,
        eos_token=END_OF_UTTERANCE,
        chat_template=CHAT_TEMPLATE,
        named_tokens={"image_token": IMAGE_TOKEN},
    )


def build(directory: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Writes the tiny SmolVLM into ``directory`` (created if missing) and returns it."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    vision = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
    }
    text = words.tiny_llama_config(tokenizer)
    config = Idefics3Config(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=SCALE_FACTOR,
        tie_word_embeddings=False,
    )
    edge = {"longest_edge": IMAGE_SIZE}
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessor(
            do_image_splitting=False, size=edge, max_image_size=edge
        ),
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=CHAT_TEMPLATE,
    )
    with words.seeded_on_one_thread(seed):
        model = Idefics3ForConditionalGeneration(config)
        text_model = model.model.text_model
        words.scale_for_learning(
            [model.model.connector.modality_projection.proj],
            text_model.layers,
            text_model.embed_tokens,
        )
    words.stop_at_answer_words(model, tokenizer)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    _LOGGER.info("tiny SmolVLM written to %s (%d parameters)", directory, model.num_parameters())
    return directory
