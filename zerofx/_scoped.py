"""Measuring contexts that code deep inside a step can find while they are entered."""

from __future__ import annotations

import threading
from typing import ClassVar


class Scoped:
    """Base for ``with``-contexts that compiled graphs report into (CollectiveCounter,
    MemoryTracker): torch.compile runs compiled code outside any mode the user entered, so the
    executor looks the active contexts up here instead. Each direct subclass has its own
    registry (its subclasses share it), in entry order, shared by all threads."""

    _scoped_entered: ClassVar[list]
    _scoped_lock: ClassVar[threading.Lock]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if Scoped in cls.__bases__:
            cls._scoped_entered = []
            cls._scoped_lock = threading.Lock()

    def __enter__(self):
        with type(self)._scoped_lock:
            type(self)._scoped_entered.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with type(self)._scoped_lock:
            type(self)._scoped_entered.remove(self)

    @classmethod
    def innermost(cls):
        """The most recently entered instance still active, or None."""
        entered = cls._scoped_entered
        return entered[-1] if entered else None
