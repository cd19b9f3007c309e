"""Builds a tiny, randomly initialised LLaVA vision-language model for offline tests and demos.

``python -m trainer_service.tools.make_tiny_vlm DIR`` writes a complete model directory (config,
weights, processor, tokenizer, chat template) that ``from_pretrained(DIR, local_files_only=True)``
loads back without any network. The model is untrained: its completions are random bytes, which is
all the GRPO provider's tests and the demo need (a real user points ``model_path`` at a real
local model).

Why LLaVA and not Qwen2-VL: Qwen2-VL's processor needs torchvision, which has no CPU wheel that
imports with torch 2.13. LLaVA's CLIP image processor has a PIL-only variant.

Recipe: a CLIP vision tower (image 32 px, patch 8, hidden 32, 2 layers) and a tiny Llama text
model; a byte-level BPE tokenizer (256-byte alphabet, no merges) with ChatML special tokens
including ``<|image_pad|>``; a ChatML chat template that renders image parts as
``<|image_pad|>`` (the processor expands it to one token per image feature).
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys

_LOGGER = logging.getLogger(__name__)

IMAGE_TOKEN = "<|image_pad|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", IMAGE_TOKEN)
IMAGE_SIZE = 32
PATCH_SIZE = 8

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


def build_tokenizer() -> object:
    """Returns a ``PreTrainedTokenizerFast``: byte-level BPE, 256-byte alphabet, ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        padding_side="left",
        extra_special_tokens={"image_token": IMAGE_TOKEN},
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build(directory: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Builds the tiny VLM into ``directory`` (created if missing) and returns it.

    Args:
        directory: Output directory; existing files of the same names are overwritten.
        seed: Seed for the random weights, so two builds are byte-identical in weights.
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
    vocab_size = len(tokenizer)  # type: ignore[arg-type]
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)  # type: ignore[attr-defined]
    vision = CLIPVisionConfig(
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
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
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id  # type: ignore[attr-defined]
    model.generation_config.eos_token_id = tokenizer.eos_token_id  # type: ignore[attr-defined]
    model.generation_config.bos_token_id = None
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
