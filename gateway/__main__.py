"""``python -m gateway``: parse flags, set up logging, serve until SIGTERM/SIGINT.

Prints ``gateway listening on HOST:PORT`` once serving, with ``--metrics-port``
``gateway metrics on http://HOST:PORT/metrics``, then ``gateway http on http://HOST:PORT`` (the
page and the JSON API; ``--http-port -1`` turns it off). Scripts wait for these lines.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from gateway.auth import TokenFileError
from gateway.config import DEFAULT_DB, GatewayConfig
from gateway.core.dblock import DatabaseLocked
from gateway.core.store import DatabaseProblem
from gateway.server import Gateway
from trainwire.logs import LOG_FORMATS, configure_logging
from trainwire_ops.addresses import host_port
from trainwire_ops.tls import TlsFileError

_LOGGER = logging.getLogger("gateway")

DEFAULT_PORT = 50051
DEFAULT_TRAINER = "127.0.0.1:50052"
DEFAULT_HTTP_PORT = 8080


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m gateway",
        description="Trainwire gateway: owns training runs, paces and replays them to watchers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port; 0 picks a free one")
    p.add_argument(
        "--trainer",
        default=DEFAULT_TRAINER,
        help="trainer address(es) HOST:PORT, comma-separated, tried in order",
    )
    p.add_argument(
        "--db",
        default=DEFAULT_DB,
        help="SQLite database file, :memory:, or postgresql://USER@HOST:PORT/DB (shared by "
        "gateway replicas)",
    )
    p.add_argument(
        "--lease-seconds",
        type=float,
        default=10.0,
        help="PostgreSQL: how long a replica's lease on a run holds without renewal; another "
        "replica takes the runs of a dead one over after this",
    )
    p.add_argument(
        "--migrate",
        action="store_true",
        help="migrate a database of an older schema on start (without it such a database is "
        "refused; see `python -m gateway migrate`)",
    )
    p.add_argument(
        "--episode-rate",
        type=float,
        default=20.0,
        help="default episodes per second of a run that sets none; negative = unpaced",
    )
    p.add_argument(
        "--keepalive",
        type=float,
        default=15.0,
        help="seconds of silence on a watch stream before a keepalive is sent",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=30.0,
        help="seconds without an episode or heartbeat before a trainer counts as lost",
    )
    p.add_argument(
        "--lead",
        type=float,
        default=2.0,
        help="seconds of a paced run's rate x speed its trainer may train ahead of publication "
        "(at least 4 episodes); a paused run's trainer gets no more",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=2.0,
        help="seconds in-flight calls get on SIGTERM",
    )
    p.add_argument(
        "--schedule-poll",
        type=float,
        default=1.0,
        help="seconds between asking busy trainers again for a free slot",
    )
    p.add_argument(
        "--history-cache-mb",
        type=float,
        default=64.0,
        help="memory for cached history pages of finished runs (MiB)",
    )
    p.add_argument(
        "--live-coalesce",
        type=float,
        default=0.02,
        help="upper bound (s) of the window in which live episodes of a busy run are batched",
    )
    p.add_argument(
        "--client-ping-interval",
        type=float,
        default=30.0,
        help="seconds between HTTP/2 pings to clients",
    )
    p.add_argument(
        "--client-ping-timeout",
        type=float,
        default=10.0,
        help="a client that does not answer a ping within this long (frozen, vanished) is cut "
        "off and its watches freed",
    )
    p.add_argument(
        "--max-pending",
        type=int,
        default=1000,
        help="the most runs waiting for a trainer; CreateRun beyond answers RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics on this port "
        "(0 picks a free one; default: off)",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        help="serve the page, the JSON API and event streams at http://HOST:PORT "
        "(0 picks a free port; -1: off)",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="interface of the metrics endpoint (loopback unless you say otherwise)",
    )
    tls = p.add_argument_group(
        "TLS and authentication", "certificates and the tokens file are re-read on SIGHUP"
    )
    tls.add_argument("--tls-cert", metavar="FILE", help="serve TLS with this PEM certificate chain")
    tls.add_argument("--tls-key", metavar="FILE", help="the PEM private key of --tls-cert")
    tls.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        help="also require client certificates signed by this PEM CA (mutual TLS)",
    )
    tls.add_argument(
        "--trainer-ca", metavar="FILE", help="reach trainers over TLS, trusting this PEM CA"
    )
    tls.add_argument(
        "--trainer-cert",
        metavar="FILE",
        help="present this PEM client certificate to trainers (their --tls-client-ca)",
    )
    tls.add_argument("--trainer-key", metavar="FILE", help="the PEM private key of --trainer-cert")
    tls.add_argument(
        "--auth-tokens",
        metavar="FILE",
        help="require 'authorization: Bearer TOKEN' (lines TOKEN_SHA256 ROLE NAME; make them "
        "with python -m gateway.tools.add_token); health stays open",
    )
    tls.add_argument(
        "--insecure",
        action="store_true",
        help="serve plaintext on a non-loopback --host (refused without it)",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text: one line for people; json: one JSON object per line",
    )
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The config of the parsed flags (raises ValueError on a bad value)."""
    return GatewayConfig(
        host=args.host,
        port=args.port,
        trainers=tuple(a.strip() for a in args.trainer.split(",") if a.strip()),
        db=args.db,
        migrate=args.migrate,
        episode_rate=args.episode_rate,
        keepalive_s=args.keepalive,
        heartbeat_timeout_s=args.heartbeat_timeout,
        lead_s=args.lead,
        shutdown_grace_s=args.shutdown_grace,
        schedule_poll_s=args.schedule_poll,
        history_cache_mb=args.history_cache_mb,
        live_coalesce_s=args.live_coalesce,
        max_pending=args.max_pending,
        lease_s=args.lease_seconds,
        client_ping_interval_s=args.client_ping_interval,
        client_ping_timeout_s=args.client_ping_timeout,
        metrics_port=args.metrics_port,
        http_port=None if args.http_port == -1 else args.http_port,
        metrics_host=args.metrics_host,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        trainer_ca=args.trainer_ca,
        trainer_cert=args.trainer_cert,
        trainer_key=args.trainer_key,
        auth_tokens=args.auth_tokens,
        insecure=args.insecure,
    )


