"""Gateway configuration: flag parsing, defaults, validation in __post_init__."""

from __future__ import annotations

import math

import pytest

from gateway.__main__ import config_from_args, parse_args
from gateway.config import (
    DEFAULT_CHECKPOINT_STORE,
    DEFAULT_DB,
    DEFAULT_HTTP_PORT,
    GatewayConfig,
)


def test_defaults_match_the_documented_flags() -> None:
    config = config_from_args(parse_args([]))
    # Two deliberate differences: the command line serves the page on 8080 and reads the
    # checkpoints in var/checkpoints, while a gateway embedded in a program (tests, benchmarks)
    # opens no HTTP port and no checkpoint store unless asked.
    assert config == GatewayConfig(
        http_port=DEFAULT_HTTP_PORT, checkpoint_store=DEFAULT_CHECKPOINT_STORE
    )
    assert DEFAULT_HTTP_PORT == 8080 and DEFAULT_CHECKPOINT_STORE == "var/checkpoints"
    assert GatewayConfig().http_port is None and GatewayConfig().checkpoint_store is None
    assert (config.park_after_s, config.max_restarts) == (60.0, 3)
    assert config.port == 50051 and config.db == DEFAULT_DB == "var/trainwire.sqlite3"
    assert config.episode_rate == 20 and config.keepalive_s == 15
    assert config.heartbeat_timeout_s == 30


def test_flags_are_parsed() -> None:
    args = parse_args(
        [
            "--host", "0.0.0.0", "--port", "0", "--trainer", "a:1, b:2", "--db", ":memory:",
            "--episode-rate", "-1", "--keepalive", "0.05", "--heartbeat-timeout", "0.5",
            "--insecure",
        ]
    )  # fmt: skip
    config = config_from_args(args)
    assert config.trainers == ("a:1", "b:2")
    assert config.port == 0 and config.db == ":memory:" and config.episode_rate == -1
    assert config.keepalive_s == 0.05 and config.heartbeat_timeout_s == 0.5


@pytest.mark.parametrize(
    "bad",
    [
        {"port": 70000},
        {"trainers": ()},
        {"trainers": ("nohost",)},
        {"trainers": ("h:0",)},
        {"db": ""},
        {"episode_rate": 0.0},
        {"episode_rate": math.nan},
        {"keepalive_s": 0.0},
        {"heartbeat_timeout_s": -1.0},
        {"live_coalesce_s": 2.0},
        {"history_cache_mb": -1.0},
        {"trainer_server_name": "trainer.internal"},  # without TLS to trainers
        {"trainer_server_name": "", "trainer_ca": "ca.pem"},
        {"park_after_s": -1.0},
        {"park_after_s": math.inf},
        {"max_restarts": -1},
        {"checkpoint_store": ""},
    ],
)
def test_bad_values_are_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        GatewayConfig(**bad)  # type: ignore[arg-type]


def test_main_rejects_a_bad_flag_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.__main__ import main

    assert main(["--trainer", "nope", "--port", "0"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err


def test_every_flag_can_come_from_the_environment() -> None:
    environ = {
        "TRAINWIRE_GATEWAY_PORT": "0",
        "TRAINWIRE_GATEWAY_TRAINER": "a:1,b:2",
        "TRAINWIRE_GATEWAY_KEEPALIVE": "0.5",
        "TRAINWIRE_GATEWAY_LEASE_SECONDS": "3",
        "TRAINWIRE_GATEWAY_HTTP_PORT": "-1",
        "TRAINWIRE_GATEWAY_MIGRATE": "yes",
        "TRAINWIRE_GATEWAY_LOG_LEVEL": "debug",
    }
    config = config_from_args(parse_args([], environ))
    assert config.port == 0 and config.trainers == ("a:1", "b:2") and config.keepalive_s == 0.5
    assert config.lease_s == 3 and config.http_port is None and config.migrate
    assert config.log_level == "DEBUG"
    # The command line wins over the environment.
    assert config_from_args(parse_args(["--port", "7"], environ)).port == 7


def test_every_config_field_has_a_flag_and_a_variable_in_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import dataclasses

    from gateway.__main__ import build_parser
    from trainwire_ops.settings import env_of, flag_of

    text = build_parser({}).format_help()
    for field in dataclasses.fields(GatewayConfig):
        assert flag_of(field) in text, field.name
        assert env_of(field, "TRAINWIRE_GATEWAY_") in text, field.name
    assert "(default: 50051; env TRAINWIRE_GATEWAY_PORT)" in " ".join(text.split())


def test_a_bad_value_names_the_flag_or_the_variable_not_a_function(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--keepalive", "soon"], {})
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--keepalive" in err and "'soon'" in err and "_positive" not in err
    with pytest.raises(SystemExit):
        parse_args([], {"TRAINWIRE_GATEWAY_PORT": "x"})
    assert "TRAINWIRE_GATEWAY_PORT='x'" in capsys.readouterr().err
