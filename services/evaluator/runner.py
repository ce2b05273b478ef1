"""The dedicated evaluator's loop: follow the published versions, load and evaluate only the due ones."""

from __future__ import annotations

import logging
import threading

from services.evaluator.evaluator import Evaluator
from services.sampler.engine import GenerationEngine
from services.sampler.weights import WeightSync

log = logging.getLogger(__name__)


class EvalRunner:
    """The dedicated evaluator's loop: follow the published versions, load and evaluate only the due ones."""

    def __init__(self, engine: GenerationEngine, sync: WeightSync, evaluator: Evaluator) -> None:
        if evaluator.schedule is None:
            raise ValueError("the dedicated evaluator needs a schedule")
        self.engine, self.sync, self.evaluator = engine, sync, evaluator
        self.evaluated: list[int] = []
        # the first version it had in hand or passed over as not due: it follows the versions (the launcher
        # waits for this before the samplers start, so version 0 is not missed)
        self.first_version: int | None = None

    def run(self, stop: threading.Event) -> None:
        schedule = self.evaluator.schedule
        assert schedule is not None
        self.sync.start()
        try:
            while not stop.is_set():
                version = self.sync.ready()
                if self.first_version is None:
                    self.first_version = version if version is not None else self.sync.declined
                due = schedule.claim(version) if version is not None else []
                if version is not None and due:
                    try:
                        self.sync.apply(version)
                    except Exception:
                        log.exception("version %d could not be loaded; it is not evaluated", version)
                        continue
                    if self.evaluator.run(version, stop, due):
                        self.evaluated.append(version)
                else:
                    stop.wait(0.05)
        finally:
            self.sync.stop()
            self.evaluator.close()
