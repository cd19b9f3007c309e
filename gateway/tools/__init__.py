"""Operator tools of the gateway (``python -m gateway.tools.NAME``)."""
