"""The project's error hierarchy.

Every error a user can cause derives from :class:`OrchError`, so the CLI can print it as a
message instead of a traceback. Plan problems are collected into one :class:`PlanError` so a
user sees every problem of a plan at once, each naming the field, the value and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass


class OrchError(Exception):
    """Base of every error the orchestrator raises on purpose."""


def first_line(error: BaseException, limit: int = 300) -> str:
    """The first line of ``error``'s message, at most ``limit`` characters ('' when it has none):
    what a short message quotes of an exception raised by a library."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else ""


@dataclass(frozen=True)
class Violation:
    """One problem with a declared setting."""

    field: str
    """Dotted config key, e.g. ``plan.zero_stage``."""
    value: object
    """The value the user declared (or that was resolved)."""
    message: str
    """What is wrong, with the arithmetic where there is some."""
    fix: str
    """The smallest change that resolves it."""

    def __str__(self) -> str:
        return f"{self.field}={self.value!r}: {self.message} Fix: {self.fix}"

    def as_dict(self) -> dict[str, str]:
        return {"field": self.field, "value": repr(self.value), "message": self.message, "fix": self.fix}


class PlanError(OrchError):
    """A plan that cannot run, with every problem found."""

    def __init__(self, violations: list[Violation]):
        # Each distinct problem once: two checks that meet the same problem (the declared values,
        # then the built workload) would otherwise show it twice.
        seen: set[str] = set()
        self.violations = [v for v in violations if not (str(v) in seen or seen.add(str(v)))]
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"the plan has {len(self.violations)} problem(s):\n{lines}")

    def __reduce__(self):
        # Keep the violations when the error crosses a process boundary (Ray pickles it).
        return (type(self), (self.violations,))


class PipelineRefused(ValueError):
    """A model's ``pipeline_layers()`` cannot split this model into pipeline stages; the message says why."""
