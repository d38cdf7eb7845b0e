"""What a launcher ``Supervisor`` and its reloader did during a run, read from their event lists
(``(monotonic time, what)``): when a model's reload began and when its new copy served, the
whole-server restarts, and one timeline of both."""

from __future__ import annotations


def reload_began(supervisor, model: str, after: float = float("-inf")) -> float | None:
    """When the reloader began reloading ``model``, first after ``after``."""
    return next((t for t, what in supervisor.reloader.events
                 if t > after and what.startswith(f"reload: {model}:")), None)


def reloaded(supervisor, model: str, after: float = float("-inf")) -> float | None:
    """When ``model``'s new copy served, first after ``after``."""
    return next((t for t, what in supervisor.reloader.events
                 if t > after and what == f"reloaded: {model}"), None)


def server_restarts(supervisor) -> int:
    return sum(1 for _, what in supervisor.events if what.startswith("restart"))


def timeline(supervisor, origin: float, since: float = float("-inf")) -> list[str]:
    """Both event lists in time order from ``since``, as ``+1.23 s reloader: what`` relative to
    ``origin``."""
    events = ([(t, "reloader", what) for t, what in supervisor.reloader.events]
              + [(t, "supervisor", what) for t, what in supervisor.events])
    return [f"{t - origin:+.2f} s {who}: {what}" for t, who, what in sorted(events) if t >= since]
