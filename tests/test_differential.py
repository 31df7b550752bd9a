"""Differential: fast kernels = the reference path = one device, under random observers.

Hypothesis draws a plain description (a dict of ints, strings and flags) of a small block
and what a user does to it; the description is shipped to two gloo ranks, each of which
builds the block three times (one device, ``parallelize(..., kernels=False)`` and
``kernels=True``, from one seed), does the same to each and compares everything it saw:

- the block: ``x + inner(drop(pre(x)))`` on inputs of 2 to 4 dims (3 under sequence
  parallelism), ``pre`` a LayerNorm (sequence-parallel when the block's input is a sequence
  shard) or ``2 * x``, ``drop`` maybe a dropout of the transposed (non-contiguous) activation
  (sequence-parallel on its dim 0 where the sequence is sharded), maybe ``inner`` recomputed
  in the backward (``torch.utils.checkpoint``, reentrant or not); ``inner`` attention-shaped
  (q, k, v column-wise, o row-wise, k's output maybe detached, v's unused or q's changed in
  place) or an MLP (column-wise, activation (``ReLU(inplace=True)`` too), row-wise), reading
  one shared local replica of its input (its parent's ``prepare_in``: replicated, or gathered
  from the sequence shards), maybe also adding that input to its output (a reader of the
  replica that takes its whole gradient), maybe computing k (fc1) in a worker thread; sizes
  divisible by 2;
- observers: tensor hooks on a linear's input or output, ``retain_grad`` on a linear's
  input, full backward hooks on a linear, parameter hooks (a clipping one) and
  post-accumulate hooks registered after ``parallelize``, ``torch.autograd.grad`` of the
  loss with respect to the input or to a linear's output instead of ``backward``;
- changes: an in-place step on a parameter between forward and backward (one device
  refuses the backward where the parameter was saved for it: every rank must refuse it
  too), a ``.data`` write of a linear's weight in its forward pre-hook, frozen parameters
  (before or after ``parallelize``), an input that needs no gradient, a parameter replaced
  after ``parallelize`` (by one laid out alike), the block deep-copied after ``parallelize``.

Every tensor is compared in the layout the user holds it in: the block's input and output
and their gradients as this rank's part of the block's layout; a column-wise linear's
input (the replica) whole and its output as this rank's columns; a row-wise linear's input
as this rank's columns and its output whole; parameters and their gradients as global
values. What raised (the phase and the kind, and whether it is autograd's in-place
refusal) is compared too.

The default run keeps to a couple of minutes on two cores; ``HYPOTHESIS_PROFILE=thorough``
(the ``tpfn-thorough`` profile of tests/conftest.py) runs many more examples.
"""

from __future__ import annotations

import concurrent.futures
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint as checkpoint
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import tpfn
from tests.models import full
from tests.ranks import mesh
from tpfn import Replicate, Shard, colwise, prepare_in, prepare_out, rowwise, sequence_parallel

# One forward and backward against one device: sharding reorders float32 sums only, a few
# ulps (as tests/test_shared_input.py and tests/test_trust.py); a lost, partial or doubled
# reduction is off by order 1.
TOL = 1e-5
INPLACE = "modified by an inplace operation"
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
# each example builds and runs three models on each of the two ranks: about 0.4 s on two cores
EXAMPLES = settings().max_examples if THOROUGH else min(settings().max_examples, 100)

COLWISE = {"attn": ("q", "k", "v"), "mlp": ("fc1",)}
ROWWISE = {"attn": ("o",), "mlp": ("fc2",)}


def _thread(fn, x, thread: bool):
    """``fn(x)``, in a worker thread where ``thread`` says."""
    if not thread:
        return fn(x)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, x).result()


