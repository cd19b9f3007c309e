"""Operations plumbing shared by the Trainwire services (gateway and trainer), not by clients.

``trainwire_ops.rpc_metrics`` holds the Prometheus RPC metrics of a gRPC server (sync and
``grpc.aio`` interceptors with the same metric names) and the HTTP ``/metrics`` endpoint. It
imports grpc and prometheus_client only, never torch or either service's core, so neither
service depends on the other, and the client package (``trainwire``) stays free of
prometheus_client.
"""
