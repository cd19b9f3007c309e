"""Test doubles that speak the real wire protocols (in-process gRPC servers on port 0)."""
