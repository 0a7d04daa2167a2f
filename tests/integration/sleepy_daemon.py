"""A daemon with a concurrent synchronous endpoint that sleeps in a thread, whose teardown writes
to options["record"] whether that endpoint had finished, for the shutdown test. Not a test module."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from hfrt import Daemon, endpoint


class SleepyDaemon(Daemon):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.started = threading.Event()
        self.finished = threading.Event()

    @endpoint(concurrent=True)
    def sleep(self, seconds: float) -> str:
        self.started.set()
        time.sleep(seconds)
        self.finished.set()
        return "slept"

    @endpoint
    def ready(self) -> bool:
        """Whether `sleep` is inside its thread now."""
        return self.started.is_set()

    async def teardown(self) -> None:
        record = {"started": self.started.is_set(), "finished": self.finished.is_set(), "at": time.time()}
        Path(self.context.options["record"]).write_text(json.dumps(record))
