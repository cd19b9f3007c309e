"""The gateway's core: runs, history, pacing, scheduling and the store. No grpc, no torch."""
