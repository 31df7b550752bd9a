"""Random numbers in tensor-parallel regions: the same where tensors are replicated, distinct
where they are sharded.

Outside ``sharded(mesh)`` every rank draws from the default generator. Started from the same
seed and drawing the same amounts, the ranks draw the same numbers: dropout on a replicated
activation gets the same mask everywhere, as it must. Entering ``sharded(mesh)`` draws one
seed from the default generator (the same on every rank, so the ranks stay in step), mixes
in the rank's mesh coordinate, and makes that the generator's state until the block ends:
dropout on a sharded activation gets a different mask on every shard. The default stream
then continues where the draw left it. Because the seed comes from the default generator,
``torch.manual_seed`` reproduces the shards' draws, and activation checkpointing (which
saves and restores the default generator) recomputes the same masks.

tpfn enters ``sharded`` itself around ``on_shards`` modules and around sequence-parallel
dropout modules other than ``nn.Dropout``. In training it draws the seed, so each call's
masks are new. In eval mode (dropout off) it passes a ``key`` of the module's own: the seed is
then read from the default generator's state and the key, not drawn, and the default stream
goes on as it was found, as on one device where the module draws nothing (fused experts: the
random numbers after them, a diffusion model's noise, are one device's). A module that draws
in eval mode anyway, called again with no draw from the default stream between, draws the
same numbers again. ``sequence_parallel()`` on an ``nn.Dropout`` does better: it draws the
mask of the whole sequence from the default generator and applies its own slice, so the
masks are the ones a single device draws.

>>> import torch
>>> from torch.distributed.device_mesh import init_device_mesh
>>> mesh = init_device_mesh("cpu", (1,))
>>> _ = torch.manual_seed(0)
>>> with sharded(mesh):
...     a = torch.rand(2)
>>> _ = torch.manual_seed(0)
>>> with sharded(mesh):
...     b = torch.rand(2)
>>> torch.equal(a, b)                     # reproduced from the seed
True
"""

from __future__ import annotations

import contextlib
import hashlib

import torch

__all__ = ["sharded"]


def _default_generator(device_type: str) -> torch.Generator:
    if device_type == "cpu":
        return torch.default_generator
    module = getattr(torch, device_type)
    return module.default_generators[module.current_device()]


@contextlib.contextmanager
def sharded(mesh, key: str | None = None):
    """Random draws inside come from a stream of this rank's own, seeded from the default one:
    by a draw from it, or (``key``) from its state and ``key``, leaving it as it was."""
    default = _default_generator(mesh.device_type)
    if key is None:
        seed = int(torch.randint(2**62, (), generator=default))
        saved = default.get_state()
    else:
        saved = default.get_state()
        digest = hashlib.blake2b(saved.numpy().tobytes() + key.encode(), digest_size=8)
        seed = int.from_bytes(digest.digest(), "little") >> 2
    shard = hash((seed, 2718) + tuple(mesh.get_coordinate())) & (2**63 - 1)
    default.manual_seed(shard)
    try:
        yield
    finally:
        default.set_state(saved)
