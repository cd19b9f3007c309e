"""Command line entry point: ``python -m trainer_service --host ... --port ... --slots ...``.

Parses flags into a ``TrainerConfig``, sets up logging (``--log-format text|json``), resolves the
device, starts the server and prints ``trainer listening on HOST:PORT`` (and, with
``--metrics-port``, ``trainer metrics on http://HOST:PORT/metrics``). SIGTERM/SIGINT stop
accepting calls, stop running jobs at their next episode and exit within a few seconds.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import signal
import sys
import threading
from types import FrameType

from trainer_service import __version__
from trainer_service.config import TrainerConfig
from trainer_service.core.jobs import JobRunner, RunnerSettings
from trainer_service.core.slots import SlotPool
from trainer_service.metrics import TrainerMetrics
from trainer_service.providers import default_registry
from trainer_service.server import build_server
from trainwire.logs import LOG_FORMATS, configure_logging
from trainwire_ops.addresses import host_port
from trainwire_ops.tls import PlaintextRefused, ServerTls, TlsFileError

# Under ``python -m`` __name__ is "__main__"; log under the module's real name.
_LOGGER = logging.getLogger(__spec__.name if __spec__ is not None else __name__)

DEFAULT_PORT = 50052
IMAGE_CACHE_ENV = "TRAINWIRE_IMAGE_CACHE_DIR"


def _slots(value: str) -> int | str:
    """``--slots``: ``auto`` or a count."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither auto nor a number") from None


def parse_args(argv: list[str] | None = None) -> TrainerConfig:
    """Parses the command line (and ``TRAINWIRE_IMAGE_CACHE_DIR``) into a config."""
    parser = argparse.ArgumentParser(
        prog="python -m trainer_service", description="Trainwire trainer service."
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="TCP port; 0 picks a free one"
    )
    parser.add_argument(
        "--slots",
        type=_slots,
        default=1,
        help="training slots: jobs (or processes of multi-process jobs) that run at once; "
        "auto: one per visible GPU (with CUDA), else 1",
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="torch device: auto (CUDA when available, else CPU), cpu, cuda or cuda:N",
    )
    parser.add_argument(
        "--data-root",
        type=pathlib.Path,
        default=pathlib.Path("var/data"),
        help="directory that task model/dataset paths are relative to",
    )
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=5.0,
        help="seconds without an episode after which a heartbeat is sent",
    )
    parser.add_argument(
        "--detach-grace",
        type=float,
        default=60.0,
        help="seconds a job whose stream broke (gateway restart or crash) stays alive, blocked "
        "at its grant, for the gateway to re-attach; 0 cancels it at once",
    )
    parser.add_argument(
        "--image-cache-dir",
        type=pathlib.Path,
        default=None,
        help=f"cache decoded dataset images here (default: ${IMAGE_CACHE_ENV}, else off)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics on this port "
        "(0 picks a free one; default: off)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="interface of the metrics endpoint (loopback unless you say otherwise)",
    )
    tls = parser.add_argument_group("TLS", "the certificate files are re-read on SIGHUP")
    tls.add_argument(
        "--tls-cert", type=pathlib.Path, metavar="FILE", help="serve TLS with this PEM chain"
    )
    tls.add_argument(
        "--tls-key", type=pathlib.Path, metavar="FILE", help="the PEM private key of --tls-cert"
    )
    tls.add_argument(
        "--tls-client-ca",
        type=pathlib.Path,
        metavar="FILE",
        help="accept only callers whose client certificate this PEM CA signed (mutual TLS: "
        "only gateways holding one can start training)",
    )
    tls.add_argument(
        "--insecure",
        action="store_true",
        help="serve plaintext on a non-loopback --host (refused without it)",
    )
    parser.add_argument(
        "--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING, ...)"
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text: one line for people; json: one JSON object per line",
    )
    args = parser.parse_args(argv)
    cache = args.image_cache_dir
    if cache is None and os.environ.get(IMAGE_CACHE_ENV):
        cache = pathlib.Path(os.environ[IMAGE_CACHE_ENV])
    try:
        return TrainerConfig(
            host=args.host,
            port=args.port,
            slots=args.slots,
            device=args.device,
            data_root=args.data_root,
            heartbeat_s=args.heartbeat,
            detach_grace_s=args.detach_grace,
            image_cache_dir=cache,
            metrics_port=args.metrics_port,
            log_level=args.log_level,
            log_format=args.log_format,
            metrics_host=args.metrics_host,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            insecure=args.insecure,
        )
    except PlaintextRefused as exc:  # one line that says why and how, no usage block
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def main(argv: list[str] | None = None) -> int:
    """Runs the trainer until SIGTERM/SIGINT; returns the exit status."""
    config = parse_args(argv)
    configure_logging(config.log_level, config.log_format)
    tls: ServerTls | None = None
    if config.tls_cert is not None and config.tls_key is not None:
        try:
            tls = ServerTls(config.tls_cert, config.tls_key, config.tls_client_ca)
        except TlsFileError as exc:
            print(f"python -m trainer_service: error: {exc}", file=sys.stderr)
            return 2
    from trainer_service.providers._device import resolve_device, slot_devices

    try:
        device, description = resolve_device(config.device)
        devices, description = slot_devices(config.device, device, description, config.slots)
    except ValueError as exc:
        _LOGGER.error("%s", exc)
        return 2
    metrics = TrainerMetrics()
    runner = JobRunner(
        default_registry(),
        SlotPool(len(devices), devices),
        RunnerSettings(
            device=device,
            device_description=description,
            data_root=config.data_root,
            image_cache_dir=config.image_cache_dir,
            heartbeat_s=config.heartbeat_s,
            detach_grace_s=config.detach_grace_s,
        ),
        server_version=__version__,
        observer=metrics.jobs,
    )
    stop_requested = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        del frame
        _LOGGER.info("received %s: shutting down", signal.Signals(signum).name)
        stop_requested.set()

    def on_hangup(signum: int, frame: FrameType | None) -> None:
        del signum, frame
        if tls is not None:  # off the signal handler: it reads files and logs
            threading.Thread(target=tls.reload, name="trainer-tls-reload", daemon=True).start()

    # Installed before the ready line: a SIGTERM right after it is never lost.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)
    try:
        server, port = build_server(config, runner, metrics, tls)
        server.start()
    except (RuntimeError, OSError) as exc:
        _LOGGER.error("%s", exc)
        return 1
    print(f"trainer listening on {host_port(config.host, port)}", flush=True)
    if server.metrics_endpoint is not None:
        print(f"trainer metrics on {server.metrics_endpoint.url}", flush=True)
    _LOGGER.info(
        "trainer %s: %d slot(s) on %s, data root %s, image cache %s",
        __version__,
        len(devices),
        description,
        config.data_root,
        config.image_cache_dir or "off",
    )
    # Polled, not one blocking wait: a signal is delivered to whichever thread does not block
    # it (gRPC's, torch's), and Python runs its handler only when the main thread next runs
    # bytecode; a main thread asleep in one wait would never see a SIGTERM that landed
    # elsewhere.
    while not stop_requested.wait(0.25):
        pass
    stopped = server.stop(config.grace_s)
    # Bounded: a stop during the warm-up waits for the providers' import to finish (see stop).
    stopped.wait(config.grace_s + 60)
    if not runner.wait_idle(1.0):
        _LOGGER.warning("%d job(s) still stopping at exit", runner.active_jobs)
    _LOGGER.info("trainer stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
