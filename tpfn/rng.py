"""Random numbers in tensor-parallel regions: the same where tensors are replicated, distinct
where they are sharded.

Outside ``sharded(mesh)`` every rank draws from the default generator. Started from the same
seed and drawing the same amounts, the ranks draw the same numbers: dropout on a replicated
activation gets the same mask everywhere, as it must. Inside ``sharded(mesh)`` each rank
draws from a stream of its own (seeded from the default generator's seed and the rank's mesh
coordinate), so dropout on a sharded activation gets a different mask on every shard; the
default generator is left exactly as it was, so the ranks stay in step. The streams follow
the default generator's seed; ``manual_seed(seed)`` seeds both and restarts the streams.

tpfn enters ``sharded`` itself around modules that compute on shards (``on_shards``, and
``sequence_parallel`` on modules other than ``nn.Dropout``). ``sequence_parallel()`` on an
``nn.Dropout`` does better: it draws the mask of the whole sequence from the default
generator and applies its own slice, so the masks are the ones a single device draws.

>>> import torch
>>> from torch.distributed.device_mesh import init_device_mesh
>>> mesh = init_device_mesh("cpu", (1,))
>>> _ = torch.manual_seed(0)
>>> with sharded(mesh):
...     a = torch.rand(2)
>>> b = torch.rand(2)                     # the default stream did not move
>>> _ = torch.manual_seed(0)
>>> torch.equal(b, torch.rand(2)), torch.equal(a, b)
(True, False)
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["sharded", "manual_seed"]

_STREAMS: dict = {}  # (mesh, coordinate) -> generator of that rank's stream


def _default_generator(device_type: str) -> torch.Generator:
    if device_type == "cpu":
        return torch.default_generator
    module = getattr(torch, device_type)
    return module.default_generators[module.current_device()]


@contextlib.contextmanager
def sharded(mesh):
    """Random draws inside come from this rank's own stream; the default one is untouched."""
    default = _default_generator(mesh.device_type)
    coordinate = tuple(mesh.get_coordinate())
    seed = default.initial_seed()
    stream = _STREAMS.get((id(mesh), coordinate))
    if stream is None or stream.initial_seed() != _seed(seed, coordinate):
        # new, or the default generator was seeded again: follow it
        stream = torch.Generator(device=default.device).manual_seed(_seed(seed, coordinate))
        _STREAMS[(id(mesh), coordinate)] = stream
    saved = default.get_state()
    default.set_state(stream.get_state())
    try:
        yield
    finally:
        stream.set_state(default.get_state())
        default.set_state(saved)


def _seed(seed: int, coordinate: tuple) -> int:
    return hash((seed, 2718) + coordinate) & (2**63 - 1)


def manual_seed(seed: int) -> None:
    """``torch.manual_seed(seed)``, and every rank's sharded stream restarted from it."""
    torch.manual_seed(seed)
    _STREAMS.clear()
