"""How a GRPO job's DataLoader workers start: forked from a rank (which never loads gRPC), from a
fork server in a process that has gRPC; named after their rank; holding none of the rank's
channel to its trainer."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import types
from typing import Any

import grpc
import pytest

from tests.fakes.waiting import TIMEOUT
from tests.grpo_fixtures import rank_in_title
from trainer_service.providers.grpo import lifeline, settings


def _titled(title: str) -> Any:
    return types.SimpleNamespace(cmdline=lambda: title.split(" "))


def test_a_process_without_grpc_forks_its_workers_and_one_with_grpc_uses_a_fork_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert grpc is sys.modules["grpc"]
    assert settings.worker_start_method() == "forkserver"
    monkeypatch.delitem(sys.modules, "grpc")
    assert settings.worker_start_method() == "fork"


def test_a_worker_is_named_after_its_rank_and_never_taken_for_one() -> None:
    rank = "trainer_service.providers.grpo.worker (GRPO rank 1, trainer 4242)"
    worker = lifeline.worker_title(rank, 0)
    assert worker == (
        "trainer_service.providers.grpo.worker (GRPO rank 1, DataLoader worker 0, trainer 4242)"
    )
    assert rank_in_title(_titled(rank)) == 1
    assert rank_in_title(_titled(worker)) is None
    server = "python -c from multiprocessing.forkserver import main; main(5, 7, ['torch'])"
    assert lifeline.worker_title(server, 0) == server


# A rank's channel end (the descriptor in argv[1]) and a child forked from it: the child lets go
# of the channel as a rank's registered hook makes it, so its peer reads end of file once the
# rank's own copy closes, while the child still runs.
_RANK = r"""
import functools, os, sys, time
from trainer_service.providers.grpo import lifeline
fd = int(sys.argv[1])
os.register_at_fork(after_in_child=functools.partial(lifeline.release_in_child, fd))
child = os.fork()
if child == 0:
    same = os.path.samestat(os.fstat(fd), os.stat(os.devnull))
    os.write(1, b"released\n" if same else b"held\n")  # one write: the lines never interleave
    time.sleep(60)
    os._exit(0)
os.close(fd)
os.write(1, b"%d\n" % child)
time.sleep(60)
"""


def test_a_child_forked_from_a_rank_holds_none_of_its_channel() -> None:
    rank_end, trainer_end = socket.socketpair()
    process = subprocess.Popen(
        [sys.executable, "-c", _RANK, str(rank_end.fileno())],
        pass_fds=(rank_end.fileno(),),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the rank and its child: one group to kill
    )
    rank_end.close()
    try:
        assert process.stdout is not None
        said = {process.stdout.readline().strip(), process.stdout.readline().strip()}
        assert "released" in said, (said, process.poll() is not None and process.stderr.read())
        child = int(next(s for s in said if s.isdigit()))
        trainer_end.settimeout(TIMEOUT)
        assert trainer_end.recv(1) == b""  # the rank's copy closed; the child holds none
        os.kill(child, 0)  # ... and the child still runs
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(TIMEOUT)
        trainer_end.close()
