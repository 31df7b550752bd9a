"""What a user observes of a parallelized model is what one device shows, kernels or not.

``parallelize(..., kernels=False)`` runs the reference path alone (the semantics);
``kernels=True`` adds fast kernels that must give the same numbers *and* the same observer
behaviour. Each case below came in as a report against the kernels; each runs on two gloo
ranks with both settings and compares against the same model (a deepcopy made before
``parallelize``) run unsharded in the same rank process: the output, the input's gradient,
every parameter and every gradient, and what every observer saw.

The model is one pre-norm block: a LayerNorm, then attention-shaped q, k, v (column-wise)
and o (row-wise) reading one shared local replica of their parent's input (what
``tpfn.from_hf`` installs on Hugging Face attention), the parent also adding that input to
its output (a residual: the replica has a reader that takes its whole gradient). Without
sequence parallelism the replica is the parent's replicated input; with it the norm runs on
sequence shards and the parent gathers its input (the replica is the all-gathered sequence).

1. Observers of the replica: ``retain_grad`` and a tensor hook on the tensor q receives, a
   full backward hook on q (its ``grad_input`` is one device's, whole).
2. A parameter stepped in place between forward and backward (the GAN pattern): autograd's
   "modified by an inplace operation" on every rank, as on one device.
3. The replica or q's weight changed in place before q computes (by the parent's forward,
   or by a forward pre-hook on q through ``.data``): one device's numbers, doing the same.
4. A reader whose gradient never comes (v's output unused, k's detached): its weight's
   hooks are not called (one device calls none); a clipping hook does not crash.

Parameter hooks are registered after ``parallelize``, on the DTensor parameters (those
registered before it move to them: tests/test_adversarial.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import tpfn
from tests.models import clone, full
from tests.ranks import mesh
from tpfn import Replicate, Shard, colwise, prepare_in, prepare_out, rowwise, sequence_parallel

# One forward and backward against one device: sharding reorders float32 sums only, a few
# ulps (as tests/test_shared_input.py); a lost, partial or doubled reduction is off by order 1.
TOL = 1e-5
INPLACE = "modified by an inplace operation"
D = 8
KERNELS = pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "reference"])
SP = pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sequence parallel"])
TIMEOUT = 90  # a rank that raises where the other waits in a collective: fail, do not hang


class Attn(nn.Module):
    """q, k, v read the input; o projects; ``residual`` adds the input to the output.
    ``case`` changes the forward as the reports did (see the cases below)."""

    case = "plain"

    def __init__(self, residual: bool = True):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.residual = residual

    def forward(self, x):
        if self.case == "the parent changes its input in place":
            with torch.no_grad():
                x.mul_(2)
        if self.case == "the parent changes q's weight in place":
            with torch.no_grad():
                self.q.weight.mul_(0.5)
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.case == "k detached":
            k = k.detach()
        h = q * k.sigmoid() if self.case == "v unused" else q * k.sigmoid() + v
        out = self.o(h)
        return out + x if self.residual else out


class Block(nn.Module):
    """``x + attn(norm(x))`` (the norm's weight and bias random, not ones and zeros)."""

    def __init__(self, residual: bool = True, case: str = "plain"):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(D)
        with torch.no_grad():
            self.norm.weight.normal_()
            self.norm.bias.normal_()
        self.attn = Attn(residual)
        self.attn.case = case

    def forward(self, x):
        return x + self.attn(self.norm(x))


def plan(sp: bool) -> dict:
    """The shared replica: the parent's input replicated (``sp`` off), or gathered from the
    norm's sequence shards and its output handed back as this rank's shard (``sp`` on)."""
    qkv = {"attn.q": colwise(), "attn.k": colwise(), "attn.v": colwise(), "attn.o": rowwise()}
    if not sp:
        return {"attn": prepare_in(Replicate(), local=True), **qkv}
    return {"norm": sequence_parallel(local=True),
            "attn": prepare_in(Shard(1), desired=Replicate(), local=True)
            >> prepare_out(Shard(1), given=Replicate(), local=True), **qkv}


def _mine(t: torch.Tensor, sp: bool) -> torch.Tensor:
    """This rank's part of a one-device tensor in the block's own layout (a sequence shard)."""
    return t.chunk(2, dim=1)[dist.get_rank()] if sp else t


def _models(kernels: bool, sp: bool, residual: bool = True, case: str = "plain"):
    """(one device, parallelized) copies of one block, and an input leaf for each."""
    ref = Block(residual, case)
    tp = tpfn.parallelize(clone(ref), mesh(2), plan(sp), kernels=kernels)
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(1))
    return ref, tp, x.clone().requires_grad_(), _mine(x, sp).clone().requires_grad_()


