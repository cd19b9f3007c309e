"""Builds a tiny LLaVA vision-language model, untrained, that GRPO can teach to name colours.

``python -m trainer_service.tools.make_tiny_vlm DIR`` writes a complete model directory (config,
weights, processor, tokenizer, chat template, generation config) that
``from_pretrained(DIR, local_files_only=True)`` loads back without any network, in a few seconds.

The weights are random: the model knows nothing about images or words. It is built so that GRPO
with an ``exact_match`` reward can teach it, on a CPU in a minute or two, to answer a one-word
question about an image (the colour or the shape of what it shows); ``bench/grpo_learning.py``
measures that it does, and that it learns nothing when every image is uniform gray. Three
choices make that possible, none of which tells the model any answer:

- **A word-level vocabulary** (:data:`VOCABULARY`): common colour and shape words, common
  question words, ChatML tokens. Each answer is one token, so a correct answer is one sampling
  decision (about 1 in 65 at the start) rather than a byte sequence an untrained model never
  produces. Words outside the vocabulary (other prompt wording) become ``<unk>``.
- **Answer words end a completion**: the generation config lists every answer word, besides
  ``<|im_end|>``, as an end-of-sequence id (TRL ends a completion at any id the model declares
  as EOS). A completion is whatever precedes and includes the first answer word, so it never has
  to learn to stop, and ``the red`` (a wrong format) still scores 0 with ``exact_match``.
- **Initial scales that let pixels reach the answer**: with the default initialisation (std
  0.02) the projected image features are ~15x quieter than word embeddings and the attention
  path is nearly closed, so the answer position barely depends on the image and a policy
  gradient has almost no pixel signal to follow. The projector and the attention value/output
  projections start LeCun-normal, the word embeddings with std 0.25.

Why LLaVA and not Qwen2-VL: Qwen2-VL's processor needs torchvision, which has no CPU wheel that
imports with torch 2.13. LLaVA's CLIP image processor has a PIL-only variant.

Recipe: a CLIP vision tower (image 32 px, patch 8, hidden 64, 2 layers), LLaVA's two-layer MLP
projector and a tiny Llama text model (hidden 64, 2 layers, 4 heads); a lower-casing word-level
tokenizer with ChatML special tokens including ``<|image_pad|>``; a ChatML chat template that
renders image parts as ``<|image_pad|>`` (the processor expands it to one token per patch).
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
from typing import Any

_LOGGER = logging.getLogger(__name__)

PAD_TOKEN = "<|endoftext|>"
END_TOKEN = "<|im_end|>"
IMAGE_TOKEN = "<|image_pad|>"
UNKNOWN_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, "<|im_start|>", END_TOKEN, IMAGE_TOKEN)
IMAGE_SIZE = 32
PATCH_SIZE = 8

#: Colour answers the model can give (one token each).
COLOUR_WORDS: tuple[str, ...] = (
    "red",
    "green",
    "blue",
    "yellow",
    "orange",
    "purple",
    "pink",
    "brown",
    "black",
    "white",
    "gray",
)
#: Shape answers the model can give (one token each).
SHAPE_WORDS: tuple[str, ...] = ("circle", "square", "triangle", "cross", "diamond", "star")
ANSWER_WORDS: tuple[str, ...] = COLOUR_WORDS + SHAPE_WORDS
#: Other words the tokenizer knows: roles and common question wording.
PROMPT_WORDS: tuple[str, ...] = (
    "user",
    "assistant",
    "system",
    "colour",
    "color",
    "shape",
    "what",
    "which",
    "is",
    "are",
    "the",
    "a",
    "an",
    "of",
    "this",
    "that",
    "it",
    "in",
    "on",
    "image",
    "picture",
    "photo",
    "object",
    "thing",
    "answer",
    "with",
    "one",
    "word",
    "name",
    "tell",
    "me",
    "you",
    "see",
    "do",
    "please",
    "here",
    "?",
    ".",
    ",",
    ":",
    "!",
    "<",
    ">",
    "/",
)
#: Initial std of the word embeddings (see the module docstring).
EMBEDDING_STD = 0.25
#: The whole vocabulary, in id order.
VOCABULARY: tuple[str, ...] = (*SPECIAL_TOKENS, UNKNOWN_TOKEN, *PROMPT_WORDS, *ANSWER_WORDS)

# ChatML; string content or a list of {"type": "image"} / {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|image_pad|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer() -> Any:
    """Returns a ``PreTrainedTokenizerFast``: lower-casing, word-level, ChatML specials.

    Text is lower-cased and split into runs of word characters and runs of punctuation; each
    piece is one token, ``<unk>`` when it is not in :data:`VOCABULARY`. Decoding joins tokens
    with single spaces.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(VOCABULARY)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNKNOWN_TOKEN))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token=END_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNKNOWN_TOKEN,
        padding_side="left",
        extra_special_tokens={"image_token": IMAGE_TOKEN},
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _init_scales(model: Any) -> None:
    """LeCun-normal projector and attention value/output weights; louder word embeddings.

    See the module docstring: these let the image reach the answer position from the start.
    """
    import torch

    def lecun(layer: torch.nn.Linear) -> None:
        torch.nn.init.normal_(layer.weight, std=layer.in_features**-0.5)
        if layer.bias is not None:
            torch.nn.init.zeros_(layer.bias)

    projector = model.model.multi_modal_projector
    lecun(projector.linear_1)
    lecun(projector.linear_2)
    for layer in model.model.language_model.layers:
        lecun(layer.self_attn.v_proj)
        lecun(layer.self_attn.o_proj)
    torch.nn.init.normal_(model.model.language_model.embed_tokens.weight, std=EMBEDDING_STD)


def build(directory: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Builds the tiny VLM into ``directory`` (created if missing) and returns it.

    Args:
        directory: Output directory; existing files of the same names are overwritten.
        seed: Seed for the random weights; the same seed gives the same weights on the same
            platform.
    """
    import torch
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    vision = CLIPVisionConfig(
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
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
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same weights whatever the machine's core count
    try:
        model = LlavaForConditionalGeneration(config)
        _init_scales(model)
    finally:
        torch.set_num_threads(threads)
    answer_ids = tokenizer.convert_tokens_to_ids(list(ANSWER_WORDS))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *answer_ids]
    model.generation_config.bos_token_id = None
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    _LOGGER.info("tiny VLM written to %s (%d parameters)", directory, model.num_parameters())
    return directory


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: ``python -m trainer_service.tools.make_tiny_vlm DIR``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=pathlib.Path, help="output model directory")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    build(args.directory, seed=args.seed)
    print(args.directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
