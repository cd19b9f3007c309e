"""The real gateway (in-memory store) with the wire-level fake trainer behind it, served from a
thread for synchronous clients and the CLI, optionally behind a ``FaultProxy``.

``live_stack()`` is what client and CLI tests use. In the main venv it runs both in-process. In
the client-version venvs (``tests/integration/test_client_versions.py``), which hold the client
package and no gateway, ``TRAINWIRE_TEST_STACK_PYTHON`` names the services' python: the gateway
and the fake trainer then run in one subprocess of it (``python -m tests.fakes.serve_stack``),
and only the proxy runs here; ``LiveStack.fake`` is then None.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.fakes.waiting import TIMEOUT
from tests.fakes.watch_faults import FaultProxy, ThreadedServer, WatchFault

ROOT = Path(__file__).resolve().parents[2]
STACK_PYTHON = "TRAINWIRE_TEST_STACK_PYTHON"


def external() -> bool:
    """Whether the gateway runs in another venv's process (the client-version tests)."""
    return bool(os.environ.get(STACK_PYTHON))


@dataclass
class LiveStack:
    """A real gateway and how to reach it.

    Attributes:
        target: The gateway's address.
        fake: The fake trainer behind it (None when the gateway runs in another process).
        http: The base URL of the gateway's HTTP side ("" unless started with ``http_port=0``).
        proxies: Fault proxies started with ``proxy``.
    """

    target: str
    fake: Any = None
    http: str = ""
    proxies: list[FaultProxy] = field(default_factory=list)
    _start_proxy: Callable[[FaultProxy], None] | None = None

    def proxy(self, *faults: WatchFault) -> FaultProxy:
        """A ``FaultProxy`` in front of the gateway with these watch faults; its ``target``
        is where to point a client."""
        proxy = FaultProxy(self.target, list(faults))
        assert self._start_proxy is not None
        self._start_proxy(proxy)
        self.proxies.append(proxy)
        return proxy


@contextlib.contextmanager
def _proxies() -> Iterator[Callable[[FaultProxy], None]]:
    """Starts proxies on one private loop; stops them all on exit."""
    started: list[FaultProxy] = []

    async def nothing() -> tuple[None, int]:
        return None, 0

    async def stop_all() -> None:
        for proxy in started:
            await proxy.stop()

    with ThreadedServer(nothing, stop_all) as served:

        def start(proxy: FaultProxy) -> None:
            served.call(proxy.start())
            started.append(proxy)

        yield start


@contextlib.contextmanager
def _in_process(slots: int, **overrides: Any) -> Iterator[LiveStack]:
    from tests.fakes.fake_trainer import running_fake
    from tests.fakes.gateway_harness import running_gateway

    stack = contextlib.AsyncExitStack()
    urls: list[str] = []
    with running_fake(slots=slots) as fake:

        async def start() -> Any:
            client = await stack.enter_async_context(running_gateway((fake.address,), **overrides))
            urls.append(client.gateway.http.url if client.gateway.http is not None else "")
            return client.gateway.server, client.gateway.port

        with ThreadedServer(start, stack.aclose) as served, _proxies() as start_proxy:
            yield LiveStack(served.target, fake, urls[0], _start_proxy=start_proxy)


@contextlib.contextmanager
def _subprocess(slots: int, **overrides: Any) -> Iterator[LiveStack]:
    python = os.environ[STACK_PYTHON]
    args = [python, "-m", "tests.fakes.serve_stack", "--slots", str(slots)]
    for key, value in overrides.items():
        args += ["--set", f"{key}={value!r}"]
    proc = subprocess.Popen(
        args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", STACK_PYTHON)},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        match = re.fullmatch(r"stack listening on (127\.0\.0\.1:\d+)\n", line)
        assert match, f"unexpected first line {line!r}"
        with _proxies() as start_proxy:
            yield LiveStack(match.group(1), None, _start_proxy=start_proxy)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()  # serve_stack stops on EOF
        try:
            proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@contextlib.contextmanager
def live_stack(slots: int = 8, **overrides: Any) -> Iterator[LiveStack]:
    """A real gateway on 127.0.0.1:0 (``running_gateway``'s settings and ``overrides``) with a
    fake trainer of ``slots`` slots behind it."""
    opened = _subprocess if external() else _in_process
    with opened(slots, **overrides) as stack:
        yield stack
