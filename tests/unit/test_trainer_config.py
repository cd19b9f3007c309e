"""The trainer's config dataclass and command line parsing."""

from __future__ import annotations

import pathlib

import pytest

from trainer_service.__main__ import IMAGE_CACHE_ENV, parse_args
from trainer_service.config import TrainerConfig


def test_defaults_are_valid() -> None:
    config = TrainerConfig()
    assert (config.host, config.port, config.slots, config.device) == (
        "127.0.0.1",
        50052,
        1,
        "auto",
    )
    assert config.image_cache_dir is None
    assert config.address == "127.0.0.1:50052"
    assert TrainerConfig(host="::1", port=0).address == "[::1]:0"


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("port", 70000, "port"),
        ("slots", 0, "slots"),
        ("device", "tpu", "device"),
        ("heartbeat_s", 0.0, "heartbeat"),
        ("heartbeat_s", float("nan"), "heartbeat"),
        ("host", "", "host"),
    ],
)
def test_bad_values_are_rejected(field: str, value: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        TrainerConfig(**{field: value})  # type: ignore[arg-type]


def test_parse_args(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(IMAGE_CACHE_ENV, raising=False)
    config = parse_args(
        [
            *("--port", "0", "--slots", "3", "--device", "cuda:1"),
            *("--heartbeat", "0.05", "--data-root", "/tmp/data"),
        ]
    )
    assert (config.port, config.slots, config.device, config.heartbeat_s) == (0, 3, "cuda:1", 0.05)
    assert config.data_roots == (pathlib.Path("/tmp/data"),)
    assert config.image_cache_dir is None
    assert TrainerConfig().data_roots == (pathlib.Path("var/data"),)


def test_data_root_may_be_given_several_times_and_the_first_use_replaces_the_default() -> None:
    many = ["--data-root", "/srv/data", "--data-root", "/lustre/sets", "--data-root", "/gpfs/x"]
    expected = tuple(pathlib.Path(p) for p in ("/srv/data", "/lustre/sets", "/gpfs/x"))
    assert parse_args(many, {}).data_roots == expected
    # The variable holds several roots as PATH does; the command line replaces them all.
    environ = {"TRAINWIRE_TRAINER_DATA_ROOT": "/srv/data:/lustre/sets"}
    assert parse_args([], environ).data_roots == expected[:2]
    assert parse_args(["--data-root", "/gpfs/x"], environ).data_roots == expected[2:]
    with pytest.raises(ValueError, match="data-root"):
        TrainerConfig(data_roots=())


def test_image_cache_dir_from_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(IMAGE_CACHE_ENV, "/tmp/from-env")
    assert parse_args([]).image_cache_dir == pathlib.Path("/tmp/from-env")
    flag = parse_args(["--image-cache-dir", "/tmp/from-flag"])
    assert flag.image_cache_dir == pathlib.Path("/tmp/from-flag")


def test_every_flag_also_comes_from_the_environment_and_the_command_line_wins() -> None:
    environ = {
        "TRAINWIRE_TRAINER_SLOTS": "auto",
        "TRAINWIRE_TRAINER_HEARTBEAT": "2.5",
        "TRAINWIRE_TRAINER_DATA_ROOT": "/srv/data",
        "TRAINWIRE_TRAINER_METRICS_PORT": "0",
        "TRAINWIRE_TRAINER_INSECURE": "true",
    }
    config = parse_args([], environ)
    assert (config.slots, config.heartbeat_s, config.metrics_port) == ("auto", 2.5, 0)
    assert config.data_roots == (pathlib.Path("/srv/data"),) and config.insecure
    assert parse_args(["--slots", "2", "--metrics-port", "-1"], environ).slots == 2
    assert parse_args(["--metrics-port", "-1"], environ).metrics_port is None
    # The older variable of the image cache still works; the new one wins over it.
    old = {IMAGE_CACHE_ENV: "/tmp/old"}
    assert parse_args([], old).image_cache_dir == pathlib.Path("/tmp/old")
    both = {**old, "TRAINWIRE_TRAINER_IMAGE_CACHE_DIR": "/tmp/new"}
    assert parse_args([], both).image_cache_dir == pathlib.Path("/tmp/new")
    assert parse_args([], {IMAGE_CACHE_ENV: ""}).image_cache_dir is None


def test_help_shows_each_default_and_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--help"], {})
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag, default, env in (
        ("--slots", "1", "TRAINWIRE_TRAINER_SLOTS"),
        ("--detach-grace", "60.0", "TRAINWIRE_TRAINER_DETACH_GRACE"),
        ("--tls-client-ca", "none", "TRAINWIRE_TRAINER_TLS_CLIENT_CA"),
    ):
        assert flag in text and f"(default: {default}; env {env})" in text
    assert "resolve against the first" in text
    assert "(default: var/data; env TRAINWIRE_TRAINER_DATA_ROOT, values separated by ':')" in text


def test_a_bad_variable_exits_with_one_line_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args([], {"TRAINWIRE_TRAINER_SLOTS": "many"})
    assert info.value.code == 2
    assert "TRAINWIRE_TRAINER_SLOTS='many'" in capsys.readouterr().err


def test_bad_flag_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--slots", "0"])
    assert info.value.code == 2
    assert "slots" in capsys.readouterr().err
