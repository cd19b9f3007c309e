"""The Trainwire trainer service: runs training jobs in slots and streams their episodes."""

__version__ = "0.1.0"
