"""Every ``trainwire`` command that README.md, docs/ (and the other markdown: CONTRIBUTING.md,
clients/README.md) show parses with the real CLI parser.

The commands are parsed, never run: ``build_parser().parse_args`` with stdout and stderr caught;
``--help`` (exit 0) passes, a usage error (exit 2: an unknown command or flag, a missing
required flag, a bad value) fails and is listed with its file, line and argparse's message.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from gateway.__main__ import build_parser as gateway_parser
from gateway.tools.migrate import build_parser as migrate_parser
from tests.docs.doc_examples import Example, documents, examples_in, service_examples_in
from trainer_service.__main__ import build_parser as trainer_parser
from trainwire.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def parse_error(example: Example, service: bool = False) -> str | None:
    """argparse's complaint about an example, or None when it parses (``service``: a
    ``python -m gateway|trainer_service`` example, its argv led by the service's name)."""
    argv = list(example.argv)
    if service:
        name, argv = argv[0], [word for word in argv[1:] if word != "..."]  # "and so on"
        if name == "gateway" and argv[:1] == ["migrate"]:
            parser, argv = migrate_parser(), argv[1:]
        else:
            parser = gateway_parser({}) if name == "gateway" else trainer_parser({})
    else:
        parser = build_parser()
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            if exc.code not in (0, None):
                lines = stderr.getvalue().strip().splitlines()
                return lines[-1] if lines else f"exit {exc.code}"
    return None


def test_every_documented_command_parses() -> None:
    paths = documents(ROOT)
    assert ROOT / "README.md" in paths and ROOT / "docs" / "reference" / "cli.md" in paths
    found = [example for path in paths for example in examples_in(path, ROOT)]
    # The generated CLI reference alone shows dozens; an extractor that finds none is broken.
    assert len(found) >= 40, [str(e) for e in found]
    bad = [f"{example}\n    {error}" for example in found if (error := parse_error(example))]
    assert not bad, "documented commands the CLI refuses:\n" + "\n".join(bad)


def test_every_documented_service_command_parses() -> None:
    found = [example for path in documents(ROOT) for example in service_examples_in(path, ROOT)]
    services = {example.argv[0] for example in found}
    assert services == {"gateway", "trainer_service"}, [str(e) for e in found]
    assert len(found) >= 10, [str(e) for e in found]
    bad = [f"{e}\n    {error}" for e in found if (error := parse_error(e, service=True))]
    assert not bad, "documented service commands their parsers refuse:\n" + "\n".join(bad)


def test_a_wrong_service_flag_is_refused(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```bash\nGW=1 .venv/bin/python -m gateway --port 0 --no-such-flag 3 | tee log\n"
        "python -m trainer_service --slots auto\n```\n"
    )
    wrong, right = service_examples_in(doc)
    assert wrong.argv == ("gateway", "--port", "0", "--no-such-flag", "3")
    assert "unrecognized arguments: --no-such-flag" in (parse_error(wrong, service=True) or "")
    assert parse_error(right, service=True) is None


def _examples(tmp_path: Path, text: str) -> list[Example]:
    doc = tmp_path / "doc.md"
    doc.write_text(text)
    return examples_in(doc)


def test_commands_are_found_in_shell_blocks_with_continuations(tmp_path: Path) -> None:
    found = _examples(
        tmp_path,
        "Text trainwire runs list is prose.\n"
        "```bash\n"
        "$ trainwire runs create imitation \\\n"
        "    --clip wave --episodes 50   # a comment\n"
        'RUN=$(trainwire runs create imitation --clip walk -q) && trainwire watch "$RUN"\n'
        "trainwire runs list --json | jq '.runs[0]' > first.json\n"
        "trainwire runs rename RUN ''\n"
        "echo trainwire stop RUN\n"
        "```\n"
        "```python\n"
        "trainwire speed RUN 2\n"
        "```\n"
        "```text\n"
        "trainwire 0.1.0\n"
        "```\n"
        "```console\n"
        "$ trainwire --version\n"
        "trainwire 0.1.0\n"
        "```\n",
    )
    assert [(e.line, e.argv) for e in found] == [
        (3, ("runs", "create", "imitation", "--clip", "wave", "--episodes", "50")),
        (5, ("runs", "create", "imitation", "--clip", "walk", "-q")),
        (5, ("watch", "$RUN")),
        (6, ("runs", "list", "--json")),
        (7, ("runs", "rename", "RUN", "")),
        (17, ("--version",)),
    ]


@pytest.mark.parametrize(
    ("command", "refused"),
    [
        ("trainwire runs create imitation --clip wave", False),
        ("trainwire runs get <run-id>", False),
        ("trainwire watch RUN --help", False),
        ("trainwire runs create imitation --clip wave --learning_rate 0.1", True),
        ("trainwire runs create grpo --model m", True),  # --dataset is required
        ("trainwire runs show RUN", True),
        ("trainwire speed RUN fast", True),
    ],
)
def test_a_wrong_example_is_refused(tmp_path: Path, command: str, refused: bool) -> None:
    (example,) = _examples(tmp_path, f"```\n{command}\n```\n")
    assert (parse_error(example) is not None) is refused
