"""Overlap I/O with compute: read the next item in a thread while the caller works on this one."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator

_DONE = object()


def prefetch(items: Iterable, depth: int = 2) -> Iterator:
    """Yield from `items`, produced up to `depth` ahead in a background thread; errors re-raise here."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce():
        try:
            for item in items:
                if stop.is_set():
                    return
                q.put((item, None))
            q.put((_DONE, None))
        except BaseException as e:  # handed to the consumer, which raises it in its own thread
            q.put((_DONE, e))

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        while True:
            item, error = q.get()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(0.01)
