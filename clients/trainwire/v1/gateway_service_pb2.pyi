import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from trainwire.v1 import episode_pb2 as _episode_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunView(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_VIEW_UNSPECIFIED: _ClassVar[RunView]
    RUN_VIEW_BASIC: _ClassVar[RunView]
    RUN_VIEW_FULL: _ClassVar[RunView]
RUN_VIEW_UNSPECIFIED: RunView
RUN_VIEW_BASIC: RunView
RUN_VIEW_FULL: RunView

class Run(_message.Message):
    __slots__ = ("id", "state", "error_message", "speed", "episodes_per_second", "episode", "best_reward", "task", "config", "create_time", "start_time", "end_time", "display_name", "trainer", "request_id", "reward", "trainer_episode", "state_detail", "creator")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[Run.State]
        STATE_PENDING: _ClassVar[Run.State]
        STATE_RUNNING: _ClassVar[Run.State]
        STATE_PAUSED: _ClassVar[Run.State]
        STATE_DONE: _ClassVar[Run.State]
        STATE_STOPPED: _ClassVar[Run.State]
        STATE_ERROR: _ClassVar[Run.State]
    STATE_UNSPECIFIED: Run.State
    STATE_PENDING: Run.State
    STATE_RUNNING: Run.State
    STATE_PAUSED: Run.State
    STATE_DONE: Run.State
    STATE_STOPPED: Run.State
    STATE_ERROR: Run.State
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    EPISODES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    BEST_REWARD_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TRAINER_EPISODE_FIELD_NUMBER: _ClassVar[int]
    STATE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    CREATOR_FIELD_NUMBER: _ClassVar[int]
    id: str
    state: Run.State
    error_message: str
    speed: float
    episodes_per_second: float
    episode: int
    best_reward: float
    task: _episode_pb2.TrainTask
    config: _episode_pb2.TrainConfig
    create_time: _timestamp_pb2.Timestamp
    start_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    display_name: str
    trainer: str
    request_id: str
    reward: float
    trainer_episode: int
    state_detail: str
    creator: str
    def __init__(self, id: _Optional[str] = ..., state: _Optional[_Union[Run.State, str]] = ..., error_message: _Optional[str] = ..., speed: _Optional[float] = ..., episodes_per_second: _Optional[float] = ..., episode: _Optional[int] = ..., best_reward: _Optional[float] = ..., task: _Optional[_Union[_episode_pb2.TrainTask, _Mapping]] = ..., config: _Optional[_Union[_episode_pb2.TrainConfig, _Mapping]] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., display_name: _Optional[str] = ..., trainer: _Optional[str] = ..., request_id: _Optional[str] = ..., reward: _Optional[float] = ..., trainer_episode: _Optional[int] = ..., state_detail: _Optional[str] = ..., creator: _Optional[str] = ...) -> None: ...

class CreateRunRequest(_message.Message):
    __slots__ = ("task", "config", "speed", "episodes_per_second", "request_id", "display_name")
    TASK_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    EPISODES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    task: _episode_pb2.TrainTask
    config: _episode_pb2.TrainConfig
    speed: float
    episodes_per_second: float
    request_id: str
    display_name: str
    def __init__(self, task: _Optional[_Union[_episode_pb2.TrainTask, _Mapping]] = ..., config: _Optional[_Union[_episode_pb2.TrainConfig, _Mapping]] = ..., speed: _Optional[float] = ..., episodes_per_second: _Optional[float] = ..., request_id: _Optional[str] = ..., display_name: _Optional[str] = ...) -> None: ...

class CreateRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "state", "view")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    state: Run.State
    view: RunView
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., state: _Optional[_Union[Run.State, str]] = ..., view: _Optional[_Union[RunView, str]] = ...) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs", "next_page_token")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[Run]
    next_page_token: str
    def __init__(self, runs: _Optional[_Iterable[_Union[Run, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class PauseRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class PauseRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class ResumeRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ResumeRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class StopRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class StopRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class SetRunSpeedRequest(_message.Message):
    __slots__ = ("run_id", "speed")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    speed: float
    def __init__(self, run_id: _Optional[str] = ..., speed: _Optional[float] = ...) -> None: ...

class SetRunSpeedResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class DeleteRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class DeleteRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class WatchRunRequest(_message.Message):
    __slots__ = ("run_id", "after_episode")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_EPISODE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    after_episode: int
    def __init__(self, run_id: _Optional[str] = ..., after_episode: _Optional[int] = ...) -> None: ...

class WatchRunResponse(_message.Message):
    __slots__ = ("episode", "keepalive", "caught_up", "finished", "batch")
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    CAUGHT_UP_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    episode: _episode_pb2.Episode
    keepalive: Keepalive
    caught_up: CaughtUp
    finished: Run
    batch: EpisodeBatch
    def __init__(self, episode: _Optional[_Union[_episode_pb2.Episode, _Mapping]] = ..., keepalive: _Optional[_Union[Keepalive, _Mapping]] = ..., caught_up: _Optional[_Union[CaughtUp, _Mapping]] = ..., finished: _Optional[_Union[Run, _Mapping]] = ..., batch: _Optional[_Union[EpisodeBatch, _Mapping]] = ...) -> None: ...

class Keepalive(_message.Message):
    __slots__ = ("last_episode", "state", "time")
    LAST_EPISODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    last_episode: int
    state: Run.State
    time: _timestamp_pb2.Timestamp
    def __init__(self, last_episode: _Optional[int] = ..., state: _Optional[_Union[Run.State, str]] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class CaughtUp(_message.Message):
    __slots__ = ("last_episode",)
    LAST_EPISODE_FIELD_NUMBER: _ClassVar[int]
    last_episode: int
    def __init__(self, last_episode: _Optional[int] = ...) -> None: ...

class EpisodeBatch(_message.Message):
    __slots__ = ("episodes",)
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    episodes: _containers.RepeatedCompositeFieldContainer[_episode_pb2.Episode]
    def __init__(self, episodes: _Optional[_Iterable[_Union[_episode_pb2.Episode, _Mapping]]] = ...) -> None: ...
