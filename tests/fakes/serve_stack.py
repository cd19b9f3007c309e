"""``python -m tests.fakes.serve_stack``: the real gateway (in-memory store) and the fake
trainer in one process, for tests that run in a venv without the services
(``tests/fakes/live.py``). Prints ``stack listening on HOST:PORT``; stops when stdin closes."""

from __future__ import annotations

import argparse
import ast
import asyncio
import sys

from tests.fakes.fake_trainer import running_fake
from tests.fakes.gateway_harness import running_gateway


async def _serve(slots: int, overrides: dict[str, object]) -> None:
    with running_fake(slots=slots) as fake:
        async with running_gateway((fake.address,), **overrides) as client:
            print(f"stack listening on {client.address}", flush=True)
            await asyncio.to_thread(sys.stdin.read)  # until the test closes our stdin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--set", action="append", default=[], help="KEY=PYTHON_LITERAL")
    args = parser.parse_args()
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = ast.literal_eval(value)
    asyncio.run(_serve(args.slots, overrides))


if __name__ == "__main__":
    main()