def _err(a, b) -> float:
    """Relative error of ``a`` (a DTensor or plain tensor) against one device's ``b``;
    0 when both are None, inf when one is, or when the shapes differ."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    a, b = full(a).detach().double(), full(b).detach().double()
    if a.shape != b.shape:
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _compare(tp, ref, out, expected, x_tp, x_ref, sp: bool) -> dict:
    """The output, the input's gradient, every parameter and every gradient against one device."""
    errors = {"output": _err(out, _mine(expected, sp)),
              "input.grad": _err(x_tp.grad, None if x_ref.grad is None else _mine(x_ref.grad, sp))}
    theirs = dict(ref.named_parameters())
    for name, p in tp.named_parameters():
        errors[name] = _err(p, theirs[name])
        errors[name + ".grad"] = _err(p.grad, theirs[name].grad)
    return errors


def _note(errors: dict, label: str, a, b) -> None:
    """``errors[label]``: ``a``'s error against one device's ``b``, with both norms in the
    label where they differ (what the reports quoted)."""
    error = _err(a, b)
    if not error <= TOL and a is not None and b is not None:
        label += f" (norm {full(a).double().norm():.4g}, one device {b.double().norm():.4g})"
    errors[label] = error


def _bad(errors: dict) -> dict:
    return {k: v for k, v in errors.items() if not v <= TOL}


# 1. Observers of the shared replica -------------------------------------------------------

OBSERVERS = ("retain_grad", "tensor hook", "full backward hook", "all three")


def _observed(kernels: bool, sp: bool, observer: str, residual: bool) -> dict:
    ref, tp, x_ref, x_tp = _models(kernels, sp, residual)
    seen = {}
    for key, model in (("tp", tp), ("ref", ref)):
        record = seen[key] = {"received": [], "hook": [], "grad_input": [], "grad_output": []}

        def pre(module, args, record=record):
            received = args[0]
            record["received"].append(received)
            if observer in ("retain_grad", "all three"):
                received.retain_grad()
            if observer in ("tensor hook", "all three"):
                received.register_hook(lambda g: record["hook"].append(
                    None if g is None else full(g).detach().clone()))

        def backward_hook(module, grad_input, grad_output, record=record):
            record["grad_input"].append(None if grad_input[0] is None else full(grad_input[0]).detach().clone())
            record["grad_output"].append(None if grad_output[0] is None else full(grad_output[0]).detach().clone())

        model.attn.q.register_forward_pre_hook(pre)
        if observer in ("full backward hook", "all three"):
            model.attn.q.register_full_backward_hook(backward_hook)
    out, expected = tp(x_tp), ref(x_ref)
    expected.pow(2).sum().backward()
    try:
        out.pow(2).sum().backward()
    except Exception as e:  # noqa: BLE001 - one device ran: a finding, not a torn-down pool
        return {f"backward raised {type(e).__name__}: {str(e).splitlines()[0]}": float("inf")}
    errors = _compare(tp, ref, out, expected, x_tp, x_ref, sp)
    mine, theirs = seen["tp"], seen["ref"]
    errors["q received"] = max(_err(a, b) for a, b in zip(mine["received"], theirs["received"]))
    if observer in ("retain_grad", "all three"):
        _note(errors, "retained .grad", mine["received"][0].grad, theirs["received"][0].grad)
    # q's output is its local column shard (colwise, as native TP's use_local_output): the
    # gradient of its output is one device's, this rank's columns
    theirs["grad_output"] = [g.chunk(2, dim=-1)[dist.get_rank()] for g in theirs["grad_output"]]
    for what in ("hook", "grad_input", "grad_output"):
        if len(mine[what]) != len(theirs[what]):
            errors[f"{what} calls: {len(mine[what])}, one device {len(theirs[what])}"] = float("inf")
        for i, (a, b) in enumerate(zip(mine[what], theirs[what])):
            _note(errors, f"{what} {i}", a, b)
    return errors


