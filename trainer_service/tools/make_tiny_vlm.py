"""Builds a tiny vision-language model, untrained, that GRPO can teach to name colours.

``python -m trainer_service.tools.make_tiny_vlm DIR [--arch {llava,qwen2_vl,smolvlm}]`` writes a
complete model directory (config, weights, processor, tokenizer, chat template, generation
config) that ``AutoModelForImageTextToText`` and ``AutoProcessor`` load back with
``local_files_only=True``, without any network, in a few seconds. Each architecture is the real
one, at a tiny size, with its own processor, special tokens and chat template
(:mod:`.tiny_vlm`):

- ``llava`` (the default): LLaVA, a CLIP tower and a Llama; ``LlavaProcessor``.
- ``qwen2_vl``: Qwen2.5-VL, Qwen's vision tower with window attention and patch merger, and
  multimodal rotary positions; ``Qwen2_5_VLProcessor`` (with its video processor).
- ``smolvlm``: SmolVLM's first generation, which is Idefics3: a SigLIP-style tower, the
  pixel-shuffle connector and a Llama; ``Idefics3Processor``.

The weights are random: the model knows nothing about images or words. It is built so that GRPO
with an ``exact_match`` reward can teach it, on a CPU in a minute or two, to answer a one-word
question about an image (the colour or the shape of what it shows); ``bench/grpo_learning.py``
measures that each architecture does, and that it learns nothing when every image is uniform
gray. Three choices make that possible, none of which tells the model any answer:

- **A word-level vocabulary** (:mod:`.tiny_vlm.vocabulary`): common colour and shape words,
  common question words, the architecture's special tokens. Each answer is one token, so a
  correct answer is one sampling decision (about 1 in 65 at the start) rather than a byte
  sequence an untrained model never produces. Words outside the vocabulary (other prompt
  wording) become ``<unk>``.
- **Answer words end a completion**: the generation config lists every answer word, besides
  the end-of-turn token, as an end-of-sequence id (TRL ends a completion at any id the model
  declares as EOS). A completion is whatever precedes and includes the first answer word, so it
  never has to learn to stop, and ``the red`` (a wrong format) still scores 0 with
  ``exact_match``.
- **Initial scales that let pixels reach the answer**: with the default initialisation (std
  0.02) the projected image features are ~15x quieter than word embeddings and the attention
  path is nearly closed, so the answer position barely depends on the image and a policy
  gradient has almost no pixel signal to follow. The projector (LLaVA's MLP, Qwen's patch
  merger, Idefics3's connector) and the text model's attention value/output projections start
  LeCun-normal, the word embeddings with std 0.25.

``--preset qwen2_5_vl_3b`` builds instead a model with the real shapes of Qwen2.5-VL-3B-Instruct
(about 3.75 billion parameters, random weights, bfloat16, 7.5 GB on disk, the tiny tokenizer):
for measuring memory and speed on a GPU at the real size (:mod:`.tiny_vlm.qwen2_vl`). It loads
back with no tensor missing.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
from collections.abc import Callable

from trainer_service.tools.tiny_vlm import llava, qwen2_vl, smolvlm
from trainer_service.tools.tiny_vlm import vocabulary as words

_Builder = Callable[[pathlib.Path, int], pathlib.Path]

#: Architectures by ``--arch`` name.
ARCHS: dict[str, _Builder] = {
    "llava": llava.build,
    "qwen2_vl": qwen2_vl.build,
    "smolvlm": smolvlm.build,
}
DEFAULT_ARCH = "llava"
#: The LLaVA head std under which LoRA learns the colour task (LeCun-normal, 0.125).
LORA_HEAD_STD = llava.LECUN_HEAD_STD
#: Real-size models by ``--preset`` name.
PRESETS: dict[str, _Builder] = {qwen2_vl.PRESET: qwen2_vl.build_preset}

# The default architecture's vocabulary and tokenizer, and the answers every architecture knows.
ANSWER_WORDS = words.ANSWER_WORDS
VOCABULARY = llava.VOCABULARY
build_tokenizer = llava.build_tokenizer


def build(
    directory: pathlib.Path,
    seed: int = 0,
    arch: str = DEFAULT_ARCH,
    head_std: float | None = None,
) -> pathlib.Path:
    """Builds the tiny VLM of architecture ``arch`` into ``directory`` (created if missing) and
    returns it.

    Args:
        directory: Output directory; existing files of the same names are overwritten.
        seed: Seed for the random weights; the same seed gives the same weights on the same
            platform.
        arch: One of :data:`ARCHS`.
        head_std: LLaVA only: draw the LM head with this std instead of the library's 0.02
            (:data:`LORA_HEAD_STD` lets LoRA adapters learn; see ``tiny_vlm.llava.build``).

    Raises:
        ValueError: Unknown ``arch``, or ``head_std`` for another architecture or not above 0.
    """
    builder = ARCHS.get(arch)
    if builder is None:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    if head_std is None:
        return builder(directory, seed)
    if arch != "llava" or not head_std > 0:
        raise ValueError(f"head_std {head_std}: only for llava, and above 0")
    return llava.build(directory, seed, head_std=head_std)


def build_preset(directory: pathlib.Path, preset: str, seed: int = 0) -> pathlib.Path:
    """Builds the real-size model ``preset`` (one of :data:`PRESETS`) into ``directory``.

    Raises:
        ValueError: Unknown ``preset``.
    """
    builder = PRESETS.get(preset)
    if builder is None:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return builder(directory, seed)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: ``python -m trainer_service.tools.make_tiny_vlm DIR``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=pathlib.Path, help="output model directory")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument(
        "--arch",
        choices=list(ARCHS),
        default=DEFAULT_ARCH,
        help=f"architecture of the tiny model (default {DEFAULT_ARCH})",
    )
    kind.add_argument(
        "--preset",
        choices=list(PRESETS),
        help="build a random-weight model with a real model's shapes instead (GPU-sized)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights")
    parser.add_argument(
        "--head-std",
        type=float,
        default=None,
        metavar="STD",
        help=f"llava only: draw the LM head with this std instead of the library's 0.02 (which "
        f"caps every logit near +-1.3, so LoRA adapters cannot learn); {LORA_HEAD_STD:g} "
        "(LeCun) lets LoRA learn the colour task (default: 0.02)",
    )
    args = parser.parse_args(argv)
    if args.head_std is not None and (args.preset or args.arch != "llava" or args.head_std <= 0):
        parser.error("--head-std: only with --arch llava, and above 0")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.preset is not None:
        build_preset(args.directory, args.preset, seed=args.seed)
    else:
        build(args.directory, seed=args.seed, arch=args.arch, head_std=args.head_std)
    print(args.directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
