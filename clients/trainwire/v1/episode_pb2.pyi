import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Episode(_message.Message):
    __slots__ = ("episode", "reward", "best_reward", "done", "metrics", "produce_time", "imitation", "grpo")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    BEST_REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    PRODUCE_TIME_FIELD_NUMBER: _ClassVar[int]
    IMITATION_FIELD_NUMBER: _ClassVar[int]
    GRPO_FIELD_NUMBER: _ClassVar[int]
    episode: int
    reward: float
    best_reward: float
    done: bool
    metrics: _containers.ScalarMap[str, float]
    produce_time: _timestamp_pb2.Timestamp
    imitation: ImitationDetail
    grpo: GrpoDetail
    def __init__(self, episode: _Optional[int] = ..., reward: _Optional[float] = ..., best_reward: _Optional[float] = ..., done: _Optional[bool] = ..., metrics: _Optional[_Mapping[str, float]] = ..., produce_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., imitation: _Optional[_Union[ImitationDetail, _Mapping]] = ..., grpo: _Optional[_Union[GrpoDetail, _Mapping]] = ...) -> None: ...

class ImitationDetail(_message.Message):
    __slots__ = ("frame_count", "joint_count", "angles")
    FRAME_COUNT_FIELD_NUMBER: _ClassVar[int]
    JOINT_COUNT_FIELD_NUMBER: _ClassVar[int]
    ANGLES_FIELD_NUMBER: _ClassVar[int]
    frame_count: int
    joint_count: int
    angles: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, frame_count: _Optional[int] = ..., joint_count: _Optional[int] = ..., angles: _Optional[_Iterable[float]] = ...) -> None: ...

class GrpoDetail(_message.Message):
    __slots__ = ("sample_completions",)
    SAMPLE_COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    sample_completions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sample_completions: _Optional[_Iterable[str]] = ...) -> None: ...

class TrainConfig(_message.Message):
    __slots__ = ("max_episodes", "seed")
    MAX_EPISODES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    max_episodes: int
    seed: int
    def __init__(self, max_episodes: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class TrainTask(_message.Message):
    __slots__ = ("imitation", "grpo")
    IMITATION_FIELD_NUMBER: _ClassVar[int]
    GRPO_FIELD_NUMBER: _ClassVar[int]
    imitation: ImitationTask
    grpo: GrpoTask
    def __init__(self, imitation: _Optional[_Union[ImitationTask, _Mapping]] = ..., grpo: _Optional[_Union[GrpoTask, _Mapping]] = ...) -> None: ...

class ImitationTask(_message.Message):
    __slots__ = ("avatar_id", "rig_name", "rig", "clip_name", "clip", "group_size", "learning_rate")
    AVATAR_ID_FIELD_NUMBER: _ClassVar[int]
    RIG_NAME_FIELD_NUMBER: _ClassVar[int]
    RIG_FIELD_NUMBER: _ClassVar[int]
    CLIP_NAME_FIELD_NUMBER: _ClassVar[int]
    CLIP_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    avatar_id: str
    rig_name: str
    rig: Rig
    clip_name: str
    clip: Clip
    group_size: int
    learning_rate: float
    def __init__(self, avatar_id: _Optional[str] = ..., rig_name: _Optional[str] = ..., rig: _Optional[_Union[Rig, _Mapping]] = ..., clip_name: _Optional[str] = ..., clip: _Optional[_Union[Clip, _Mapping]] = ..., group_size: _Optional[int] = ..., learning_rate: _Optional[float] = ...) -> None: ...

class Rig(_message.Message):
    __slots__ = ("name", "bones")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BONES_FIELD_NUMBER: _ClassVar[int]
    name: str
    bones: _containers.RepeatedCompositeFieldContainer[Bone]
    def __init__(self, name: _Optional[str] = ..., bones: _Optional[_Iterable[_Union[Bone, _Mapping]]] = ...) -> None: ...

class Bone(_message.Message):
    __slots__ = ("name", "parent", "length")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    parent: int
    length: float
    def __init__(self, name: _Optional[str] = ..., parent: _Optional[int] = ..., length: _Optional[float] = ...) -> None: ...

class Clip(_message.Message):
    __slots__ = ("name", "fps", "frame_count", "joint_count", "angles")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    FRAME_COUNT_FIELD_NUMBER: _ClassVar[int]
    JOINT_COUNT_FIELD_NUMBER: _ClassVar[int]
    ANGLES_FIELD_NUMBER: _ClassVar[int]
    name: str
    fps: float
    frame_count: int
    joint_count: int
    angles: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, name: _Optional[str] = ..., fps: _Optional[float] = ..., frame_count: _Optional[int] = ..., joint_count: _Optional[int] = ..., angles: _Optional[_Iterable[float]] = ...) -> None: ...

class GrpoTask(_message.Message):
    __slots__ = ("model_path", "dataset_path", "reward_functions", "num_generations", "batch_size", "max_completion_length", "learning_rate", "beta", "temperature", "gradient_accumulation_steps", "dataloader_num_workers", "dataloader_prefetch_factor")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    DATASET_PATH_FIELD_NUMBER: _ClassVar[int]
    REWARD_FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_COMPLETION_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_ACCUMULATION_STEPS_FIELD_NUMBER: _ClassVar[int]
    DATALOADER_NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    DATALOADER_PREFETCH_FACTOR_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    dataset_path: str
    reward_functions: _containers.RepeatedScalarFieldContainer[str]
    num_generations: int
    batch_size: int
    max_completion_length: int
    learning_rate: float
    beta: float
    temperature: float
    gradient_accumulation_steps: int
    dataloader_num_workers: int
    dataloader_prefetch_factor: int
    def __init__(self, model_path: _Optional[str] = ..., dataset_path: _Optional[str] = ..., reward_functions: _Optional[_Iterable[str]] = ..., num_generations: _Optional[int] = ..., batch_size: _Optional[int] = ..., max_completion_length: _Optional[int] = ..., learning_rate: _Optional[float] = ..., beta: _Optional[float] = ..., temperature: _Optional[float] = ..., gradient_accumulation_steps: _Optional[int] = ..., dataloader_num_workers: _Optional[int] = ..., dataloader_prefetch_factor: _Optional[int] = ...) -> None: ...
