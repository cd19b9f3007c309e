"""``python -m gateway``: parse flags, set up logging, serve until SIGTERM/SIGINT.

Prints ``gateway listening on HOST:PORT`` once serving, with ``--metrics-port``
``gateway metrics on http://HOST:PORT/metrics``, then ``gateway http on http://HOST:PORT`` (the
page and the JSON API; ``--http-port -1`` turns it off). Scripts wait for these lines.

A flag, a certificate or token file, or a database it cannot use (locked by another gateway,
in a directory it cannot write, needing a migration) exits 2 with one
``python -m gateway: error: ...`` line that names the file and the problem.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Mapping, Sequence

from gateway.auth import TokenFileError
from gateway.config import GatewayConfig
from gateway.core.dblock import DatabaseLocked
from gateway.core.store import DatabaseProblem
from gateway.server import Gateway
from trainwire_ops import settings
from trainwire_ops.addresses import host_port
from trainwire_ops.checkpoints import CheckpointStoreProblem
from trainwire_ops.logs import announce, configure_logging
from trainwire_ops.tls import TlsFileError

_LOGGER = logging.getLogger("gateway")

ENV_PREFIX = "TRAINWIRE_GATEWAY_"


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The command line: one flag per field of ``GatewayConfig``, each also read from
    ``TRAINWIRE_GATEWAY_<FLAG>`` (``environ``, default ``os.environ``)."""
    return settings.build_parser(
        GatewayConfig,
        prog="python -m gateway",
        description="Trainwire gateway: owns training runs, paces and replays them to watchers. "
        "`python -m gateway migrate --help` migrates a database.",
        env_prefix=ENV_PREFIX,
        environ=environ,
    )


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """The parsed command line (exits 2 with a usage line on a bad flag or variable)."""
    return build_parser(environ).parse_args(argv)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The config of the parsed flags (raises ValueError on a bad value)."""
    return settings.config_from_args(GatewayConfig, args)


async def serve(config: GatewayConfig) -> int:
    """Serves until SIGTERM or SIGINT, then stops gracefully; returns the exit status."""
    gateway = Gateway(config)
    try:
        port = await gateway.start()
    # DatabaseProblem includes a database directory or lock file that cannot be created.
    except (
        CheckpointStoreProblem,
        DatabaseLocked,
        DatabaseProblem,
        TlsFileError,
        TokenFileError,
    ) as exc:
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
    announce(f"gateway listening on {host_port(config.host, port)}")
    if gateway.metrics_endpoint is not None:
        announce(f"gateway metrics on {gateway.metrics_endpoint.url}")
    if gateway.http is not None:
        announce(f"gateway http on {gateway.http.url}")
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
    configure_logging(config.log_level, config.log_format)
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
