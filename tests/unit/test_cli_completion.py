"""``trainwire completion bash|zsh``: scripts generated from the parser tree that complete
commands, flags and file values, checked by running them in the real shells."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from trainwire.cli import build_parser, main
from trainwire.cli._completion import script
from trainwire.cli._help import commands

BASH_CASES = [
    ("trainwire ''", "runs pause resume stop speed set watch plot compare avatar completion"),
    ("trainwire ru", "runs"),
    ("trainwire runs c", "create checkpoints"),
    ("trainwire --gateway gw:1 runs create ''", "imitation grpo"),
    ("trainwire runs create grpo --lora-r", "--lora-rank"),
    ("trainwire --timeout 3 runs create imitation --cl", "--clip"),
    ("trainwire watch RUN --ti", "--timeout"),  # a global flag after the command
    ("trainwire completion ''", "bash zsh"),
    ("trainwire runs download RUN --out cur", "curve.png"),  # a file flag's value
    ("trainwire runs get RUN --gateway ''", ""),  # a value flag: no command words
]


def _bash(tmp_path: Path, words: str) -> str:
    (tmp_path / "tw.bash").write_text(script(build_parser(), "bash"))
    (tmp_path / "curve.png").write_text("")
    program = (
        "source tw.bash\n"
        f"COMP_WORDS=({words})\n"
        "COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))\n"
        "_trainwire\n"
        'echo "${COMPREPLY[*]}"\n'
    )
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", program],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stderr == ""
    return done.stdout.strip()


@pytest.mark.parametrize(("words", "offered"), BASH_CASES)
def test_bash_completes_commands_flags_and_files(tmp_path: Path, words: str, offered: str) -> None:
    assert _bash(tmp_path, words) == offered


def test_the_scripts_hold_every_command_and_flag() -> None:
    parser = build_parser()
    for shell in ("bash", "zsh"):
        text = script(parser, shell)
        for path, command in commands(parser):
            assert f'"{" ".join(path)}")' in text, (shell, path)
            for action in command._actions:
                for flag in action.option_strings:
                    assert flag in text, (shell, path, flag)


def _flags(path: tuple[str, ...]) -> list[str]:
    (command,) = [c for p, c in commands(build_parser()) if p == path]
    return [flag for action in command._actions for flag in action.option_strings]


def test_zsh_completes_commands_flags_and_files(tmp_path: Path) -> None:
    assert shutil.which("zsh"), "zsh is not installed: `make install` installs it (apt-get, root)"
    (tmp_path / "tw.zsh").write_text(script(build_parser(), "zsh"))
    program = (
        # The completion system's functions, recorded instead of drawn.
        'compadd() { [[ $1 == -- ]] && shift; print -r -- "compadd $*"; }\n'
        '_describe() { print -r -- "describe ${(P)4}"; }\n'
        '_files() { print -r -- "files"; }\n'
        'compdef() { print -r -- "compdef $*"; }\n'
        "source tw.zsh\n"
        't() { words=("$@"); CURRENT=${#words}; _trainwire; }\n'
        "t trainwire runs create ''\n"
        "t trainwire runs create grpo --lora-r\n"
        "t trainwire --timeout 3 runs download RUN --out ''\n"
    )
    done = subprocess.run(
        ["zsh", "-f", "-c", program],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stderr == ""
    assert done.stdout.splitlines() == [
        "compdef _trainwire trainwire",
        "describe imitation:an avatar learns to imitate a motion clip "
        "grpo:fine-tune a vision-language model with GRPO",
        "compadd " + " ".join(_flags(("runs", "create", "grpo"))),
        "files",
    ]


def test_the_command_needs_no_gateway(capsys: pytest.CaptureFixture[str]) -> None:
    # An address nothing listens on: the command must not dial it.
    assert main(["--gateway", "127.0.0.1:1", "--timeout", "0.1", "completion", "bash"]) == 0
    out = capsys.readouterr().out
    assert out == script(build_parser(), "bash")
    assert out.endswith("complete -F _trainwire trainwire\n")
    assert main(["completion", "fish"]) == 2
