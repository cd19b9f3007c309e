"""Operations plumbing shared by the Trainwire services (gateway and trainer), not by clients.

- ``settings``: command lines and ``TRAINWIRE_*`` variables generated from a config dataclass;
- ``logs``: ``--log-format text|json`` and ``--log-level``;
- ``tls`` and ``addresses``: certificates reloaded on SIGHUP, the plaintext-bind rule, and
  ``HOST:PORT`` as both services print and bind it;
- ``rich_status``: the ``google.rpc.Status`` both services and the test fakes send;
- ``signals``: SIGTERM, SIGINT and SIGHUP handed to a waiting main thread without a lock;
- ``rpc_metrics`` (recorded by the ``grpc.aio`` interceptor in ``rpc_metrics_aio``) and
  ``metrics_endpoint``: Prometheus RPC metrics at ``/metrics``.

These modules import grpc, protobuf, prometheus_client and the client package (``trainwire``) at
most, never torch or either service, so neither service depends on the other, and the client
package stays free of them.
"""