async def serve(config: GatewayConfig) -> int:
    """Serves until SIGTERM or SIGINT, then stops gracefully; returns the exit status."""
    gateway = Gateway(config)
    try:
        port = await gateway.start()
    except (DatabaseLocked, DatabaseProblem, TlsFileError, TokenFileError) as exc:
        print(f"python -m gateway: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (OSError, RuntimeError) as exc:  # a port that cannot be bound
        _LOGGER.error("%s", exc)
        return 1
    # Handlers before the ready lines: a SIGTERM sent as soon as they appear stops gracefully.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, gateway.reload)
    print(f"gateway listening on {host_port(config.host, port)}", flush=True)
    if gateway.metrics_endpoint is not None:
        print(f"gateway metrics on {gateway.metrics_endpoint.url}", flush=True)
    if gateway.http is not None:
        print(f"gateway http on {gateway.http.url}", flush=True)
    await stop.wait()
    _LOGGER.info("signal received: shutting down")
    try:
        async with asyncio.timeout(config.shutdown_grace_s + 2.5):
            await gateway.stop()
    except TimeoutError:
        _LOGGER.error("shutdown took too long; exiting anyway")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``python -m gateway migrate ...`` migrates a database)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["migrate"]:
        from gateway.tools import migrate

        return migrate.main(argv[1:])
    args = parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"python -m gateway: error: {exc}", file=sys.stderr)
        return 2
    try:
        configure_logging(args.log_level, args.log_format)
    except ValueError as exc:
        print(f"python -m gateway: error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
