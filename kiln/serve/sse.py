"""Server-sent events: ``data: <json>\\n\\n`` frames, the closing ``data: [DONE]``, and the
merging of several engine streams (one per prompt of a batched completion) into one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, TypeVar

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(data: dict[str, Any]) -> bytes:
    return (
        b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    )


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of every stream as ``(stream index, item)`` in arrival order. An exception in one
    stream is raised here; leaving early (or being cancelled) closes every stream, which
    aborts their engine requests."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as s:  # type: ignore[type-var]
            async for item in s:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, bool]] = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[T]) -> None:
        try:
            async with aclosing(s):  # type: ignore[type-var]
                async for item in s:
                    queue.put_nowait((i, item, False))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            queue.put_nowait((i, e, True))
            return
        queue.put_nowait((i, None, True))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item, done = await queue.get()
            if done:
                if isinstance(item, BaseException):
                    raise item
                left -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
