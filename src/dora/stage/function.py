"""``@stage``: a plain ``async def`` (or async generator, for a source) becomes a Stage."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from pydantic import BaseModel

from dora.events import Event
from dora.stage.base import (
    Emitted,
    EmptyConfig,
    RetryPolicy,
    Stage,
    StageError,
    input_model_of,
)
from dora.stage.context import Context


class FunctionStage(Stage):
    """A stage whose behaviour is one function: ``fn(event, ctx)`` or, for a source, ``fn(ctx)``.

    Its declaration lives on the instance (set by ``@stage``), so one class serves every
    decorated function; ``clone`` keeps the function.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        consumes: str | None = None,
        emits: Mapping[type[Event], str] | None = None,
        concurrency: int = 1,
        retry: RetryPolicy | None = None,
        finite: bool | None = None,
        config_model: type[BaseModel] = EmptyConfig,
        **config: Any,
    ) -> None:
        self.fn = fn
        self.Config = config_model  # type: ignore[misc]
        self.consumes = consumes  # type: ignore[misc]
        self.emits = dict(emits or {})  # type: ignore[misc]
        self._source = inspect.isasyncgenfunction(fn)
        self.input_model = None if self._source else input_model_of(fn)  # type: ignore[misc]
        if not self._source and not inspect.iscoroutinefunction(fn):
            raise StageError(f"@stage {fn.__name__}: must be `async def` or an async generator")
        self.finite = self._source if finite is None else finite  # type: ignore[misc]
        super().__init__(
            consumes=consumes,
            name=name or fn.__name__.replace(".", "_"),
            concurrency=concurrency,
            retry=retry,
            **config,
        )

    @property
    def is_source(self) -> bool:
        return self._source

    @property
    def is_processor(self) -> bool:
        return not self._source

    async def handle(self, event: Any, ctx: Context) -> Emitted:
        return await self.fn(event, ctx)  # type: ignore[no-any-return]

    def produce(self, ctx: Context) -> AsyncIterator[Event]:
        return self.fn(ctx)  # type: ignore[no-any-return]

    def clone(self, **overrides: Any) -> Stage:
        config = {**self.config.model_dump(), **overrides.pop("config", {})}
        kwargs: dict[str, Any] = {
            "name": self.name,
            "consumes": self.consumes,
            "emits": self.emits,
            "concurrency": self.concurrency,
            "retry": self.retry,
            "finite": self.finite,
            "config_model": self.Config,
        }
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        return FunctionStage(self.fn, **kwargs, **config)


def stage(
    *,
    consumes: str | None = None,
    emits: Mapping[type[Event], str] | None = None,
    name: str | None = None,
    concurrency: int = 1,
    retry: RetryPolicy | None = None,
    finite: bool | None = None,
    config: type[BaseModel] = EmptyConfig,
) -> Callable[[Callable[..., Any]], FunctionStage]:
    """Decorate ``async def f(event: InModel, ctx: Context) -> Emitted`` (a processor/sink) or
    ``async def f(ctx: Context)`` yielding events (a source; finite by default).

    The input model is the annotation of the first parameter; ``ctx.config`` is an instance
    of ``config`` (validated from YAML ``config:`` or ``FunctionStage.clone(config=...)``).
    """

    def wrap(fn: Callable[..., Any]) -> FunctionStage:
        return FunctionStage(
            fn,
            name=name,
            consumes=consumes,
            emits=emits,
            concurrency=concurrency,
            retry=retry,
            finite=finite,
            config_model=config,
        )

    return wrap
