"""Trainwire's client package: generated stubs (``trainwire.v1``), the contract checker and helpers."""

__version__ = "0.1.0"
