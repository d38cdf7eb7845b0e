"""End-to-end deadlines: the client's request timeout, or the model's default, split across stages."""

from __future__ import annotations

import time


class Deadline:
    """When a request must be answered by, on the ``time.monotonic`` clock.

    The client's request timeout (``request.timeout()``, in microseconds; 0 when unset) is the
    end-to-end budget, cut to the orchestrator's ``max_deadline_ms``; without one, its
    ``default_deadline_ms`` applies. (A plain class: one is made per request.)
    """

    __slots__ = ("start", "end", "source")

    def __init__(self, start: float, end: float, source: str) -> None:
        self.start, self.end, self.source = start, end, source  # source: "client" or "default"

    @classmethod
    def for_request(cls, timeout_us: int, default_ms: float, now: float | None = None,
                    max_ms: float | None = None) -> "Deadline":
        now = time.monotonic() if now is None else now
        if timeout_us > 0:
            if max_ms is not None and timeout_us > max_ms * 1e3:
                return cls(now, now + max_ms / 1e3, "capped")
            return cls(now, now + timeout_us / 1e6, "client")
        return cls(now, now + default_ms / 1e3, "default")

    @property
    def label(self) -> str:
        """What this deadline is, as error messages name it."""
        return {"client": "client timeout", "default": "default deadline",
                "capped": "client timeout cut to max_deadline_ms"}[self.source]

    @property
    def budget_ms(self) -> float:
        return (self.end - self.start) * 1e3

    def remaining(self, now: float | None = None) -> float:
        """Seconds left (negative once passed)."""
        return self.end - (time.monotonic() if now is None else now)

    def stage_limit(self, stage_timeout_ms: float, now: float | None = None) -> tuple[float, str, float]:
        """(seconds, what limits, that limit in ms) for a stage starting now.

        A stage gets the rest of the request's budget, capped by its own timeout if it has one.
        """
        remaining = self.remaining(now)
        if stage_timeout_ms > 0 and stage_timeout_ms / 1e3 < remaining:
            return stage_timeout_ms / 1e3, "stage timeout", stage_timeout_ms
        return remaining, self.label, self.budget_ms
