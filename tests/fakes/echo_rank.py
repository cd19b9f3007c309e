"""A rank that reports how it was started and exits: what the launcher gave it.

``python -m tests.fakes.echo_rank --fd N --parent-pid P [--listen-fd L]``, run once a test
points ``launch.WORKER_MODULE`` here. It sends one ``END`` message whose payload is a JSON
object: its command line, process group, parent, environment variables named in
``ECHO_NAMES``, torch's thread count, the start method multiprocessing would use, what it
reads from ``--listen-fd`` (one line). It writes ``ECHO_STDOUT``/``ECHO_STDERR`` to its stdout
and stderr, and exits once the test closes the channel.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys

from trainer_service.providers.grpo import wire

MODULE = "tests.fakes.echo_rank"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--listen-fd", type=int)
    args = parser.parse_args()
    torch = sys.modules.get("torch")
    listened = None
    if args.listen_fd is not None:
        with socket.socket(fileno=args.listen_fd) as listener:
            peer, _ = listener.accept()
            with peer:
                listened = peer.makefile().readline().strip()
    names = os.environ.get("ECHO_NAMES", "").split(",")
    report = {
        "argv": sys.argv,
        "pid": os.getpid(),
        "pgid": os.getpgrp(),
        "ppid": os.getppid(),
        "env": {name: os.environ.get(name) for name in names},
        "threads": torch.get_num_threads() if torch is not None else None,
        "torch_loaded": torch is not None,
        "start_method": multiprocessing.get_start_method(),
        "listened": listened,
        "daemon": multiprocessing.current_process().daemon,
    }
    end = wire.ChannelEnd.from_fd(args.fd)
    print("ECHO_STDOUT", flush=True)
    print("ECHO_STDERR", file=sys.stderr, flush=True)
    end.send_json(wire.END, report)
    end.recv()  # until the test has looked at the process
    end.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
