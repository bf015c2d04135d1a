from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerLatency(_message.Message):
    __slots__ = ("epoch", "counts")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, epoch: _Optional[str] = ..., counts: _Optional[_Iterable[int]] = ...) -> None: ...

class LatencyReport(_message.Message):
    __slots__ = ("router_id", "reported_at", "bounds", "ttft", "itl")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    REPORTED_AT_FIELD_NUMBER: _ClassVar[int]
    BOUNDS_FIELD_NUMBER: _ClassVar[int]
    TTFT_FIELD_NUMBER: _ClassVar[int]
    ITL_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    reported_at: float
    bounds: _containers.RepeatedScalarFieldContainer[float]
    ttft: _containers.RepeatedCompositeFieldContainer[WorkerLatency]
    itl: _containers.RepeatedCompositeFieldContainer[WorkerLatency]
    def __init__(self, router_id: _Optional[str] = ..., reported_at: _Optional[float] = ..., bounds: _Optional[_Iterable[float]] = ..., ttft: _Optional[_Iterable[_Union[WorkerLatency, _Mapping]]] = ..., itl: _Optional[_Iterable[_Union[WorkerLatency, _Mapping]]] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("role", "desired", "current", "ready", "warming", "pending", "draining", "reason", "detail", "pressure")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    WARMING_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_FIELD_NUMBER: _ClassVar[int]
    role: str
    desired: int
    current: int
    ready: int
    warming: int
    pending: int
    draining: int
    reason: str
    detail: str
    pressure: float
    def __init__(self, role: _Optional[str] = ..., desired: _Optional[int] = ..., current: _Optional[int] = ..., ready: _Optional[int] = ..., warming: _Optional[int] = ..., pending: _Optional[int] = ..., draining: _Optional[int] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ..., pressure: _Optional[float] = ...) -> None: ...

class AutoscalerStatus(_message.Message):
    __slots__ = ("updated_at", "actuator", "pools")
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    ACTUATOR_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    updated_at: float
    actuator: str
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    def __init__(self, updated_at: _Optional[float] = ..., actuator: _Optional[str] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ...) -> None: ...
