"""What every tiny VLM shares: the word-level vocabulary and tokenizer, the ChatML template, the
initial scales that let pixels reach the answer, and answer words that end a completion.

Each architecture has its own special tokens (they come first, in the order it lists them), then
``<unk>``, then :data:`PROMPT_WORDS` and :data:`ANSWER_WORDS`: an architecture's vocabulary is
:func:`vocabulary` of its special tokens. Every answer is one token. Text is lower-cased and split
into runs of word characters and runs of punctuation; special tokens are matched before that
split, so ``<fake_token_around_image>`` stays one token. Decoding joins tokens with single spaces
and drops ids the vocabulary does not have (a model whose embedding is larger than the vocabulary,
such as a preset with real shapes, may sample them).

Nothing here imports torch, transformers or tokenizers at import time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

PAD_TOKEN = "<|endoftext|>"
START_TOKEN = "<|im_start|>"
END_TOKEN = "<|im_end|>"
UNKNOWN_TOKEN = "<unk>"

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
#: Initial std of the word embeddings (see ``make_tiny_vlm``'s docstring).
EMBEDDING_STD = 0.25


def vocabulary(special_tokens: Sequence[str]) -> tuple[str, ...]:
    """The whole vocabulary of an architecture with these special tokens, in id order."""
    return (*special_tokens, UNKNOWN_TOKEN, *PROMPT_WORDS, *ANSWER_WORDS)


def chatml_template(image: str) -> str:
    """A ChatML chat template that renders each image part as ``image``.

    Message content is a string or a list of ``{"type": "image"}`` / ``{"type": "text",
    "text": ...}`` parts; ``add_generation_prompt`` appends ``<|im_start|>assistant``.
    """
    return (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' %}}{{{{ '{image}' }}}}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        "{{ '<|im_end|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


def build_tokenizer(
    special_tokens: Sequence[str],
    *,
    eos_token: str,
    chat_template: str,
    named_tokens: Mapping[str, str],
) -> Any:
    """Returns a ``PreTrainedTokenizerFast`` over :func:`vocabulary` of ``special_tokens``.

    Args:
        special_tokens: The architecture's special tokens, :data:`PAD_TOKEN` among them; they
            take the first ids, in this order.
        eos_token: The token that ends a turn (one of ``special_tokens``).
        chat_template: The template the tokenizer (and the processor) applies.
        named_tokens: Attributes the processor looks the tokens up by (``image_token``...).
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = vocabulary(special_tokens)
    core = Tokenizer(
        models.WordLevel(vocab={word: i for i, word in enumerate(words)}, unk_token=UNKNOWN_TOKEN)
    )
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.add_special_tokens(list(special_tokens))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token=eos_token,
        pad_token=PAD_TOKEN,
        unk_token=UNKNOWN_TOKEN,
        padding_side="left",
        extra_special_tokens=dict(named_tokens),
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def lecun(layer: Any) -> None:
    """LeCun-normal weights (std ``in_features ** -0.5``) and zero bias for an ``nn.Linear``."""
    import torch

    torch.nn.init.normal_(layer.weight, std=layer.in_features**-0.5)
    if layer.bias is not None:
        torch.nn.init.zeros_(layer.bias)


def tiny_llama_config(tokenizer: Any) -> Any:
    """The tiny Llama text model LLaVA and Idefics3 share: hidden 64, 2 layers, 4 heads, the
    tokenizer's vocabulary and padding, its end of turn the end of sequence, no BOS."""
    from transformers import LlamaConfig

    return LlamaConfig(
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


def scale_for_learning(projector: Sequence[Any], text_layers: Sequence[Any], embed: Any) -> None:
    """The initial scales that let the image reach the answer position from the start:
    LeCun-normal ``projector`` linears and attention value/output projections of each of
    ``text_layers``, word embeddings with std :data:`EMBEDDING_STD`."""
    import torch

    for layer in projector:
        lecun(layer)
    for layer in text_layers:
        lecun(layer.self_attn.v_proj)
        lecun(layer.self_attn.o_proj)
    torch.nn.init.normal_(embed.weight, std=EMBEDDING_STD)


def stop_at_answer_words(model: Any, tokenizer: Any) -> None:
    """Makes every answer word, besides the tokenizer's end of turn, an end-of-sequence id of
    ``model``'s generation config (a completion ends at its first answer word), with the
    tokenizer's padding and no beginning-of-sequence token."""
    answer_ids = tokenizer.convert_tokens_to_ids(list(ANSWER_WORDS))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *answer_ids]
    model.generation_config.bos_token_id = None


@contextlib.contextmanager
def seeded_on_one_thread(seed: int) -> Iterator[None]:
    """Seeds torch and initialises on one CPU thread inside the block: the same seed gives the
    same weights whatever the machine's core count."""
    import torch

    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
