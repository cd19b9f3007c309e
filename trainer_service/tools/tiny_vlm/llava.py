"""The tiny LLaVA: a CLIP vision tower, LLaVA's two-layer MLP projector and a tiny Llama.

Recipe: CLIP (image 32 px, patch 8, hidden 64, 2 layers; 16 image tokens), projector, Llama
(hidden 64, 2 layers, 4 heads); a ChatML chat template that renders image parts as
``<|image_pad|>``, which ``LlavaProcessor`` expands to one token per patch; CLIP's PIL-only
image processor (shortest edge to 32 px, centre crop 32x32).
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

from trainer_service.tools.tiny_vlm import vocabulary as words

_LOGGER = logging.getLogger(__name__)

IMAGE_TOKEN = "<|image_pad|>"
SPECIAL_TOKENS = (words.PAD_TOKEN, words.START_TOKEN, words.END_TOKEN, IMAGE_TOKEN)
VOCABULARY = words.vocabulary(SPECIAL_TOKENS)
CHAT_TEMPLATE = words.chatml_template(IMAGE_TOKEN)
IMAGE_SIZE = 32
PATCH_SIZE = 8
#: LeCun-normal std for the LM head (hidden size 64): ``--head-std`` for LoRA (see :func:`build`).
LECUN_HEAD_STD = 64**-0.5


def build_tokenizer() -> Any:
    """The tiny LLaVA's tokenizer: :data:`VOCABULARY`, ChatML, ``<|im_end|>`` ends a turn."""
    return words.build_tokenizer(
        SPECIAL_TOKENS,
        eos_token=words.END_TOKEN,
        chat_template=CHAT_TEMPLATE,
        named_tokens={"image_token": IMAGE_TOKEN},
    )


def build(directory: pathlib.Path, seed: int = 0, head_std: float | None = None) -> pathlib.Path:
    """Writes the tiny LLaVA into ``directory`` (created if missing) and returns it.

    ``head_std`` re-draws the LM head with that std (e.g. :data:`LECUN_HEAD_STD`) instead of the
    library's 0.02, whose rows of norm 0.16 cap every logit near +-1.3 whatever the language
    model computes: full fine-tuning trains the head and learns, but LoRA adapters on the
    language model cannot make an answer likely (a pretrained model's head has no such cap).
    With a LeCun head LoRA learns; full fine-tuning's start is then more peaked and collapses
    onto two answers on some seeds, so the default keeps the library's head.
    """
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    vision = CLIPVisionConfig(
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        projection_dim=32,
    )
    text = words.tiny_llama_config(tokenizer)
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
    )
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
    )
    import torch

    with words.seeded_on_one_thread(seed):
        model = LlavaForConditionalGeneration(config)
        projector = model.model.multi_modal_projector
        words.scale_for_learning(
            [projector.linear_1, projector.linear_2],
            model.model.language_model.layers,
            model.model.language_model.embed_tokens,
        )
        if head_std is not None:  # drawn last: every other weight is as without it
            torch.nn.init.normal_(model.lm_head.weight, std=head_std)
    words.stop_at_answer_words(model, tokenizer)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    _LOGGER.info("tiny LLaVA written to %s (%d parameters)", directory, model.num_parameters())
    return directory
