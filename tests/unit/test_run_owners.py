"""Every piece of a run's state has one owner, and nobody assigns another object's fields.

A ``TrainingRun`` is changed only through its methods, each called only by the piece of the
gateway that owns that part of the run:

- published progress (``record_episode``): the publisher;
- received progress (``received_through``): the trainer feed (and the driver, which starts it
  over at the published episode after a gateway restart); checkpoint progress
  (``checkpointed``): the checkpoint ledger;
- the lifecycle (the state and what goes with it): the driver, the shell of the state machine,
  with its parts for the end (``Closing``) and for restarts (``Failures``);
- identity: set when the catalog creates the run; later the task (live hyperparameters) and the
  metadata (UpdateRun) change only through the driver.

Everyone else reads snapshots or tells the driver. This test reads the gateway's source and
fails on any other write, naming the module, the line and the field.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import gateway
from gateway.core.runs import TrainingRun

FIELDS = {f.name for f in dataclasses.fields(TrainingRun)}
#: Not stored: what a snapshot says to people; any holder of a snapshot may fill it in.
FREE = {"state_detail"}

#: Method -> the modules (under ``gateway``) that may call it on a run.
OWNERS: dict[str, set[str]] = {
    "record_episode": {"core/publisher.py"},
    "received_through": {"core/feed.py", "core/driver.py"},
    "checkpointed": {"core/ledger.py"},
    "start": {"core/driver.py"},
    "pause": {"core/driver.py"},
    "resume": {"core/driver.py"},
    "stop": {"core/driver.py"},
    "set_speed": {"core/driver.py"},
    "complete": {"core/driver.py", "core/closing.py"},
    "fail": {"core/driver.py", "core/closing.py"},
    "placed": {"core/driver.py"},
    "park": {"core/driver.py"},
    "restarted": {"core/failures.py"},
    "retask": {"core/driver.py"},
    "relabel": {"core/driver.py"},
}
#: The catalog builds a new run's record before anyone else can see it.
CREATOR = "core/catalog.py"

ROOT = Path(gateway.__file__).parent


def _run_like(node: ast.expr) -> bool:
    """``run``, ``self.run``, ``self._run``, ``driver.run``: an expression naming a live run."""
    if isinstance(node, ast.Name):
        return node.id in {"run", "_run"}
    if isinstance(node, ast.Attribute):
        return node.attr in {"run", "_run"}
    return False


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found: list[ast.expr] = []
        for target in node.targets:
            found.extend(target.elts if isinstance(target, ast.Tuple) else [target])
        return found
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def _writes(module: str, tree: ast.AST) -> list[str]:
    bad = []
    for node in ast.walk(tree):
        for target in _targets(node):
            if (
                isinstance(target, ast.Attribute)
                and target.attr in FIELDS - FREE
                and _run_like(target.value)
                and module != CREATOR
            ):
                bad.append(f"{module}:{node.lineno} assigns run.{target.attr}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in OWNERS
            and _run_like(node.func.value)
            and module not in OWNERS[node.func.attr]
        ):
            bad.append(f"{module}:{node.lineno} calls run.{node.func.attr}()")
    return bad


def test_only_the_owner_of_a_runs_state_changes_it() -> None:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        if module == "core/runs.py":
            continue
        bad.extend(_writes(module, ast.parse(path.read_text(), str(path))))
    assert bad == []


def test_the_check_sees_a_write_from_outside_its_owner() -> None:
    source = "def f(driver):\n    driver.run.episode = 3\n    driver.run.park()\n"
    assert _writes("core/scheduler.py", ast.parse(source)) == [
        "core/scheduler.py:2 assigns run.episode",
        "core/scheduler.py:3 calls run.park()",
    ]
    assert _writes("core/driver.py", ast.parse("def f(run):\n    run.park()\n")) == []