class Attn(nn.Module):
    def __init__(self, dim: int, bias: bool, residual: bool, variant: str, thread: bool):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=bias) for _ in range(4))
        self.residual, self.variant, self.thread = residual, variant, thread

    def forward(self, x):
        q, k, v = self.q(x), _thread(self.k, x, self.thread), self.v(x)
        if self.variant == "k detached":
            k = k.detach()
        if self.variant == "q in place":
            q.mul_(2)
        h = q * k.sigmoid() if self.variant == "v unused" else q * k.sigmoid() + v
        out = self.o(h)
        return out + x if self.residual else out


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool, residual: bool, act: str, thread: bool):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden, bias=bias), nn.Linear(hidden, dim, bias=bias)
        self.act = {"gelu": nn.GELU(), "tanh": nn.Tanh(), "relu in place": nn.ReLU(inplace=True)}[act]
        self.residual, self.thread = residual, thread

    def forward(self, x):
        out = self.fc2(self.act(_thread(self.fc1, x, self.thread)))
        return out + x if self.residual else out


class Block(nn.Module):
    """``x + inner(drop(pre(x)))``: the inner module's input is read by it alone (never the
    user's leaf, whose gradient also holds the outer residual's)."""

    def __init__(self, d: dict):
        super().__init__()
        torch.manual_seed(d["seed"])
        self.norm = nn.LayerNorm(d["dim"]) if d["norm"] else None
        if self.norm is not None:
            with torch.no_grad():
                self.norm.weight.normal_()
                self.norm.bias.normal_()
        self.drop = nn.Dropout(0.25) if d["dropout"] else None
        self.inner = Attn(d["dim"], d["bias"], d["residual"], d["variant"], d["thread"]) if d["kind"] == "attn" \
            else MLP(d["dim"], d["hidden"], d["bias"], d["residual"], d["variant"], d["thread"])
        self.checkpointed = d["checkpoint"]

    def forward(self, x):
        h = self.norm(x) if self.norm is not None else 2 * x
        if self.drop is not None:  # on the activation transposed: (sequence, batch, ...)
            h = self.drop(h.transpose(0, -2)).transpose(0, -2)
        if self.checkpointed is None:
            return x + self.inner(h)
        return x + checkpoint.checkpoint(self.inner, h, use_reentrant=self.checkpointed == "reentrant")


def plan(d: dict) -> dict:
    kind = d["kind"]
    linears = {f"inner.{n}": colwise() for n in COLWISE[kind]}
    linears.update({f"inner.{n}": rowwise() for n in ROWWISE[kind]})
    if not d["sp"]:
        return {"inner": prepare_in(Replicate(), local=True), **linears}
    norm = {"norm": sequence_parallel(local=True)} if d["norm"] else {}
    drop = {"drop": sequence_parallel(dim=0, local=True)} if d["dropout"] else {}
    return {**norm, **drop, "inner": prepare_in(Shard(1), desired=Replicate(), local=True)
            >> prepare_out(Shard(1), given=Replicate(), local=True), **linears}


# The description --------------------------------------------------------------------------

def _params(d: dict) -> list:
    names = [f"norm.{p}" for p in ("weight", "bias")] if d["norm"] else []
    for n in COLWISE[d["kind"]] + ROWWISE[d["kind"]]:
        names += [f"inner.{n}.weight"] + ([f"inner.{n}.bias"] if d["bias"] else [])
    return names


