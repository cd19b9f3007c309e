"""Command-line tools: the offline tiny VLMs (``make_tiny_vlm``, built by ``tiny_vlm``) and the
demo dataset makers."""
