"""Trainwire client package: generated stubs (``trainwire.v1``), contract checker, helpers."""

__version__ = "0.1.0"
