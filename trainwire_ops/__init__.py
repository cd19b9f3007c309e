"""Operations plumbing shared by the Trainwire services (gateway and trainer), not by clients.

``trainwire_ops.rpc_metrics`` holds the Prometheus RPC metrics of a gRPC server, recorded by
the interceptors in ``rpc_metrics_sync`` and ``rpc_metrics_aio`` (same metric names);
``metrics_endpoint`` serves them over HTTP at ``/metrics``. They import grpc and
prometheus_client only, never torch or either service's core, so neither service depends on
the other, and the client package (``trainwire``) stays free of prometheus_client.
"""
