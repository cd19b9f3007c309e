"""The trainer's pure core: slots, provider interface, errors, job runner (no grpc, no torch)."""
