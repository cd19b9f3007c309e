"""The rank launcher (``launch.spawn_rank``): a rank forks from the trainer's fork server, joins
its job's process group, takes its environment and runs its module as it would alone.

The ranks here run ``tests.fakes.echo_rank``, which reports what it was given.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from typing import Any

import psutil
import pytest

from tests.fakes import echo_rank
from tests.fakes.waiting import TIMEOUT, wait_for
from tests.grpo_fixtures import rank_in_title
from trainer_service.core.provider import ProviderError
from trainer_service.providers.grpo import launch, wire

pytestmark = pytest.mark.slow

ECHOED = "RANK,WORLD_SIZE,ECHO_MARK"


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[BaseProcess, wire.ChannelEnd]]]:
    """Ranks of ``tests.fakes.echo_rank``; every one is gone after the test."""
    monkeypatch.setattr(launch, "WORKER_MODULE", echo_rank.MODULE)
    ranks: list[tuple[BaseProcess, wire.ChannelEnd]] = []
    yield ranks
    for process, channel in ranks:
        channel.close()
        process.join(TIMEOUT)
        if process.exitcode is None and process.pid is not None:
            os.kill(process.pid, signal.SIGKILL)
            process.join(TIMEOUT)


def _env(rank: int, **extra: str) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": "1", "ECHO_NAMES": ECHOED, "ECHO_MARK": "x", **extra}
    return launch.rank_env(env, rank, 2)


def _report(channel: wire.ChannelEnd) -> dict[str, Any]:
    message = channel.recv()
    assert message is not None and message[0] == wire.END, message
    return dict(json.loads(message[1]))


def _fresh_start_method() -> str:
    code = "import multiprocessing; print(multiprocessing.get_start_method())"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=TIMEOUT
    ).stdout.strip()


def test_ranks_fork_from_the_launcher_into_one_group_with_their_environment(
    started: list[tuple[BaseProcess, wire.ChannelEnd]], capfd: pytest.CaptureFixture[str]
) -> None:
    first = launch.spawn_rank(_env(0), None, 0)
    started.append(first)
    assert first[0].pid is not None
    second = launch.spawn_rank(_env(1), first[0].pid, 1)
    started.append(second)
    reports = [_report(channel) for _, channel in started]
    leader = first[0].pid
    launcher = reports[0]["ppid"]
    for rank, ((process, _), report) in enumerate(zip(started, reports, strict=True)):
        assert report["pid"] == process.pid
        # One group, led by rank 0, that is not this process's: one killpg ends the job.
        assert report["pgid"] == leader != os.getpgrp()
        # Forked by the launcher, a child of this process that loaded the training stack.
        assert report["ppid"] == launcher != os.getpid()
        assert psutil.Process(launcher).ppid() == os.getpid()
        assert report["torch_loaded"] and report["threads"] == 1
        assert report["env"] == {"RANK": str(rank), "WORLD_SIZE": "2", "ECHO_MARK": "x"}
        assert report["argv"][1:5] == ["--fd", report["argv"][2], "--parent-pid", str(launcher)]
        assert report["argv"][0].endswith("echo_rank.py") and len(report["argv"]) == 5
        # multiprocessing as in a fresh interpreter: its own default, free to start workers.
        assert report["start_method"] == _fresh_start_method()
        assert report["daemon"] is False
        title = " ".join(psutil.Process(report["pid"]).cmdline())
        assert rank_in_title(psutil.Process(report["pid"])) == rank
        assert title.startswith(echo_rank.MODULE) and f"trainer {os.getpid()})" in title
    for process, channel in started:
        channel.close()
        process.join(TIMEOUT)
        assert process.exitcode == 0
    # Both streams of a rank go to the trainer's stderr: its stdout carries announcements only.
    out, err = capfd.readouterr()
    assert "ECHO_" not in out
    assert err.count("ECHO_STDOUT") == 2 and err.count("ECHO_STDERR") == 2


def test_rank_0_gets_the_rendezvous_socket_as_its_listen_fd(
    started: list[tuple[BaseProcess, wire.ChannelEnd]],
) -> None:
    listener = launch.rendezvous_listener("127.0.0.1")
    port = listener.getsockname()[1]
    started.append(launch.spawn_rank(_env(0), None, 0, listener))
    listener.close()  # rank 0 holds it now
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as peer:
        peer.sendall(b"hello from a peer\n")
        report = _report(started[0][1])
    assert report["listened"] == "hello from a peer"
    assert report["argv"][5] == "--listen-fd"


def test_a_rank_that_cannot_join_its_group_is_refused_and_gone(
    started: list[tuple[BaseProcess, wire.ChannelEnd]],
) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait(TIMEOUT)
    with pytest.raises(ProviderError) as info:
        launch.spawn_rank(_env(1), gone.pid, 1)
    assert info.value.reason == "PROCESS_DIED"
    assert info.value.user_message == "The trainer could not start a training process."
    assert f"never joined process group {gone.pid}" in info.value.detail


def test_a_launcher_that_died_is_started_again(
    started: list[tuple[BaseProcess, wire.ChannelEnd]],
) -> None:
    started.append(launch.spawn_rank(_env(0), None, 0))
    first = _report(started[0][1])
    assert psutil.Process(first["ppid"]).ppid() == os.getpid()  # the launcher, nothing else
    os.kill(first["ppid"], signal.SIGKILL)
    # Its zombie shows before it can be reaped (its threads are still exiting): a start in
    # that window meets the dead launcher and must be made again, not fail.
    wait_for(
        lambda: not psutil.pid_exists(first["ppid"]) or _zombie(first["ppid"]), "the launcher gone"
    )
    started.append(launch.spawn_rank(_env(0), None, 0))
    again = _report(started[1][1])
    assert again["ppid"] != first["ppid"] and again["torch_loaded"]


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_temporary_directory_too_deep_for_sockets_is_named_in_the_error(
    tmp_path: pathlib.Path,
) -> None:
    # The launcher's socket goes in TMPDIR (multiprocessing's pymp-* folder): a fresh process,
    # whose multiprocessing has not chosen its folder yet.
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    code = (
        "from trainer_service.core.provider import ProviderError\n"
        "from trainer_service.providers.grpo import launch\n"
        "try:\n"
        "    launch.spawn_rank(launch.rank_env({}, 0, 1), None, 0)\n"
        "except ProviderError as exc:\n"
        "    print(exc.reason, exc.code, exc.detail, sep='\\n')\n"
        "    print(exc.user_message)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TMPDIR": str(deep)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    reason, code_name, detail, message = done.stdout.splitlines()
    assert (reason, code_name) == ("PROCESS_DIED", "INTERNAL"), done.stderr
    assert "AF_UNIX path too long" in detail
    assert message == (
        f"The trainer could not start a training process: its temporary directory {deep} is "
        "too deep for the Unix sockets of its job processes (a socket path has at most 107 "
        "bytes); give the trainer a shorter TMPDIR."
    )
