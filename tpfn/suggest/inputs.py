"""The example inputs of a suggestion: the caller's, or token ids for a transformers model.

A transformers model (one with a ``config`` and a ``main_input_name`` of ``input_ids``) runs
on one sequence of ``min(2048, its positions)`` token ids, with ``decoder_input_ids`` as well
for an encoder-decoder, and ``use_cache=True`` where it takes one (a model set up for
training reads its position ids' values, which meta tensors do not have). Any other module
needs ``example_inputs``. Inputs are given to ``explain`` as they are, and made meta tensors
for the trace.

>>> import torch.nn as nn
>>> example(nn.Linear(4, 8), (2, 4))[0]
(tensor(..., device='meta', size=(2, 4), dtype=torch.int64),)
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from tpfn.dryrun.explain import ExampleInput, split_inputs

__all__ = ["example", "defaults", "TOKENS"]

TOKENS = 2048  # the longest default sequence


def defaults(model: nn.Module):
    """The example inputs of a transformers model (a dict of shapes and flags), or None."""
    config = getattr(model, "config", None)
    if config is None or getattr(model, "main_input_name", None) != "input_ids":
        return None
    positions = [getattr(config, k, None) for k in ("max_position_embeddings", "n_positions",
                                                     "max_sequence_length", "seq_length")]
    length = min([TOKENS] + [p for p in positions if isinstance(p, int) and p > 0])
    found = {"input_ids": (1, length)}
    try:
        names = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        names = {}
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in names:
        found["decoder_input_ids"] = (1, length)
    if "use_cache" in names:
        found["use_cache"] = True
    return found


def _meta(x):
    if isinstance(x, ExampleInput):
        return x.meta({})
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta")
    if isinstance(x, (tuple, list, torch.Size)) and all(isinstance(d, int) for d in x):
        return torch.empty(tuple(x), dtype=torch.long, device="meta")
    return x


def example(model: nn.Module, example_inputs) -> tuple:
    """``(args, kwargs)`` of meta tensors from ``example_inputs`` (see ``explain``), or the
    defaults of a transformers model."""
    if example_inputs is None:
        example_inputs = defaults(model)
        if example_inputs is None:
            raise TypeError(
                f"suggest runs one forward of {type(model).__name__} on meta tensors to see where its "
                "features go: give example_inputs= as explain takes them, e.g. (8, 128) for token "
                "ids, {'x': torch.empty(8, 128, 512)} for a keyword input.")
    return split_inputs(example_inputs, _meta)
