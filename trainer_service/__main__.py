"""Command line entry point: ``python -m trainer_service --host ... --port ... --slots ...``.

Parses flags into a ``TrainerConfig``, sets up logging (``--log-format text|json``), imports the
``--reward-module`` modules (one that does not import: exit status 2 and one line saying why),
resolves the device, starts the server and prints ``trainer listening on HOST:PORT`` (and, with
``--metrics-port``, ``trainer metrics on http://HOST:PORT/metrics``). SIGTERM/SIGINT stop
accepting calls, stop running jobs at their next episode and exit within a few seconds.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence

from trainer_service import __version__
from trainer_service.config import TrainerConfig
from trainer_service.core.jobs import JobRunner, RunnerSettings
from trainer_service.core.slots import SlotPool
from trainer_service.gpus import GpuProbe, cuda_indices
from trainer_service.metrics import TrainerMetrics
from trainer_service.providers import default_registry
from trainer_service.scratch import TrainerScratch
from trainer_service.server import build_server, open_checkpoint_store
from trainwire_ops import heap, settings
from trainwire_ops.addresses import host_port
from trainwire_ops.checkpoints import CheckpointStoreProblem
from trainwire_ops.logs import announce, configure_logging
from trainwire_ops.signals import SignalInbox
from trainwire_ops.tls import PlaintextRefused, ServerTls, TlsFileError

# Under ``python -m`` __name__ is "__main__"; log under the module's real name.
_LOGGER = logging.getLogger(__spec__.name if __spec__ is not None else __name__)

DEFAULT_PORT = 50052
IMAGE_CACHE_ENV = "TRAINWIRE_IMAGE_CACHE_DIR"


ENV_PREFIX = "TRAINWIRE_TRAINER_"


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The command line: one flag per field of ``TrainerConfig``, each also read from
    ``TRAINWIRE_TRAINER_<FLAG>`` (``environ``, default ``os.environ``); the image cache also from
    ``TRAINWIRE_IMAGE_CACHE_DIR``, an alias that deployments set."""
    env = dict(os.environ if environ is None else environ)
    if IMAGE_CACHE_ENV in env:
        env.setdefault(f"{ENV_PREFIX}IMAGE_CACHE_DIR", env[IMAGE_CACHE_ENV])
    return settings.build_parser(
        TrainerConfig,
        prog="python -m trainer_service",
        description="Trainwire trainer service: runs training jobs and streams their episodes.",
        env_prefix=ENV_PREFIX,
        environ=env,
    )


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> TrainerConfig:
    """Parses the command line (and the environment) into a config; exits 2 with one line on a
    bad flag, variable or combination."""
    parser = build_parser(environ)
    args = parser.parse_args(argv)
    try:
        return settings.config_from_args(TrainerConfig, args)
    except PlaintextRefused as exc:  # one line that says why and how, no usage block
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def main(argv: list[str] | None = None) -> int:
    """Runs the trainer until SIGTERM/SIGINT; returns the exit status."""
    # Start-up imports torch: the cyclic collector paused meanwhile, what it made frozen once
    # the server runs, or as it returns early (trainwire_ops.heap).
    with heap.paused_then_frozen():
        config = parse_args(argv)
        configure_logging(config.log_level, config.log_format)
        tls: ServerTls | None = None
        if config.tls_cert is not None and config.tls_key is not None:
            try:
                tls = ServerTls(config.tls_cert, config.tls_key, config.tls_client_ca)
            except TlsFileError as exc:
                print(f"python -m trainer_service: error: {exc}", file=sys.stderr)
                return 2
        try:
            checkpoint_store = open_checkpoint_store(config)
        except CheckpointStoreProblem as exc:
            print(f"python -m trainer_service: error: {exc}", file=sys.stderr)
            return 2
        from trainer_service.providers.grpo.reward_modules import (
            RewardModuleError,
            canonical_spec,
            load_reward_modules,
        )

        reward_modules = tuple(canonical_spec(spec) for spec in config.reward_modules)
        try:  # the operator's code: a module that does not import stops the trainer here
            rewards = load_reward_modules(reward_modules)
        except RewardModuleError as exc:
            print(f"python -m trainer_service: error: {exc}", file=sys.stderr)
            return 2
        from trainer_service.providers._device import resolve_device, slot_devices, torch_gpus

        try:
            device, description = resolve_device(config.device)
            devices, description = slot_devices(config.device, device, description, config.slots)
        except ValueError as exc:
            _LOGGER.error("%s", exc)
            return 2
        try:  # the local scratch of this trainer and its jobs (trainer_service.scratch)
            scratch = TrainerScratch()
        except OSError as exc:
            print(f"python -m trainer_service: error: scratch directory: {exc}", file=sys.stderr)
            return 2
        metrics = TrainerMetrics()
        runner = JobRunner(
            default_registry(),
            SlotPool(len(devices), devices),
            RunnerSettings(
                device=device,
                device_description=description,
                data_roots=config.data_roots,
                image_cache_dir=config.image_cache_dir,
                heartbeat_s=config.heartbeat_s,
                detach_grace_s=config.detach_grace_s,
                rendezvous_host=config.rendezvous_host,
                reward_modules=reward_modules,
                scratch_dir=scratch.path,
            ),
            server_version=__version__,
            observer=metrics.jobs,
            checkpoint_store=checkpoint_store,
            gpus=GpuProbe(cuda_indices(devices), torch_gpus),
        )
        # Installed before the ready line: a SIGTERM right after it is never lost.
        inbox = SignalInbox((signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
        try:
            server, port = build_server(config, runner, metrics, tls)
            server.start()
        except (RuntimeError, OSError) as exc:
            _LOGGER.error("%s", exc)
            scratch.close()
            return 1
    announce(f"trainer listening on {host_port(config.host, port)}")
    if server.metrics_endpoint is not None:
        announce(f"trainer metrics on {server.metrics_endpoint.url}")
    _LOGGER.info(
        "trainer %s: %d slot(s) on %s, data roots %s, image cache %s, checkpoint store %s, "
        "rendezvous host %s, custom rewards %s, scratch %s",
        __version__,
        len(devices),
        description,
        ", ".join(str(root) for root in config.data_roots),
        config.image_cache_dir or "off",
        checkpoint_store.location,
        config.rendezvous_host,
        ", ".join(rewards) or "none",
        scratch.path,
    )
    for gone in scratch.swept:
        _LOGGER.info("removed the scratch directory %s of a trainer that is gone", gone)
    while (received := inbox.next()) is signal.SIGHUP:
        if tls is not None:  # off the main thread: it reads files and logs
            threading.Thread(target=tls.reload, name="trainer-tls-reload", daemon=True).start()
    assert received is not None
    _LOGGER.info("received %s: shutting down", received.name)
    stopped = server.stop(config.grace_s)
    # Bounded: a stop during the warm-up waits for the providers' import to finish (see stop).
    stopped.wait(config.grace_s + 60)
    idle = runner.wait_idle(1.0)
    if not idle:  # its scratch stays for it; the next trainer here sweeps it once it is gone
        _LOGGER.warning("%d job(s) still stopping at exit", runner.active_jobs)
    scratch.close(remove=idle)
    _LOGGER.info("trainer stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
