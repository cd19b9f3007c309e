"""Generated code of the ``trainwire.v1`` contract (``make gen``; never edit by hand)."""
