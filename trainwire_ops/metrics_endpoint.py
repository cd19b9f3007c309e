"""The HTTP ``/metrics`` endpoint: a ``CollectorRegistry`` served by prometheus_client."""

from __future__ import annotations

import logging
import threading
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import CollectorRegistry

from trainwire_ops.addresses import host_port

_LOGGER = logging.getLogger(__name__)


class MetricsEndpoint:
    """A registry served at ``http://HOST:PORT/metrics`` by prometheus_client in a thread.

    Start it with :meth:`start`; :meth:`stop` closes the socket and joins the thread.
    """

    def __init__(self, httpd: WSGIServer, thread: threading.Thread, host: str) -> None:
        self._httpd = httpd
        self._thread = thread
        self.host = host
        self.port: int = httpd.server_port

    @classmethod
    def start(cls, registry: CollectorRegistry, host: str, port: int) -> MetricsEndpoint:
        """Serves ``registry`` on ``host:port`` (0 picks a free port).

        Raises:
            OSError: The address could not be bound.
        """
        try:
            httpd, thread = prometheus_client.start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: {exc}") from exc
        endpoint = cls(httpd, thread, host)
        _LOGGER.info("metrics on %s", endpoint.url)
        return endpoint

    @property
    def url(self) -> str:
        """``http://HOST:PORT/metrics`` (IPv6 hosts bracketed)."""
        return f"http://{host_port(self.host, self.port)}/metrics"

    def stop(self, timeout: float = 5.0) -> None:
        """Stops serving, closes the socket and joins the thread; idempotent."""
        if self._thread.is_alive():
            self._httpd.shutdown()  # returns once serve_forever has left its loop
        self._httpd.server_close()
        self._thread.join(timeout)
