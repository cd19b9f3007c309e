"""One error contract: reasons declared once (trainwire.reasons), each domain exception carrying
its code and reason as class data, one status builder, and the client's typed errors mapping
back from the reasons."""

from __future__ import annotations

import inspect

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

import gateway.core.errors as gateway_errors
import trainer_service.core.errors as trainer_errors
from gateway import trainer_client
from gateway.core import trainers
from gateway.status import to_status as gateway_status
from trainer_service.status import to_status as trainer_status
from trainwire import errors as client_errors
from trainwire.contract import FieldViolation
from trainwire.reasons import ERROR_DOMAIN, ErrorReason
from trainwire_ops.rich_status import rich_status


def _classes(module: object, base: type[Exception]) -> list[type[Exception]]:
    return [
        cls
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, base) and cls is not base and cls.__module__ == module.__name__  # type: ignore[attr-defined]
    ]


GATEWAY = _classes(gateway_errors, gateway_errors.GatewayError)
TRAINER = _classes(trainer_errors, trainer_errors.TrainerError)


def _as_rpc_error(status: grpc.Status) -> grpc.aio.AioRpcError:
    """What a client receives for ``status`` (the same object grpc.aio raises)."""
    return grpc.aio.AioRpcError(
        status.code,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*status.trailing_metadata),
        details=status.details,
    )


def _details(status: grpc.Status) -> status_pb2.Status:
    (value,) = [v for k, v in status.trailing_metadata if k == "grpc-status-details-bin"]
    return status_pb2.Status.FromString(value)


def _error_info(status: grpc.Status) -> error_details_pb2.ErrorInfo:
    infos = []
    for detail in _details(status).details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            infos.append(info)
    assert len(infos) == 1, "every status carries exactly one ErrorInfo"
    return infos[0]


def test_the_reasons_are_stable_upper_snake_case_strings() -> None:
    for reason in ErrorReason:
        assert reason.value == reason.name and reason.value.isupper()
    # The gateway's trainer client classifies trainer errors by these exact strings.
    for kept in ("SLOTS_BUSY", "JOB_EXISTS", "JOB_NOT_FOUND", "EPISODES_NOT_HELD", "REATTACHED"):
        assert ErrorReason(kept) == kept


