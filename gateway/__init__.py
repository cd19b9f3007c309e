"""Trainwire gateway: owns training runs, their durable history, pacing and fan-out to watchers.

Architecture (imports point one way): ``servicer`` -> ``convert`` -> ``core``. The core
(``gateway.core``) holds the run state machine, the per-run episode log, pacing, FIFO
scheduling and the SQLite store, and imports neither grpc nor torch. ``trainer_client`` adapts
the trainer's gRPC stream to the core's ``TrainerConnector``; ``status`` maps domain errors to
gRPC statuses in one table; ``metrics`` is the Prometheus observer of the core and the RPC
interceptor (``trainwire_ops.rpc_metrics_aio``, shared with the trainer); ``server`` wires
everything into a ``grpc.aio`` server with health, reflection and an HTTP/2 keepalive policy;
``__main__`` parses flags and sets up logging (``--log-format text|json``).

Memory bound per active run
---------------------------
An active run keeps the live tail of its published history in memory as pre-encoded wire
frames, so any number of watchers follow it without touching the store or re-serializing: its
last ``CoreSettings.live_episodes`` (2048) to twice that many episodes, each ``len(Episode) +
~40`` bytes, whatever the run's length (up to 10,000,000 episodes); older history is read from
the store through the page cache. An episode without detail is ~100-200 bytes; the largest
detail the contract allows is an imitation motion of 240 frames x 32 joints (~31 KiB) or eight
4 KiB GRPO completions (~32 KiB). The worst case is therefore ~4096 x 32 KiB = ~128 MiB for one
run; a typical imitation run (a 60-120 frame x 11 joint motion on every 10th episode, ~340 B
per episode on average) stays under 2 MiB. On top of that a run holds one episode read from its
trainer, at most ``MAX_UNCOMMITTED`` (256) episodes awaiting their group commit (beyond that it
stops reading, and gRPC flow control throttles the trainer), and its curve's open blocks (one
per level, ``gateway.core.curve``).

A watcher holds only a cursor (an int), a parked future while idle, and at most one in-flight gRPC
message (one batch: <= 256 episodes or 1 MiB), never a queue (the memory of an idle watch stream,
gRPC's own buffers included, is measured by ``bench/gateway_fanout.py``). A watcher that disconnects
releases all of it at once. Finished runs are not pinned: their history (and an active run's, before
its live tail) is read from the store in pages of 256 episodes through one byte-bounded LRU cache
shared by all runs (``--history-cache-mb``, default 64 MiB).
"""
