"""The example inputs of a suggestion: the caller's, or token ids for a transformers model.

A transformers model (one with a ``config`` and a ``main_input_name`` of ``input_ids``) runs
on one sequence of token ids, half its positions long and at most ``TOKENS``, with
``decoder_input_ids`` as well for an encoder-decoder. Any other module needs
``example_inputs``, as ``tpfn.explain`` takes them: tensors, shapes (token ids, below the
smallest embedding's vocabulary), a tuple of them or a dict. The dry runs take them real,
on the CPU (``tpfn.suggest.hybrid``), and a shape as seeded random ids.

>>> args, kwargs = example(nn.Embedding(10, 4), (2, 3))
>>> args[0].shape, args[0].dtype, bool((args[0] < 10).all())
(torch.Size([2, 3]), torch.int64, True)
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from tpfn.dryrun.explain import ExampleInput, split_inputs
from tpfn.suggest.hybrid import real

__all__ = ["example", "defaults", "TOKENS"]

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


def example(model: nn.Module, example_inputs) -> tuple:
    """``(args, kwargs)`` of the dry runs from ``example_inputs`` (None: a transformers
    model's defaults)."""
    if example_inputs is None:
        example_inputs = defaults(model)
        if example_inputs is None:
            raise TypeError(
                f"suggest runs one forward of {type(model).__name__} to see where its features go: "
                "give example_inputs= as tpfn.explain takes them, e.g. (8, 128) for token ids, or "
                "{'x': torch.randn(8, 128, 512)} for a keyword input.")
    vocab = min((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=2)
    gen = torch.Generator().manual_seed(0)

    def make(x):
        if isinstance(x, ExampleInput):
            x = torch.empty(x.meta({}).shape, dtype=x.dtype).requires_grad_(x.requires_grad)
        if isinstance(x, (tuple, list, torch.Size)) and all(isinstance(d, int) for d in x):
            return torch.randint(0, vocab, tuple(x), generator=gen)
        return real(x)

    return split_inputs(example_inputs, make)