@pytest.mark.parametrize("cls", GATEWAY + TRAINER, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_every_domain_error_carries_a_valid_code_and_a_declared_reason(cls: type) -> None:
    code = getattr(grpc.StatusCode, cls.status_code)
    assert isinstance(code, grpc.StatusCode) and code is not grpc.StatusCode.OK
    assert isinstance(cls.reason, ErrorReason)
    assert cls.reason is not ErrorReason.INTERNAL_ERROR, f"{cls.__name__} declares no reason"


def test_within_one_service_each_error_has_its_own_reason() -> None:
    for classes in (GATEWAY, TRAINER):
        reasons = [c.reason for c in classes]  # type: ignore[attr-defined]
        assert len(reasons) == len(set(reasons))


def test_the_same_name_means_the_same_code_and_reason_in_both_services() -> None:
    shared = {c.__name__ for c in GATEWAY} & {c.__name__ for c in TRAINER}
    assert {"InvalidRequest", "ShuttingDown"} <= shared
    for name in shared:
        g, t = getattr(gateway_errors, name), getattr(trainer_errors, name)
        assert (g.status_code, g.reason) == (t.status_code, t.reason), name


def _gateway_samples() -> list[Exception]:
    return [
        gateway_errors.RunNotFound("r1"),
        gateway_errors.IllegalTransition("cannot pause run 'r1': it is DONE", "r1"),
        gateway_errors.InvalidRequest("bad", [FieldViolation("config.max_episodes", "too big")]),
        gateway_errors.ShuttingDown("shutting down"),
        gateway_errors.TrainerUnavailable("no trainer"),
        gateway_errors.TooManyPending("too many"),
        gateway_errors.Unauthenticated("no token"),
        gateway_errors.PermissionDenied("needs admin", "admin"),
    ]


@pytest.mark.parametrize("exc", _gateway_samples(), ids=lambda e: type(e).__name__)
def test_a_gateway_error_reaches_the_client_as_its_reason_class(exc: Exception) -> None:
    status = gateway_status(exc)
    info = _error_info(status)
    assert (info.domain, info.reason) == (ERROR_DOMAIN, type(exc).reason)  # type: ignore[attr-defined]
    error = client_errors.error_from_rpc(_as_rpc_error(status))
    assert error.code == status.code and error.reason == type(exc).reason  # type: ignore[attr-defined]
    code_class = client_errors.error_class(status.code)
    assert isinstance(error, code_class)
    reason_class = client_errors.error_class(status.code, info.reason)
    assert type(error) is reason_class
    if isinstance(exc, gateway_errors.InvalidRequest):
        assert isinstance(error, client_errors.InvalidRequest)
        assert error.field_violations == (FieldViolation("config.max_episodes", "too big"),)
    if isinstance(exc, gateway_errors.RunNotFound):
        assert isinstance(error, client_errors.RunNotFound) and error.metadata["run_id"] == "r1"


def test_every_gateway_reason_has_its_client_class() -> None:
    for cls in GATEWAY:
        code = getattr(grpc.StatusCode, cls.status_code)
        mapped = client_errors.error_class(code, cls.reason)  # type: ignore[attr-defined]
        if cls.reason in (ErrorReason.UNAUTHENTICATED, ErrorReason.PERMISSION_DENIED):
            assert mapped is client_errors.error_class(code)  # the code says it all
        else:
            assert mapped.error_reason == cls.reason, cls.__name__  # type: ignore[attr-defined]


def test_a_reason_paired_with_another_code_falls_back_to_the_code_class() -> None:
    status = rich_status(grpc.StatusCode.INTERNAL, "odd", ErrorReason.RUN_NOT_FOUND)
    error = client_errors.error_from_rpc(_as_rpc_error(status))
    assert type(error) is client_errors.Internal and error.reason == "RUN_NOT_FOUND"


def test_trainer_statuses_classify_in_the_gateway_by_reason() -> None:
    expected = {
        trainer_errors.NoFreeSlot("r1", 2): trainers.TrainerBusy,
        trainer_errors.JobExists("r1"): trainers.TrainerJobExists,
        trainer_errors.JobNotFound("r1"): trainers.TrainerJobGone,
        trainer_errors.EpisodesNotHeld("r1", 3, 10, 20): trainers.TrainerJobGone,
    }
    for exc, kind in expected.items():
        status = trainer_status(exc, "r1")
        info = _error_info(status)
        assert info.reason == type(exc).reason and info.metadata["run_id"] == "r1"
        assert isinstance(trainer_client.classify(_as_rpc_error(status), "t:1"), kind)
    busy = _error_info(trainer_status(trainer_errors.NoFreeSlot("r1", 2), "r1"))
    assert busy.metadata["slots_total"] == "2"


def test_resource_exhausted_without_slots_busy_is_not_busy() -> None:
    status = rich_status(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "too large", "MESSAGE_TOO_LARGE", localized="Too big."
    )
    kind = trainer_client.classify(_as_rpc_error(status), "t:1")
    assert isinstance(kind, trainers.TrainerFailed) and not isinstance(kind, trainers.TrainerBusy)


def test_an_invalid_request_has_the_same_shape_from_either_service() -> None:
    violation = FieldViolation("task", "missing")
    from_gateway = gateway_status(gateway_errors.InvalidRequest("bad", [violation]))
    from_trainer = trainer_status(trainer_errors.InvalidRequest("r1", [violation]), "r1")
    for status in (from_gateway, from_trainer):
        error = client_errors.error_from_rpc(_as_rpc_error(status))
        assert isinstance(error, client_errors.InvalidRequest)
        assert error.field_violations == (violation,)
    # The trainer's adds the text the gateway shows its user.
    trainer_error = client_errors.error_from_rpc(_as_rpc_error(from_trainer))
    assert trainer_error.localized_message.startswith("The trainer refused this task")


def test_capabilities_have_the_same_fields_in_both_services() -> None:
    import dataclasses

    from trainer_service.core.jobs import Capabilities as TrainerCapabilities

    gateway_fields = {f.name for f in dataclasses.fields(trainers.Capabilities)}
    trainer_fields = {f.name for f in dataclasses.fields(TrainerCapabilities)}
    assert gateway_fields == trainer_fields