@KERNELS
@SP
@pytest.mark.parametrize("residual", [True, False], ids=["and the residual", "q, k, v alone"])
@pytest.mark.parametrize("observer", OBSERVERS)
def test_the_shared_replicas_observers_see_one_devices_gradient(ranks2, kernels, sp, observer, residual):
    # the tensor q receives: retain_grad's .grad and a tensor hook's one call hold its whole
    # gradient (q's, k's, v's and the residual's if any, reduced); q's full backward hook hands its
    # input gradient whole (q's own part, as one device's), not zeros, not this rank's part
    for errors in ranks2.run(_observed, kernels, sp, observer, residual, timeout=TIMEOUT):
        assert _bad(errors) == {}


# 2. A parameter stepped in place between forward and backward ------------------------------

STEPPED = {  # name: (sequence parallel, the parameter stepped)
    "column-wise q": (False, "attn.q.weight"),
    "row-wise o": (False, "attn.o.weight"),
    "column-wise q, sequence parallel": (True, "attn.q.weight"),
    "row-wise o, sequence parallel": (True, "attn.o.weight"),
    "sequence-parallel norm": (True, "norm.weight"),
}


def _stepped(kernels: bool, case: str, how: str) -> dict:
    """What the backward after the step raised, on one device and parallelized (``None``: it
    ran). Caught here, not raised: a rank that raises tears the pool down."""
    sp, name = STEPPED[case]
    ref, tp, x_ref, x_tp = _models(kernels, sp)
    raised = {}
    for key, model, x in (("one device", ref, x_ref), ("parallelized", tp, x_tp)):
        param = model.get_parameter(name)
        opt = torch.optim.SGD([param], lr=0.1)
        model(x).pow(2).sum().backward()  # an earlier step: gradients to step with
        out = model(x)
        if how == "add_":
            with torch.no_grad():
                param.add_(1.0)
        else:
            opt.step()
        try:
            out.pow(2).sum().backward()
            raised[key] = None
        except Exception as e:  # noqa: BLE001 - compared with one device's in the test
            raised[key] = (type(e), str(e).splitlines()[0])
    return raised


@KERNELS
@pytest.mark.parametrize("how", ["add_", "optimizer step"])
@pytest.mark.parametrize("case", list(STEPPED))
def test_a_parameter_stepped_between_forward_and_backward_is_refused(ranks2, kernels, case, how):
    # one device: autograd's version check refuses the backward; every rank refuses it too
    # (a backward that ran would differentiate weights that no longer exist)
    for rank, raised in enumerate(ranks2.run(_stepped, kernels, case, how, timeout=TIMEOUT)):
        for key in ("one device", "parallelized"):
            assert raised[key] is not None, f"rank {rank}: the backward ran ({key})"
            kind, message = raised[key]
            with pytest.raises(RuntimeError, match=INPLACE):  # its kind and message
                raise kind(f"rank {rank}, {key}: {message}")


# 3. The replica or q's weight changed in place before q computes ---------------------------


def _double_input(module, args):
    with torch.no_grad():
        args[0].mul_(2)


def _double_weight(module, args):
    module.weight.data.mul_(2)


CHANGES = {  # name: (the parent's case, the linear a forward pre-hook is on, the hook)
    "the parent changes its input in place": ("the parent changes its input in place", None, None),
    "the parent changes q's weight in place": ("the parent changes q's weight in place", None, None),
    "q's pre-hook changes its input in place": ("plain", "q", _double_input),
    "q's pre-hook changes its weight through .data": ("plain", "q", _double_weight),
    # after q has computed, before k does (k's rows may have been computed while the gather
    # ran); the input q saved changed: one device refuses the backward
    "k's pre-hook changes its input in place": ("plain", "k", _double_input),
    "k's pre-hook changes its weight through .data": ("plain", "k", _double_weight),
}