@st.composite
def descriptions(draw) -> dict:
    kind = draw(st.sampled_from(["attn", "mlp"]))
    d = {
        "kind": kind,
        "dim": draw(st.sampled_from([4, 8])),
        "hidden": draw(st.sampled_from([4, 8, 12])),
        "batch": draw(st.integers(1, 2)),
        "seq": draw(st.sampled_from([2, 4, 6])),
        "bias": draw(st.booleans()),
        "residual": draw(st.booleans()),
        "sp": draw(st.booleans()),
        "variant": draw(st.sampled_from(["plain", "k detached", "v unused", "q in place"] if kind == "attn"
                                        else ["gelu", "tanh", "relu in place"])),
        "input_grad": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
        "thread": draw(st.booleans()),
        "dropout": draw(st.booleans()),
        "checkpoint": draw(st.sampled_from([None, "reentrant", "non-reentrant"])),
        "deepcopy": draw(st.booleans()),
    }
    d["norm"] = draw(st.booleans())
    d["ndim"] = 3 if d["sp"] else draw(st.sampled_from([2, 3, 4]))
    params = _params(d)
    d["replaced"] = draw(st.one_of(st.none(), st.sampled_from(params)))
    linears = COLWISE[kind] + ROWWISE[kind]
    d["frozen"] = tuple(draw(st.lists(st.sampled_from(params), max_size=2, unique=True)))
    d["frozen_before"] = draw(st.booleans())
    observer = st.one_of(
        st.tuples(st.sampled_from(["retain_grad", "input hook", "output hook", "backward hook",
                                   "data write"]), st.sampled_from(linears)),
        st.tuples(st.sampled_from(["clip hook", "post hook", "step"]), st.sampled_from(params)),
    )
    d["observers"] = tuple(draw(st.lists(observer, max_size=3, unique=True)))
    d["loss"] = draw(st.one_of(st.just(("backward",)), st.just(("grad", "input")),
                               st.tuples(st.just("grad"), st.sampled_from(linears))))
    # Under sequence parallelism q receives the gathered sequence, a tensor its parent's slot
    # makes at every call, where one device's q receives the checkpointed function's own input;
    # and the parent returns its output slot's shard, where one device's returns o's (fc2's)
    # output itself, which reentrant checkpointing then makes its own output. So under
    # checkpointing an observer a pre-hook puts on what q receives, or autograd.grad of o's
    # output, meets a tensor made without gradients (reentrant: the first forward) or recomputed
    # (non-reentrant: one the backward does not read), as under native TP: they differ by design.
    assume(not (d["sp"] and d["checkpoint"] is not None
                and any(kind in ("input hook", "retain_grad") for kind, _ in d["observers"])))
    assume(not (d["sp"] and d["checkpoint"] == "reentrant" and d["loss"][0] == "grad" and d["loss"][1] != "input"))
    # torch 2.13 crashes (a segmentation fault) registering a hook on a view of a tensor that
    # requires grad changed in place under no_grad: one device's own nn.Linear output (3-D, with a
    # bias), computed in a worker thread (gradients on) in reentrant checkpointing's first forward
    # (gradients off), then changed in place, then hooked by the next linear's pre-hook.
    assume(not (d["thread"] and d["checkpoint"] == "reentrant" and d["variant"] in ("relu in place", "q in place")
                and any(kind in ("input hook", "retain_grad") for kind, _ in d["observers"])))
    # torch forbids writing in place the output of a module with a backward hook; one device
    # meets it in the reentrant recomputation's backward (or has nothing to differentiate), the
    # reference route in the first forward when a worker thread turns gradients on inside it.
    assume(not (d["thread"] and d["checkpoint"] == "reentrant" and d["variant"] in ("relu in place", "q in place")
                and any(kind == "backward hook" for kind, _ in d["observers"])))
    return d


# One run ----------------------------------------------------------------------------------

def _layouts(d: dict) -> dict:
    """Where each linear's input and output live on a rank: whole, or this rank's columns."""
    out = {}
    for n in COLWISE[d["kind"]]:
        out[n] = ("whole", "cols")
    for n in ROWWISE[d["kind"]]:
        out[n] = ("cols", "whole")
    return out


class _Seen(dict):
    """key -> (layout, value): a tensor (detached, global if a DTensor), None, or a flag."""

    def put(self, key: str, layout: str, value) -> None:
        if isinstance(value, torch.Tensor):
            value = full(value).detach().clone()
        self[key] = (layout, value)

    def call(self, key: str, layout: str, value) -> None:
        n = sum(1 for k in self if k.startswith(key + " #"))
        self.put(f"{key} #{n}", layout, value)


