"""The errors tpfn raises beyond TypeError and ValueError of bad arguments."""

from __future__ import annotations

__all__ = ["ModuleError", "module_error", "PlanError", "LayoutError", "StyleError", "CollectiveError", "CheckpointError"]


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


class ModuleError(RuntimeError):
    """torch's error from a bound module's computation, with the module and the likely cause named."""


def module_error(error: Exception, mount, module, first) -> ModuleError | None:
    """torch's bare ``error`` from the computation of the bound ``module`` (its ``Mount``;
    ``first``: its input 0), with the module and the likely cause named; None for an error that
    says enough, or one this cannot place (a module with submodules: one of them may have
    raised it, and ``tpfn.explain`` names which).

    >>> import torch, tpfn
    >>> bare = RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x8 and 4x4)")
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    >>> (mount,) = tpfn.resolve({"0": tpfn.rowwise()}, model)
    >>> print(module_error(bare, mount, model[0], torch.ones(2, 8)))
    '0' (Linear): mat1 and mat2 shapes cannot be multiplied (2x8 and 4x4). Its input 0, of shape (2, 8) on this rank, is taken to be laid out Shard(dim=-1) (rowwise()); one that arrives whole says so: prepare_in(Replicate(), desired=Shard(-1)) >> rowwise().
    """
    message = str(error).splitlines()[0] if str(error) else ""
    where, style, slots = mount.where, mount.style, mount.inputs.slots
    source = slots[0].source if slots else None
    if type(error) is not RuntimeError or next(module.children(), None) is not None:
        return None  # (tpfn's own errors name their module; so does a ModuleError)
    if "got mixed torch.Tensor and DTensor" in message:
        return ModuleError(
            f"{where}: {message} {style!r} makes its parameters DTensors, and its forward met plain "
            "tensors its style leaves alone; lay its inputs out (prepare_in(Replicate()) for DTensors, "
            "on_shards(...) for local shards; docs/styles.md).")
    if "shapes cannot be multiplied" in message and hasattr(first, "shape") and source is not None:
        return ModuleError(
            f"{where}: {message}. Its input 0, of shape {tuple(first.shape)} on this rank, is taken to "
            f"be laid out {source!r} ({style!r}); one that arrives whole says so: "
            "prepare_in(Replicate(), desired=Shard(-1)) >> rowwise().")
    return None
