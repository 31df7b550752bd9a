"""Channel-parallel blocks: a state-space mixer (Mamba's) or a recurrent time mixing (RWKV's)
sharded on its channels, as Megatron and vLLM shard Mamba.

A block is a module whose children are input projections making ``k`` channels (or two
parts of ``k``: the channels and their gate), a depthwise ``nn.Conv1d`` over the ``k``
channels (or, without one, parameters of the module's own, one per channel: RWKV's
``time_decay`` and ``time_first``), projections that contract the channels (``x_proj``: the
scan's ``dt``, ``B`` and ``C``) or expand back to them (``dt_proj``), and an output projection
contracting them back to the input's width; its own parameters are per channel (``A_log``,
``D``: ``k`` rows), or replicated on the input's side (RWKV's ``time_mix_key``). Each
rank takes ``1/n`` of the channels through the whole block:

- the input projections column-wise (``colwise(parts=2)`` for the channels and their gate),
  the output projection row-wise: one all-reduce of its partial sums per forward;
- the depthwise convolution, the scan and the block's own per-channel parameters on the rank's
  channels (``Shard(0)``; a convolution the block calls as a module holds its groups per rank,
  ``per_rank('groups')``; one whose weights the block reads itself, as transformers' mixer
  does, is placed on the block);
- a projection contracting the channels (``x_proj``) computes whole on the gathered channels
  (each rank's scan reads every one of its outputs); the gradients the ranks' channels give
  its output are partial sums, and it hands them back so: its weight's summed at the end of
  the backward, its input's reduce-scattered back to the channels. A projection expanding to
  the channels (``dt_proj``) is column-wise, its input's gradient handed back as a partial
  sum for ``x_proj`` to sum with the rest;
- the block's int attributes that hold ``k`` (``d_inner``) are held per rank where its forward
  reads them (the ranks' check says which).

What a block cannot be sharded for (channels the ranks do not split, a child of another kind
with parameters, parameters of another length) is said in a note, and the block's modules are
then planned as any others.

>>> import torch
>>> class Mixer(nn.Module):  # Mamba's, its forward aside
...     def __init__(self, d=8, k=16):
...         super().__init__()
...         self.d_inner, self.in_proj = k, nn.Linear(d, 2 * k, bias=False)
...         self.conv1d = nn.Conv1d(k, k, 4, groups=k, padding=3)
...         self.x_proj, self.dt_proj = nn.Linear(k, 12, bias=False), nn.Linear(4, k)
...         self.A_log, self.D = nn.Parameter(torch.zeros(k, 4)), nn.Parameter(torch.ones(k))
...         self.out_proj = nn.Linear(k, d, bias=False)
>>> [block] = blocks(nn.ModuleDict(dict(mixer=Mixer())), 2)
>>> block.fqn, block.channels, block.entries, block.exit, block.contract, block.expand, block.conv
('mixer', 16, ('in_proj',), 'out_proj', ('x_proj',), ('dt_proj',), 'conv1d')
>>> block.styles({"mixer", "mixer.conv1d", "mixer.x_proj", "mixer.dt_proj"}, ("d_inner",))["mixer"]
params(A_log=Shard(dim=0), D=Shard(dim=0)) >> on_shards(Replicate()) >> per_rank('d_inner')
"""

from __future__ import annotations

import attrs
import torch.nn as nn

from tpfn._fqn import join
from tpfn.layout import Partial, Replicate, Shard
from tpfn.style.constructors import colwise, on_shards, params, per_rank, prepare_in, rowwise

__all__ = ["Block", "blocks", "contracting", "depthwise"]


def contracting(bias: bool):
    """The style of a projection contracting a block's channels: whole on the gathered
    channels, handing back the partial gradients the ranks' channels give its output.

    >>> contracting(False)
    prepare_in(Shard(dim=-1), desired=Replicate(), local=True) >> params(weight=Replicate()) >> on_shards(Replicate(), grads=Partial(), output=Replicate(), param_grads={'weight': Partial()})
    """
    names = ("weight", "bias") if bias else ("weight",)
    return (prepare_in(Shard(-1), desired=Replicate(), local=True) >> params(**dict.fromkeys(names, Replicate()))
            >> on_shards(Replicate(), grads=Partial(), output=Replicate(),
                         param_grads=dict.fromkeys(names, Partial())))


def depthwise(bias: bool):
    """The style of a depthwise ``nn.Conv1d`` on each rank's channels.

    >>> depthwise(True)
    params(bias=Shard(dim=0), weight=Shard(dim=0)) >> on_shards(Shard(dim=1), output=Shard(dim=1)) >> per_rank('groups')
    """
    names = ("weight", "bias") if bias else ("weight",)
    return params(**dict.fromkeys(names, Shard(0))) >> on_shards(Shard(1), output=Shard(1)) >> per_rank("groups")