def _observe(d: dict, model: nn.Module, seen: _Seen, kept: dict) -> None:
    """Put the description's observers (and ``.data`` writes) on ``model``."""
    layouts = _layouts(d)
    for kind, target in d["observers"]:
        if kind in ("clip hook", "post hook", "step"):
            if kind == "step":
                continue
            p = model.get_parameter(target)
            if not p.requires_grad:  # a hook on a frozen parameter is an error everywhere
                continue
            if kind == "clip hook":
                def clip(g, target=target):
                    seen.call(f"clip hook {target}", "param", g is None)
                    return g.clamp(-1, 1)
                p.register_hook(clip)
            else:
                p.register_post_accumulate_grad_hook(
                    lambda p, target=target: seen.call(f"post hook {target}", "param", p.grad))
            continue
        module = model.get_submodule(f"inner.{target}")
        into, out = layouts[target]
        if kind == "retain_grad":
            def pre(m, args, target=target):
                kept[f"retained {target}"] = args[0]
                if args[0].requires_grad:
                    args[0].retain_grad()
            module.register_forward_pre_hook(pre)
        elif kind == "input hook":
            def pre(m, args, target=target, into=into):
                if args[0].requires_grad:
                    args[0].register_hook(lambda g: seen.call(f"input hook {target}", into, g))
            module.register_forward_pre_hook(pre)
        elif kind == "output hook":
            def post(m, args, output, target=target, out=out):
                if output.requires_grad:
                    output.register_hook(lambda g: seen.call(f"output hook {target}", out, g))
            module.register_forward_hook(post)
        elif kind == "backward hook":
            def backward(m, grad_input, grad_output, target=target, into=into, out=out):
                seen.call(f"backward hook {target} grad_input", into, grad_input[0])
                seen.call(f"backward hook {target} grad_output", out, grad_output[0])
            module.register_full_backward_hook(backward)
        elif kind == "data write":
            def write(m, args):
                m.weight.data.mul_(2)
            module.register_forward_pre_hook(write)
    target = d["loss"][1] if d["loss"][0] == "grad" and d["loss"][1] != "input" else None
    if target is not None:  # the output autograd.grad differentiates against
        model.get_submodule(f"inner.{target}").register_forward_hook(
            lambda m, args, output: kept.setdefault("intermediate", output))


def _replace(model: nn.Module, name: str) -> None:
    """Replace parameter ``name`` by a new one of other values, laid out alike (a DTensor's ops keep its layout)."""
    owner, _, leaf = name.rpartition(".")
    old = model.get_parameter(name)
    setattr(model.get_submodule(owner), leaf, nn.Parameter(old.detach() * 0.5 + 0.1, requires_grad=old.requires_grad))


def _run(d: dict, kernels: bool | None) -> _Seen:
    """Build the block (``kernels`` None: on one device), observe it, run one step; what was seen."""
    one_device = kernels is None
    model = Block(d)
    if d["frozen_before"]:
        for name in d["frozen"]:
            model.get_parameter(name).requires_grad_(False)
    if not one_device:
        model = tpfn.parallelize(model, mesh(2), plan(d), kernels=kernels)
    if d["replaced"] is not None:
        _replace(model, d["replaced"])
    if d["deepcopy"]:
        model = copy.deepcopy(model)
    if not d["frozen_before"]:
        for name in d["frozen"]:
            model.get_parameter(name).requires_grad_(False)
    block = "shard" if d["sp"] else "whole"
    shape = (2, d["batch"], d["seq"], d["dim"])[4 - d["ndim"]:]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(d["seed"] + 1))
    if d["sp"] and not one_device:
        x = x.chunk(2, dim=1)[dist.get_rank()]
    x = x.clone().requires_grad_(d["input_grad"])
    seen, kept, phase = _Seen(), {}, "setup"
    try:
        _observe(d, model, seen, kept)
        phase = "forward"
        torch.manual_seed(d["seed"] + 2)  # (dropout: the same draws on every model)
        out = model(x)
        seen.put("output", block, out)
        loss = out.pow(2).sum()
        phase = "step"
        with torch.no_grad():
            for kind, target in d["observers"]:
                if kind == "step":
                    model.get_parameter(target).add_(0.5)
        phase = "backward"
        if d["loss"][0] == "backward":
            loss.backward()
        elif d["loss"][1] == "input":
            (g,) = torch.autograd.grad(loss, [x])
            seen.put("autograd.grad input", block, g)
        else:
            (g,) = torch.autograd.grad(loss, [kept["intermediate"]])
            seen.put(f"autograd.grad {d['loss'][1]} output", _layouts(d)[d["loss"][1]][1], g)
    except Exception as e:  # noqa: BLE001 - what raised is compared with one device's
        seen["raised"] = ("flag", (phase, type(e).__name__, INPLACE in str(e), str(e).splitlines()[0][:200]))
        return seen
    seen.put("input.grad", block, x.grad)
    for name, t in kept.items():
        if name.startswith("retained "):
            linear = name.split()[1]
            seen.put(f"{name} .grad", _layouts(d)[linear][0], t.grad)
    for name, p in model.named_parameters():
        seen.put(name, "param", p)
        seen.put(name + ".grad", "param", p.grad)
        seen.put(name + ".requires_grad", "flag", p.requires_grad)
    return seen