def _changed(kernels: bool, sp: bool, change: str) -> dict:
    case, linear, hook = CHANGES[change]
    ref, tp, x_ref, x_tp = _models(kernels, sp, case=case)
    if hook is not None:
        for model in (ref, tp):
            model.get_submodule(f"attn.{linear}").register_forward_pre_hook(hook)
    ran = {}
    for key, model, x in (("one device", ref, x_ref), ("parallelized", tp, x_tp)):
        try:
            out = model(x)
            out.pow(2).sum().backward()
            ran[key] = out
        except Exception as e:  # noqa: BLE001 - compared below, not a torn-down pool
            ran[key] = e
    expected, out = ran["one device"], ran["parallelized"]
    if isinstance(expected, Exception):  # one device refuses: the same refusal, every rank
        if isinstance(out, RuntimeError) and INPLACE in str(out) and INPLACE in str(expected):
            return {}
        return {f"one device raised {expected!r}; parallelized: {str(out).splitlines()[0]!r}": float("inf")}
    if isinstance(out, Exception):
        return {f"raised {type(out).__name__}: {str(out).splitlines()[0]}": float("inf")}
    return _compare(tp, ref, out, expected, x_tp, x_ref, sp)


@KERNELS
@SP
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_before_q_computes_is_what_q_computes_with(ranks2, kernels, sp, change):
    # one device uses the changed input or weight (a .data write is simply used): the
    # output, every gradient and the weights afterwards are its; where it refuses the
    # backward (an input q saved changed after q read it), every rank refuses it too
    for errors in ranks2.run(_changed, kernels, sp, change, timeout=TIMEOUT):
        assert _bad(errors) == {}


# 4. A reader whose gradient never comes --------------------------------------------------

SILENT = {"v unused": "attn.v.weight", "k detached": "attn.k.weight"}
HOOKS = ("tensor hook", "post-accumulate hook", "clipping hook", "clipping hook on every weight")


def _silent(kernels: bool, sp: bool, case: str, hook: str) -> dict:
    ref, tp, x_ref, x_tp = _models(kernels, sp, case=case)
    calls = {}
    for key, model in (("tp", tp), ("ref", ref)):
        seen = calls[key] = []
        silent = model.get_parameter(SILENT[case])
        if hook == "tensor hook":
            silent.register_hook(lambda g, seen=seen: seen.append(("tensor hook", g is None)))
        elif hook == "post-accumulate hook":
            silent.register_post_accumulate_grad_hook(
                lambda p, seen=seen: seen.append(("post-accumulate hook", p.grad is None)))
        else:
            params = [silent] if hook == "clipping hook" else [
                model.get_parameter(f"attn.{n}.weight") for n in "qkvo"]
            for p in params:
                p.register_hook(lambda g: g.clamp(-1, 1))
        if hook == "clipping hook on every weight":  # the used ones' hooks are still called
            for n in "qo":
                model.get_parameter(f"attn.{n}.weight").register_hook(
                    lambda g, n=n, seen=seen: seen.append((n, g is None)))
    out, expected = tp(x_tp), ref(x_ref)
    errors = {}
    try:
        out.pow(2).sum().backward()
    except Exception as e:  # noqa: BLE001 - a crash is a finding, reported with the rest
        errors[f"backward raised {type(e).__name__}: {e}"] = float("inf")
    expected.pow(2).sum().backward()
    if calls["tp"] != calls["ref"]:
        errors[f"hook calls (name, called with None) {calls['tp']}, one device {calls['ref']}"] = float("inf")
    return {**errors, **_compare(tp, ref, out, expected, x_tp, x_ref, sp)}


@KERNELS
@SP
@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize("case", list(SILENT))
def test_a_weight_whose_gradient_never_comes_calls_no_hook(ranks2, kernels, sp, case, hook):
    # one device computes no gradient for v's (k's) weight and calls none of its hooks; every
    # other gradient, clipped or not, is one device's
    for errors in ranks2.run(_silent, kernels, sp, case, hook, timeout=TIMEOUT):
        assert _bad(errors) == {}
