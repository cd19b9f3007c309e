import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from trainwire.v1 import episode_pb2 as _episode_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainRequest(_message.Message):
    __slots__ = ("run_id", "task", "config", "grant_through_episode", "attach_after_episode")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    GRANT_THROUGH_EPISODE_FIELD_NUMBER: _ClassVar[int]
    ATTACH_AFTER_EPISODE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    task: _episode_pb2.TrainTask
    config: _episode_pb2.TrainConfig
    grant_through_episode: int
    attach_after_episode: int
    def __init__(self, run_id: _Optional[str] = ..., task: _Optional[_Union[_episode_pb2.TrainTask, _Mapping]] = ..., config: _Optional[_Union[_episode_pb2.TrainConfig, _Mapping]] = ..., grant_through_episode: _Optional[int] = ..., attach_after_episode: _Optional[int] = ...) -> None: ...

class GrantRequest(_message.Message):
    __slots__ = ("run_id", "through_episode")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    THROUGH_EPISODE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    through_episode: int
    def __init__(self, run_id: _Optional[str] = ..., through_episode: _Optional[int] = ...) -> None: ...

class GrantResponse(_message.Message):
    __slots__ = ("last_episode",)
    LAST_EPISODE_FIELD_NUMBER: _ClassVar[int]
    last_episode: int
    def __init__(self, last_episode: _Optional[int] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("last_episode",)
    LAST_EPISODE_FIELD_NUMBER: _ClassVar[int]
    last_episode: int
    def __init__(self, last_episode: _Optional[int] = ...) -> None: ...

class TrainResponse(_message.Message):
    __slots__ = ("episode", "heartbeat")
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    episode: _episode_pb2.Episode
    heartbeat: Heartbeat
    def __init__(self, episode: _Optional[_Union[_episode_pb2.Episode, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("last_episode", "time", "phase")
    LAST_EPISODE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    last_episode: int
    time: _timestamp_pb2.Timestamp
    phase: str
    def __init__(self, last_episode: _Optional[int] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., phase: _Optional[str] = ...) -> None: ...

class GetCapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetCapabilitiesResponse(_message.Message):
    __slots__ = ("providers", "device", "slots_total", "slots_free", "torch_version", "trl_version", "server_version")
    PROVIDERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    providers: _containers.RepeatedScalarFieldContainer[str]
    device: str
    slots_total: int
    slots_free: int
    torch_version: str
    trl_version: str
    server_version: str
    def __init__(self, providers: _Optional[_Iterable[str]] = ..., device: _Optional[str] = ..., slots_total: _Optional[int] = ..., slots_free: _Optional[int] = ..., torch_version: _Optional[str] = ..., trl_version: _Optional[str] = ..., server_version: _Optional[str] = ...) -> None: ...