def _mine(t: torch.Tensor, layout: str) -> torch.Tensor:
    """This rank's part of a one-device tensor held in ``layout``."""
    rank = dist.get_rank()
    if layout == "shard":
        return t.chunk(2, dim=1)[rank]
    if layout == "cols":
        return t.chunk(2, dim=-1)[rank]
    return t


def _differences(mine: _Seen, theirs: _Seen, stricter: bool = False, laxer: bool = False) -> dict:
    """What ``mine`` saw that one device did not (key -> description; ``laxer``: where one device
    refuses the backward through a parameter stepped in place, a run that does not refuse is
    taken, the step being on a norm's parameter that the route cannot check); ``stricter``: a refusal
    of the backward through a parameter stepped in place is taken where one device runs (the
    reference route checks every parameter whose gradient it computes; one device, only those an
    op saved: a linear's weight where its input needs a gradient)."""
    found = {}
    refused = mine.get("raised", (None, None))[1]
    if stricter and "raised" not in theirs and refused is not None and refused[:3] == ("backward", "RuntimeError", True):
        return found
    expected = theirs.get("raised", (None, None))[1]
    if laxer and "raised" not in mine and expected is not None and expected[:3] == ("backward", "RuntimeError", True):
        return found
    if "raised" in theirs or "raised" in mine:
        a, b = mine.get("raised", (None, None))[1], theirs.get("raised", (None, None))[1]
        if a is None or b is None or a[:3] != b[:3]:
            found["raised"] = f"{a}; one device: {b}"
        return found  # what the failed step left behind differs by design
    for key in sorted(set(mine) | set(theirs)):
        if key not in mine or key not in theirs:
            found[key] = "only one device saw it" if key in theirs else "one device did not see it"
            continue
        (layout, a), (_, b) = mine[key], theirs[key]
        tensors = isinstance(a, torch.Tensor), isinstance(b, torch.Tensor)
        if not all(tensors):  # None (no gradient), a flag
            if any(tensors) or a != b:
                found[key] = f"{'a tensor' if tensors[0] else a}; one device: {'a tensor' if tensors[1] else b}"
            continue
        b = _mine(b, layout)
        if a.shape != b.shape:
            found[key] = f"shape {tuple(a.shape)}; one device: {tuple(b.shape)}"
            continue
        a, b = a.double(), b.double()
        error = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        if not error <= TOL:
            found[key] = f"error {error:.3g} (norm {a.norm():.4g}; one device {b.norm():.4g})"
    return found


def _three_ways(d: dict) -> dict:
    """The differences of each parallelized run from one device's. The reference route checks a
    parameter stepped in place where it computes that parameter's gradient only (its local view
    is the parameter's local tensor, whose version a DTensor's in-place op leaves alone:
    docs/semantics.md), so a run that steps a frozen parameter, or differentiates only up to an
    intermediate, is compared for the kernels alone. A norm has no kernel: under kernels=True it
    takes the reference route too, with the same limits: where a norm's parameter is stepped
    frozen, or before ``autograd.grad``, the kernels may run where one device refuses."""
    theirs = _run(d, None)
    stepped = {t for kind, t in d["observers"] if kind == "step"}
    norms = {name for name in stepped if name.startswith("norm.")}
    if norms and (norms & set(d["frozen"]) or d["loss"][0] == "grad"):
        return {"reference": {}, "kernels": _differences(_run(d, True), theirs, laxer=True)}
    if stepped and (stepped & set(d["frozen"]) or d["loss"][0] == "grad"):
        return {"reference": {}, "kernels": _differences(_run(d, True), theirs)}
    return {"reference": _differences(_run(d, False), theirs, stricter=True),
            "kernels": _differences(_run(d, True), theirs)}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(descriptions())
def test_kernels_equal_the_reference_equal_one_device(ranks2, d):
    for rank, found in enumerate(ranks2.run(_three_ways, d, timeout=60)):
        assert found == {"reference": {}, "kernels": {}}, (rank, d)
