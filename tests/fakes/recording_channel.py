"""A channel wrapper that records every call's method and deadline (the client's unit tests)."""

from __future__ import annotations

from typing import Any

import grpc


class RecordingChannel(grpc.Channel):
    """A channel that records every call's method and timeout, then passes it on.

    Proves that every call carries a deadline. (``grpc.intercept_channel`` cannot wrap a
    grpc_testing channel: it passes ``wait_for_ready``, which grpc_testing does not take.)
    """

    def __init__(self, inner: grpc.Channel) -> None:
        self.inner = inner
        self.calls: list[tuple[str, float | None]] = []

    def _wrap(self, method: str, callable_: Any) -> Any:
        def call(request: Any, timeout: float | None = None, **kwargs: Any) -> Any:
            self.calls.append((method, timeout))
            return callable_(request, timeout=timeout, **kwargs)

        return call

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._wrap(method, self.inner.unary_unary(method, *args, **kwargs))

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._wrap(method, self.inner.unary_stream(method, *args, **kwargs))

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def subscribe(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def unsubscribe(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.inner.close()
