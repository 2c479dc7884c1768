"""A reader thread ahead of the consumer, through a bounded queue (``score``'s overlap of
reading and parsing with inference).

:func:`prefetch` runs an iterator in a thread and hands its items over a ``queue.Queue`` of
``depth``: the reader is never more than ``depth + 1`` items ahead, so the memory the items
hold is bounded whatever the input length. An error in the reader is raised in the consumer;
when the consumer stops (an error, an early exit), the reader stops at its next item and the
items left in the queue are handed to ``discard`` (e.g. to cancel futures).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
_POLL_S = 0.05


@dataclass
class _End:
    error: BaseException | None


def prefetch(
    source: Iterable[T],
    depth: int,
    discard: Callable[[T], None] | None = None,
    name: str = "prefetch",
) -> Iterator[T]:
    """The items of ``source`` in order, produced by a thread at most ``depth`` ahead."""
    if depth < 1:
        raise ValueError("depth must be >= 1")
    q: queue.Queue[T | _End] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: T | _End) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for item in source:
                if not put(item):
                    if discard is not None:
                        discard(item)
                    return
        except BaseException as err:  # handed to the consumer, raised there
            put(_End(err))
            return
        put(_End(None))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            yield item
    finally:
        stop.set()
        thread.join()
        while True:
            try:
                left = q.get_nowait()
            except queue.Empty:
                break
            if discard is not None and not isinstance(left, _End):
                discard(left)
