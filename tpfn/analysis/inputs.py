"""The example inputs of a dry run: the caller's, or token ids for a transformers model.

A transformers model (one with a ``config`` and a ``main_input_name`` of ``input_ids``) runs
on one sequence of token ids, half its positions long and at most ``TOKENS``, with
``decoder_input_ids`` as well for an encoder-decoder. Any other module needs
``example_inputs``, as ``tpfn.explain`` takes them: tensors, shapes (token ids, below the
smallest embedding's vocabulary), a tuple of them or a dict. The dry runs take them real,
on the CPU (``tpfn.analysis.hybrid``), and a shape as seeded random ids.

>>> args, kwargs = example(nn.Embedding(10, 4), (2, 3))
>>> args[0].shape, args[0].dtype, bool((args[0] < 10).all())
(torch.Size([2, 3]), torch.int64, True)
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import attrs
import sympy
import torch
import torch.nn as nn

from tpfn.analysis.hybrid import real

__all__ = ["example", "defaults", "TOKENS", "ExampleInput", "is_shape", "split_inputs", "tensors", "floats",
           "vocabulary"]

TOKENS = 512  # the longest default sequence
_LENGTHS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length",
            "max_seq_len", "n_ctx")


def defaults(model: nn.Module):
    """The example inputs of a transformers model (a dict of shapes), or None."""
    config = getattr(model, "config", None)
    if config is None or getattr(model, "main_input_name", None) != "input_ids":
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limits = [getattr(c, k, None) for c in (config, text) for k in _LENGTHS]
    length = min([TOKENS] + [p // 2 for p in limits if isinstance(p, int) and p > 1])
    found = {"input_ids": (1, length)}
    try:
        names = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        names = {}
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in names:
        found["decoder_input_ids"] = (1, length)
    return found


def example(model: nn.Module, example_inputs, who: str = "suggest") -> tuple:
    """``(args, kwargs)`` of the dry runs from ``example_inputs`` (None: a transformers
    model's defaults); ``who``: the tool, for the error of a model that needs inputs."""
    if example_inputs is None:
        example_inputs = defaults(model)
        if example_inputs is None:
            raise TypeError(
                f"{who} runs one forward of {type(model).__name__} to see where its features go: "
                "give example_inputs= as tpfn.explain takes them, e.g. (8, 128) for token ids, or "
                "{'x': torch.randn(8, 128, 512)} for a keyword input.")
    vocab = vocabulary(model)
    gen = torch.Generator().manual_seed(0)

    def make(x):
        if isinstance(x, ExampleInput):
            return x.real({}, vocab, gen)
        if isinstance(x, (tuple, list, torch.Size)) and all(isinstance(d, int) for d in x):
            return torch.randint(0, vocab, tuple(x), generator=gen)
        return real(x)

    return split_inputs(example_inputs, make)


def vocabulary(model: nn.Module) -> int:
    """The ids below which a token-id input is valid: the smallest embedding's vocabulary (2
    where there is none)."""
    return min((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=2)


@attrs.frozen
class ExampleInput:
    """An example input as a shape (ints or sympy expressions), a dtype and a gradient flag;
    ``value``: the tensor it was given as, if any."""

    shape: tuple
    dtype: torch.dtype
    requires_grad: bool = False
    value: object = attrs.field(default=None, eq=False, repr=False)

    def meta(self, values: dict) -> torch.Tensor:
        shape = [int(sympy.sympify(d).subs(values)) for d in self.shape]
        return torch.empty(shape, dtype=self.dtype, device="meta", requires_grad=self.requires_grad)

    def real(self, values: dict, vocab: int, gen: torch.Generator) -> torch.Tensor:
        """The input as a dry run takes it (``tpfn.analysis.hybrid.real``): the tensor given, or
        one of its shape at ``values``: token ids below ``vocab`` for an integer dtype, random
        values for a floating one (meta where it needs a gradient)."""
        if isinstance(self.value, torch.Tensor):
            return real(self.value)
        shape = self.meta(values).shape
        if self.requires_grad:
            return torch.empty(shape, dtype=self.dtype, device="meta", requires_grad=True)
        if self.dtype.is_floating_point or self.dtype.is_complex:
            return torch.randn(shape, generator=gen).to(self.dtype)
        if self.dtype == torch.bool:
            return torch.ones(shape, dtype=torch.bool)
        return torch.randint(0, vocab, shape, generator=gen, dtype=self.dtype)


def is_shape(x) -> bool:
    """Whether ``x`` is one shape (a tuple of ints or sympy expressions), not a tuple of inputs."""
    sizes = lambda d: isinstance(d, (int, sympy.Expr)) and not isinstance(d, bool)  # noqa: E731
    return isinstance(x, (tuple, list, torch.Size)) and all(map(sizes, x))


def split_inputs(example_inputs, make, shape=is_shape) -> tuple:
    """``(args, kwargs)`` of ``example_inputs`` (a tensor, a shape, a tuple of them or a dict), each
    value made by ``make``; ``shape`` tells one shape from a tuple of inputs."""
    if isinstance(example_inputs, Mapping):
        return (), {k: make(v) for k, v in example_inputs.items()}
    if isinstance(example_inputs, torch.Tensor) or (shape(example_inputs) and example_inputs):
        return (make(example_inputs),), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(make(x) for x in example_inputs), {}
    raise TypeError(
        "'example_inputs' must be a tensor, a shape, a tuple of them (positional inputs) or a "
        f"dict (keyword inputs) (got {example_inputs!r} that is a {type(example_inputs)!r}).")


def tensors(x) -> list:
    """The tensors in an input or output (tensors, tuples, lists, dicts), in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    items = x.values() if isinstance(x, Mapping) else x if isinstance(x, (tuple, list)) else ()
    return [t for item in items for t in tensors(item)]


def floats(out) -> list:
    """Every floating-point tensor in an output (tensors, tuples, lists, dicts) that needs a gradient."""
    return [t for t in tensors(out) if t.is_floating_point() and t.requires_grad]
