"""The errors tpfn raises beyond TypeError and ValueError of bad arguments."""

from __future__ import annotations

__all__ = ["PlanError", "LayoutError", "StyleError", "CollectiveError", "CheckpointError"]


class StyleError(ValueError):
    """A composition of styles that cannot mean anything (e.g. inputs prepared after the compute)."""


class PlanError(ValueError):
    """Every problem found while resolving a plan against a module, reported at once:
    ``problems``, one line each. Nothing was changed when this is raised."""

    def __init__(self, problems: list):
        self.problems = list(problems)
        n, lines = len(self.problems), "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"the plan cannot be applied ({n} problem{'s' * (n != 1)}):\n{lines}")


class LayoutError(ValueError):
    """A tensor reached a module slot in a layout other than the one the plan declares."""


class CollectiveError(RuntimeError):
    """A collective that tpfn ran at a module's slot failed (a peer died, raised, or timed out)."""


class CheckpointError(ValueError):
    """Every problem found checking a checkpoint against a model, reported at once: ``problems``, one
    line each naming the key and the file. Nothing was changed when this is raised, on any rank."""

    def __init__(self, problems: list):
        self.problems = list(problems)
        n, lines = len(self.problems), "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"the checkpoint cannot be loaded ({n} problem{'s' * (n != 1)}):\n{lines}")
