"""Command-line tools: the offline tiny VLM and the demo dataset makers."""
