"""Tiny, untrained vision-language models of real architectures, built offline: one module per
architecture (:mod:`.llava`, :mod:`.qwen2_vl`, :mod:`.smolvlm`; the ``qwen2_5_vl_3b`` preset in
:mod:`.qwen2_vl`), what they share in :mod:`.vocabulary`. ``make_tiny_vlm`` is the command line
and says why they are built the way they are.
"""