@attrs.frozen
class Block:
    """A channel-parallel block: its module, its ``channels`` (``k``), the children making
    them (``entries``, each of ``parts`` packed parts of ``k``), contracting them back
    (``exit``), mixing them (``conv``, a depthwise convolution, or None), contracting them into
    what every channel reads (``contract``) and expanding that back (``expand``); its own
    parameters one row per channel (``own``) and the others (``whole``, replicated: RWKV's
    ``time_mix_key``, on the input's side), and its int attributes holding ``k``."""

    fqn: str
    channels: int
    entries: tuple
    parts: tuple
    exit: str
    conv: str | None
    contract: tuple
    expand: tuple
    own: tuple
    whole: tuple
    sizes: tuple
    biases: tuple  # the children (conv, contract, expand) that have a bias

    @property
    def members(self) -> tuple:
        """Every child the block's rules bind."""
        return tuple(join(self.fqn, c) for c in (*self.entries, self.exit, *([self.conv] if self.conv else []),
                                                 *self.contract, *self.expand))

    @property
    def linears(self) -> tuple:
        return tuple(join(self.fqn, c) for c in (*self.entries, self.exit, *self.contract, *self.expand))

    def styles(self, called: set, sizes: tuple) -> dict:
        """``{fqn: style}`` of the block and its children; ``called``: the modules the forward
        calls (a child it does not call has its parameters read by the block, which holds
        them); ``sizes``: the attributes held per rank."""
        rules = {**dict.fromkeys(self.own, Shard(0)), **dict.fromkeys(self.whole, Replicate())}
        out = {join(self.fqn, e): colwise(parts=p) if p > 1 else colwise() for e, p in zip(self.entries, self.parts)}
        out[join(self.fqn, self.exit)] = rowwise()
        for child in ([self.conv] if self.conv else []) + list(self.expand):
            fqn = join(self.fqn, child)
            if fqn in called:
                out[fqn] = (depthwise(child in self.biases) if child == self.conv else
                            prepare_in(Replicate(), grads=Partial(), local=True) >> colwise())
            else:
                rules.update(dict.fromkeys([f"{child}.weight", *([f"{child}.bias"] if child in self.biases else [])],
                                           Shard(0)))
        for child in self.contract:
            out[join(self.fqn, child)] = contracting(child in self.biases)
        style = params(**rules) >> on_shards(Replicate())
        out[self.fqn] = style >> per_rank(*sizes) if sizes else style
        return out

    def describe(self, n: int) -> str:
        """One line on the block, as a group's is."""
        entries = ", ".join(f"{e} ({p} parts of {self.channels})" if p > 1 else f"{e} ({self.channels} channels)"
                            for e, p in zip(self.entries, self.parts))
        mixed = ", ".join([*([self.conv] if self.conv else []), *self.own])
        whole = f"; {', '.join(self.contract)} whole on the gathered channels" if self.contract else ""
        return (f"over {n} ranks, a channel-parallel block: {entries} column-wise; {mixed} and the scan "
                f"on each rank's channels{whole}; {self.exit} row-wise, one all-reduce")


def _linears(module: nn.Module) -> dict:
    return {name: c for name, c in module.named_children() if isinstance(c, nn.Linear)}


def _find(module: nn.Module, fqn: str, n: int):
    """The ``Block`` of ``module`` (None: no block), or a sentence: a block that cannot be sharded.

    ``k`` is the depthwise convolution's channels, else the one length of the module's own 1-D
    parameters (RWKV's ``time_decay``); the exit is the last linear registered that contracts
    ``k`` back to the entries' input width, registered after them."""
    children = dict(module.named_children())
    convs = [name for name, c in children.items() if isinstance(c, nn.Conv1d) and c.groups == c.in_channels
             == c.out_channels > 1 and type(c).forward is nn.Conv1d.forward]
    own = tuple(name for name, _ in module.named_parameters(recurse=False))
    rows = {module.get_parameter(name).shape[0] for name in own if module.get_parameter(name).dim() == 1}
    if len(convs) > 1 or not convs and len(rows - {1}) != 1:
        return None
    conv = convs[0] if convs else None
    k = children[conv].in_channels if conv else next(iter(rows - {1}))
    linears = _linears(module)
    widths = {c.in_features for c in linears.values() if c.out_features in (k, 2 * k)}
    exits = [name for name, c in linears.items() if c.in_features == k and c.out_features in widths]
    if not exits:
        return None
    exit_ = exits[-1]
    width = linears[exit_].out_features
    entries = tuple(name for name, c in linears.items() if name != exit_ and c.in_features == width
                    and c.out_features in (k, 2 * k))
    contract = tuple(name for name, c in linears.items() if name != exit_ and c.in_features == k
                     and name not in entries)
    expand = tuple(name for name, c in linears.items() if name not in (exit_, *entries, *contract)
                   and c.out_features == k)
    if not entries or not (conv or own) or expand and not contract:
        return None
    others = [name for name, c in children.items() if name not in (conv, exit_, *entries, *contract, *expand)
              and any(True for _ in c.parameters())]
    where = f"{fqn!r} ({type(module).__name__})"
    if others and conv:  # (a depthwise convolution between projections: worth a word)
        return f"{where} is no channel-parallel block: its child {others[0]!r} has parameters of its own"
    if others or list(linears).index(exit_) < max(map(list(linears).index, entries)):
        return None
    if k % n:
        return f"{where}: its {k} channels do not split evenly over {n} ranks"
    sizes = tuple(sorted(name for name, v in vars(module).items()
                         if type(v) is int and v == k and not name.startswith("_")))
    biases = tuple(c for c in (conv, *contract, *expand) if c and getattr(children[c], "bias", None) is not None)
    parts = tuple(linears[e].out_features // k for e in entries)
    per_channel = tuple(name for name in own if module.get_parameter(name).shape[:1] == (k,))
    whole = tuple(name for name in own if name not in per_channel)
    return Block(fqn, k, entries, parts, exit_, conv, contract, expand, per_channel, whole, sizes, biases)


def blocks(model: nn.Module, n: int) -> list:
    """The channel-parallel blocks of ``model`` on ``n`` ranks: a ``Block`` each, or a
    ``(fqn, why)`` for one that cannot be sharded."""
    found = []
    for fqn, module in model.named_modules():
        block = _find(module, fqn, n)
        if isinstance(block, str):
            found.append((fqn, block))
        elif block is not None:
            found.append(block)
    return found
