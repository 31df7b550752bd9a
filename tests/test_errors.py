"""Bad input, table-driven: every mistake is caught early, named precisely, with what to do.

Each case is (name, call, exception type, the exact message or a regex over it). Cases that
need a process group run on 2 gloo ranks; the others here. After every failing
``parallelize``, the module is exactly as it was.
"""

import copy
import math
import re

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor import Partial as TPartial
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor.parallel import ParallelStyle

import tpfn
import tpfn.interpret.prepare
from tests.models import transformer, transformer_plan
from tests.ranks import mesh
from tpfn import (
    Partial, PlanError, Replicate, Shard, StyleError, colwise, on_shards, params,
    plan, prepare_in, prepare_out, resolve, rowwise, sequence_parallel,
)
from tpfn.algebra import local_shape, transition
from tpfn.layout import as_layout, from_torch, normalize


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


def _tied():
    m = Pair()
    m.b.weight = m.a.weight
    return m


def exact(text):
    return "^" + re.escape(text) + "$"


# Pure cases: (name, call, exception, message pattern).
PURE = [
    ("shard dim float", lambda: Shard(1.5), TypeError,
     exact("'dim' must be <class 'int'> (got 1.5 that is a <class 'float'>).")),
    ("shard dim str", lambda: Shard("x"), TypeError,
     exact("'dim' must be <class 'int'> (got 'x' that is a <class 'str'>).")),
    ("shard dim bool", lambda: Shard(True), TypeError,
     exact("'dim' must be <class 'int'> (got True that is a <class 'bool'>).")),
    ("shard parts zero", lambda: Shard(0, parts=0), ValueError,
     exact("'parts' must be at least 1 (got 0).")),
    ("partial op unknown", lambda: Partial("median"), ValueError,
     exact("'op' must be in ('sum', 'avg', 'max', 'min') (got 'median').")),
    ("partial op not a str", lambda: Partial(3), TypeError,
     exact("'op' must be <class 'str'> (got 3 that is a <class 'int'>).")),
    ("layout not a placement", lambda: as_layout("S0"), TypeError,
     exact("'layout' must be a placement (Shard, Replicate, Partial) or a non-empty tuple of them "
           "(got 'S0' that is a <class 'str'>).")),
    ("shard dim beyond ndim", lambda: normalize(Shard(3), 2), ValueError,
     exact("Shard(dim=3) does not fit a tensor of 2 dims: a shard dim must lie in [-2, 1].")),
    ("torch placement unknown", lambda: from_torch(TPartial("product")), ValueError,
     r"^Partial\(product\) has no tpfn layout: tpfn knows Shard, Replicate and Partial with op in "
     r"\('sum', 'avg', 'max', 'min'\); redistribute the DTensor to one of those first\.$"),
    ("transition creates partial", lambda: transition(Shard(0), Partial()), ValueError,
     r"^no transition turns Shard\(dim=0\) into Partial\(\) on mesh dim 0: Partial values arise "
     r"only from computation .* Ask for Replicate\(\) or Shard\(dim\) instead, or replicate "
     r"it first\.$"),
    ("transition changes reduction", lambda: transition(Partial(), Partial("max")), ValueError,
     r"terms pending a 'sum' reduction are not terms of a 'max' reduction\. Reduce first"),
    ("layout mixes reductions", lambda: transition((Partial(), Partial("max")), (Replicate(),) * 2),
     ValueError, r"^'src' mixes Partial reductions .*; reduce one mesh dim first\.$"),
    ("layouts of two meshes", lambda: transition(Shard(0), (Shard(0), Replicate())), ValueError,
     r"layouts of different meshes \(1-D and 2-D\): give one placement per mesh dim in both\.$"),
    ("packed parts do not divide", lambda: local_shape((7,), Shard(0, parts=2), (2,), (0,)), ValueError,
     exact("Shard(dim=0, parts=2) needs dim 0 to hold 2 equal parts; it has 7.")),
    ("local shape mismatched lengths", lambda: local_shape((4,), Shard(0), (2, 2), (0,)), ValueError,
     r"must have one entry per mesh dim each\.$"),
    (">> with a non-style", lambda: colwise() >> 3, TypeError,
     exact("`>>` composes styles (colwise(), prepare_in(...), ...); got 3 that is a <class 'int'>.")),
    ("non-style >> style", lambda: "colwise" >> rowwise(), TypeError,
     r"got 'colwise' that is a <class 'str'> on its left\.$"),
    ("inputs after the core", lambda: colwise() >> prepare_in(Shard(1)), StyleError,
     exact("prepare_in(Shard(dim=1)) comes after colwise(): inputs are prepared before the module "
           "computes; put it first, e.g. prepare_in(Shard(dim=1)) >> colwise().")),
    ("two cores", lambda: colwise() >> rowwise(), StyleError,
     r"^colwise\(\) >> rowwise\(\): a style shards its module one way; bind each to its own module"),
    ("outputs before the core", lambda: prepare_out(Replicate()) >> colwise(), StyleError,
     r"write colwise\(\) >> prepare_out\(Replicate\(\)\)\.$"),
    ("declarations disagree", lambda: colwise() >> prepare_out(Shard(0), given=Replicate()),
     StyleError, r"^output 0: one stage delivers Shard\(dim=-1\) and the next declares it arrives as "
     r"Replicate\(\); make the declarations agree \(or leave given=None\)\.$"),
    ("desired with no slots", lambda: prepare_in(desired=Replicate()), TypeError,
     exact("prepare_in: 'desired' has no slots to apply to: give one positional layout per slot "
           "first (None: as it comes), e.g. prepare_in(None, desired=Replicate()).")),
    ("parameter placed twice", lambda: params(w=Shard(0)) >> params(w=Shard(1)), StyleError,
     exact("parameter 'w' is placed twice: Shard(dim=0) and Shard(dim=1); keep one.")),
    ("prepare_in bad layout", lambda: prepare_in("S1"), TypeError,
     r"^prepare_in: input 0 must be a placement \(Shard, Replicate, Partial\) or None"),
    ("prepare_in one desired for two", lambda: prepare_in(Shard(1), Shard(0), desired=Replicate()),
     TypeError, exact("prepare_in: 'desired' has one layout for 2 slots: give a tuple of 2 "
                      "(None: untouched).")),
    ("prepare_in bad kwarg", lambda: prepare_in(kwargs={"mask": "R"}), TypeError,
     exact("prepare_in: 'kwargs'['mask'] must be a placement or a (given, desired) pair (got 'R').")),
    ("prepare_out bad given", lambda: prepare_out(Replicate(), given=[Shard(0)]), TypeError,
     r"^prepare_out: 'given' must be a placement or a tuple of 1 placements/None"),
    ("local not a bool", lambda: colwise(local="yes"), TypeError,
     exact("'local' must be True, False or None (got 'yes' that is a <class 'str'>).")),
    ("parts not positive", lambda: colwise(parts=0), TypeError,
     exact("'parts' must be a positive int (got 0 that is a <class 'int'>).")),
    ("sequence dim float", lambda: sequence_parallel(dim=1.0), TypeError,
     exact("'dim' must be <class 'int'> (got 1.0 that is a <class 'float'>).")),
    ("partial parameter", lambda: params(w=Partial()), TypeError,
     r"a parameter holds values, never pending partial sums\.$"),
    ("on_shards bad param_grads", lambda: on_shards(param_grads={"w": "P"}), TypeError,
     exact("on_shards: 'param_grads' maps parameter names to placements (got 'w': 'P').")),
    ("plan key not a str", lambda: plan({1: colwise()}), TypeError,
     r"^plan keys must be module FQN patterns \(str\), e\.g\. 'layers\.\*\.attention\.wq' "
     r"\(got 1 that is a <class 'int'>\)\.$"),
    ("plan key empty component", lambda: plan({"layers..w1": colwise()}), ValueError,
     exact("plan key 'layers..w1' has an empty name component; write e.g. 'layers.*.w1'.")),
    ("plan value not a style", lambda: plan({"w1": "colwise"}), TypeError,
     r"^plan\['w1'\] is the string 'colwise', not a tpfn style; .* tpfn\.from_hf\(tp_plan, model\)\.$"),
    ("plan not a dict", lambda: plan(["w1"]), TypeError,
     exact("a plan is built from a dict of pattern -> style (got ['w1']).")),
    ("plans conflict", lambda: plan({"w": colwise()}) | {"w": rowwise()}, PlanError,
     r"'w' is bound to colwise\(\) and to rowwise\(\); bind it once, or override it: "
     r"plan\.override\(\{'w': rowwise\(\)\}\)$"),
    ("pattern matches nothing", lambda: resolve({"layers.*.atention.wq": colwise()}, transformer()),
     PlanError, r"'layers\.\*\.atention\.wq' -> colwise\(\) matches no module; did you mean "
     r"'layers\.\*\.attention\.wq'"),
    ("two styles on a module", lambda: resolve({"a": colwise(), "*": rowwise()}, Pair()), PlanError,
     r"'a' \(Linear\) is bound to 2 styles \('\*' -> rowwise\(\); 'a' -> colwise\(\)\); bind it once"),
    ("colwise on a norm", lambda: resolve({"norm": colwise()}, transformer()), PlanError,
     r"colwise\(\) at 'norm' \(LayerNorm\): it shards nn\.Linear, nn\.Embedding, "
     r"nn\.MultiheadAttention, transformers' Conv1D, nn\.Conv1d/2d/3d, nn\.ConvTranspose1d/2d/3d, nn\.BatchNorm1d/2d/3d and nn\.GroupNorm, not LayerNorm\."),
    ("embedding with max_norm", lambda: resolve(
        {"tok": rowwise()}, nn.ModuleDict({"tok": nn.Embedding(4, 2, max_norm=1.0)})),
     PlanError, re.escape("rowwise() at 'tok' (Embedding): nn.Embedding(max_norm=...) renormalizes "
                          "whole rows in place, so it cannot be sharded; leave it out of the plan "
                          "(replicated) or build it without max_norm.") + "$"),
    ("sparse embedding", lambda: resolve(
        {"tok": colwise()}, nn.ModuleDict({"tok": nn.Embedding(4, 2, sparse=True)})),
     PlanError, r"nn\.Embedding\(sparse=\.\.\.\) makes sparse gradients, which DTensor cannot hold"),
    ("packed parts the ranks cannot split", lambda: tpfn.explain(
        nn.Sequential(nn.Linear(4, 6, bias=False)), {"0": colwise(parts=2)}, world_size=2),
     PlanError, re.escape("parameter '0.weight' packs 2 parts in dim 0 (6): each part (3) must "
                          "split evenly over 2 ranks, so dim 0 must be a multiple of 4; pad each "
                          "part, or choose a mesh size that divides 3 (colwise(parts=2) at '0' "
                          "(Linear)).") + "$"),
    ("sequence parallel on a linear", lambda: resolve({"output": sequence_parallel()}, transformer()),
     PlanError, r"parameters must be 1-D \(norms, dropout\), but weight is not; shard it with "
     r"colwise\(\) or rowwise\(\)\."),
    ("params names a missing parameter", lambda: resolve({"a": params(wieght=Shard(0))}, Pair()),
     PlanError, r"no parameter 'wieght'; it has weight, bias \(did you mean 'weight'\?\)\."),
    ("more input slots than forward takes", lambda: resolve({"a": prepare_in(Shard(0), Shard(0))},
                                                             Pair()),
     PlanError, r"prepares input 1 but Linear\.forward takes 1 positional input \(input\)\."),
    ("keyword the forward lacks", lambda: resolve({"a": prepare_in(kwargs={"mask": Replicate()})},
                                                  Pair()),
     PlanError, r"prepares keyword input 'mask' but Linear\.forward has no such input\."),
    ("on_shards grads a missing parameter", lambda: resolve(
        {"a": on_shards(param_grads={"wieght": Partial()})}, Pair()),
     PlanError, r"no parameter 'wieght'; it has weight, bias \(did you mean 'weight'\?\)\."),
    ("cross entropy soft targets", lambda: tpfn.cross_entropy(torch.randn(2, 3), torch.rand(2, 3)),
     ValueError, r"target must hold class indices"),
    ("cross entropy reduction", lambda: tpfn.cross_entropy(torch.randn(2, 3), torch.zeros(2).long(),
                                                          reduction="avg"),
     ValueError, exact("cross_entropy: 'reduction' must be 'mean', 'sum' or 'none' (got 'avg').")),
    ("cross entropy smoothing", lambda: tpfn.cross_entropy(torch.randn(2, 3), torch.zeros(2).long(),
                                                          label_smoothing=1.5),
     ValueError, exact("cross_entropy: 'label_smoothing' must lie in [0, 1] (got 1.5).")),
    ("cross entropy plain logits", lambda: tpfn.cross_entropy(torch.randn(2, 3), torch.zeros(2).long()),
     TypeError, exact("cross_entropy: give the sharded logits as a DTensor, or a local tensor with "
                      "mesh=.")),
    ("checkpoint missing", lambda: tpfn.checkpoint.load("/nonexistent/ckpt", nn.Linear(1, 1)),
     FileNotFoundError, r"no checkpoint at '/nonexistent/ckpt' \(nor a previous one beside it\)\."),
    ("clip a non-finite norm", lambda: _nonfinite_clip(), RuntimeError,
     r"the total norm of order 2\.0 of the gradients is inf; pass error_if_nonfinite=False"),
    ("explain on no ranks", lambda: tpfn.explain(nn.Linear(2, 2), colwise(), world_size=0),
     TypeError, exact("'world_size' must be a positive int or a sympy Symbol (got 0 that is a "
                      "<class 'int'>).")),
    ("explain example inputs", lambda: tpfn.explain(nn.Linear(2, 2), colwise(), world_size=2,
                                                    example_inputs="x"),
     TypeError, r"^'example_inputs' must be a tensor, a shape, a tuple of them \(positional "
     r"inputs\) or a dict \(keyword inputs\) \(got 'x'"),
    ("a mesh that does not divide the heads", lambda: tpfn.explain(
        transformer(vocab_size=16, n_heads=3, dim=12), transformer_plan(False), world_size=2,
        example_inputs=(2, 8)),
     PlanError, r"'wq', 'wk', 'wv' of 'layers\.0\.attention' \(Attention\) project 3 heads of 4 "
     r"features: the 2 ranks do not divide them, so ranks would hold parts of heads; choose a "
     r"mesh size that divides 3"),
    ("transformers style unknown", lambda: tpfn.from_hf({"0": "fused"}, nn.Sequential(nn.Linear(2, 2))),
     PlanError, r"'0': unknown transformers style 'fused'; known: all_reduce, colwise, "),
    ("transformers style tpfn cannot express", lambda: tpfn.from_hf(
        {"0": "grouped_gemm"}, nn.Sequential(nn.Linear(2, 2))),
     PlanError, r"is expert parallelism .*; shard the experts on their hidden dim instead"),
    ("identity experts outside experts", lambda: tpfn.from_hf(
        {"0": "moe_identity_expert"}, nn.Sequential(nn.Linear(2, 2))),
     PlanError, r"its module \(the model\) is not in the plan\. Key it 'moe_tp_experts'\."),
    ("transformers plan not a dict", lambda: tpfn.from_hf(["0"], nn.Sequential(nn.Linear(2, 2))),
     TypeError, exact("'tp_plan' must be a dict of name -> style string, as model.tp_plan "
                      "(got ['0'] that is a <class 'list'>).")),
    ("pytorch style unknown", lambda: tpfn.from_torch({"0": _ForExperts()}), PlanError,
     r"plan\['0'\] is a .*_ForExperts, which tpfn cannot convert; it converts ColwiseParallel, "
     r"RowwiseParallel, SequenceParallel, PrepareModuleInput, PrepareModuleOutput, "
     r"PrepareModuleInputOutput\. Write its tpfn style instead \(docs/migration\.md\)\.$"),
    ("from_torch of something else", lambda: tpfn.from_torch(3), TypeError,
     exact("from_torch takes a PyTorch ParallelStyle, a parallelize_module plan (dict) or DTensor "
           "placements (got 3 that is a <class 'int'>).")),
]


class _ForExperts(ParallelStyle):
    def _apply(self, module, device_mesh):
        return module


def _nonfinite_clip():
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([math.inf, 0.0])
    tpfn.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)


@pytest.mark.parametrize("call, error, pattern", [c[1:] for c in PURE], ids=[c[0] for c in PURE])
def test_a_bad_value_is_named_with_what_to_do(call, error, pattern):
    with pytest.raises(error) as info:
        call()
    assert re.search(pattern, str(info.value)), str(info.value)


# Cases with a process group: each returns the exception it raised (or None).
def _on_ranks():
    from torch.distributed.device_mesh import init_device_mesh
    m = mesh(2)
    cases = {
        "mesh not a mesh": lambda: tpfn.parallelize(nn.Linear(2, 2), "cpu", colwise()),
        "module not a module": lambda: tpfn.parallelize(lambda x: x, m, colwise()),
        "an N-D mesh": lambda: tpfn.parallelize(
            nn.Linear(2, 2), init_device_mesh("cpu", (2, 1), mesh_dim_names=("tp", "dp")), colwise()),
        "src rank outside the mesh": lambda: tpfn.parallelize(nn.Linear(2, 2), m, colwise(), src_rank=2),
        "parallelized twice": lambda: tpfn.parallelize(
            tpfn.parallelize(Pair(), m, {"a": colwise()}), m, {"a": colwise()}),
        "tied tensor placed two ways": lambda: tpfn.parallelize(_tied(), m, {"a": colwise(),
                                                                          "b": rowwise()}),
        "dtensor input in another layout": lambda: tpfn.parallelize(
            nn.Linear(4, 4), m, prepare_in(Shard(0)) >> colwise())(
                distribute_tensor(torch.randn(4, 4), m, [TReplicate()])),
        "a non-tensor at a declared slot": lambda: tpfn.parallelize(
            nn.Linear(4, 4), m, colwise())("x"),
        "more outputs prepared than returned": lambda: tpfn.parallelize(
            nn.Linear(4, 4), m, prepare_out(Replicate(), Replicate()))(torch.randn(2, 4)),
        "on_shards returns a tuple": lambda: tpfn.parallelize(
            _Both(), m, on_shards(Replicate(), output=Shard(0)))(torch.randn(2, 4)),
        "logits sharded off the class dim": lambda: tpfn.cross_entropy(
            distribute_tensor(torch.randn(4, 6), m, [TShard(0)]), torch.zeros(4).long()),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the type is part of what is checked
            out[name] = (type(e).__name__, str(e))
    return out


class _Both(nn.Module):
    def forward(self, x):
        return x, x


RANKED = {
    "mesh not a mesh": ("TypeError", exact(
        "'mesh' must be a torch.distributed DeviceMesh, e.g. init_device_mesh('cpu', (2,)), or "
        "given by an enclosing `with mesh:` (got 'cpu' that is a <class 'str'>).")),
    "module not a module": ("TypeError", r"^'module' must be an nn\.Module \(got <function"),
    "an N-D mesh": ("ValueError", exact(
        "parallelize takes the 1-D tensor-parallel mesh, got a 2-D mesh (2, 1) with dims "
        "('tp', 'dp'); pass mesh['tp'].")),
    "src rank outside the mesh": ("ValueError", exact(
        "'src_rank' must be a rank of the mesh (0..1) or None (got 2).")),
    "parallelized twice": ("PlanError", r"'a' \(Linear\) is already parallelized \(colwise\(\)\); "
                                        r"parallelize a fresh module, or leave it out of this plan\."),
    "tied tensor placed two ways": ("PlanError", r"parameter 'b\.weight' is tied to 'a\.weight': "
                                                 r"colwise\(\) places it Shard\(dim=0\) and rowwise\(\) "
                                                 r"places it Shard\(dim=1\); a tied tensor has one "
                                                 r"layout"),
    "dtensor input in another layout": ("LayoutError", exact(
        "input 0 of '<root>' (Linear) arrives laid out Replicate() but the plan declares "
        "Shard(dim=0); declare Replicate() there, or redistribute it before the call.")),
    "a non-tensor at a declared slot": ("TypeError", exact(
        "input 0 of '<root>' (Linear) is declared Replicate() but is str, not a tensor; mark it "
        "None to leave it alone.")),
    "on_shards returns a tuple": ("TypeError", exact(
        "the output of '<root>' (_Both) is tuple, not a tensor, but on_shards(Replicate(), "
        "output=Shard(dim=0)) declares one output laid out Shard(dim=0); return one tensor, or "
        "leave out output= and lay out the items with prepare_out(..., given=...).")),
    "more outputs prepared than returned": ("LayoutError", exact(
        "'<root>' (Linear) returned one output; the plan prepares 2: give prepare_out one layout.")),
    "logits sharded off the class dim": ("ValueError", r"^cross_entropy: logits must be sharded on "
                                                       r"their class dim 1"),
}


def test_bad_calls_on_ranks_are_named_with_what_to_do(ranks2):
    found = ranks2.run(_on_ranks)[0]
    assert set(found) == set(RANKED)
    for name, (kind, pattern) in RANKED.items():
        assert found[name] is not None, f"{name}: nothing was raised"
        assert found[name][0] == kind, (name, found[name])
        assert re.search(pattern, found[name][1]), (name, found[name][1])


def test_the_suite_counts_at_least_40_distinct_bad_inputs():
    assert len(PURE) + len(RANKED) >= 40


# Atomicity: a parallelize that fails leaves parameters, buffers and hooks as they were.
def _snapshot(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {n: type(p) for n, p in model.named_parameters()},
            [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()])


def _unchanged(model, before) -> bool:
    state, kinds, hooks = _snapshot(model)
    return (state.keys() == before[0].keys() and all(torch.equal(v, before[0][k]) for k, v in state.items())
            and kinds == before[1] and hooks == before[2])


def _atomicity():
    m = mesh(2)
    failures = {
        "plan problems": (lambda: transformer(vocab_size=16), {"layers.*.attention.wq": colwise(),
                                                               "norm": colwise()}),
        "tied conflict": (_tied, {"a": colwise(), "b": rowwise()}),
    }
    results = {}
    for name, (build, bad_plan) in failures.items():
        model = build()
        before = _snapshot(model)
        try:
            tpfn.parallelize(model, m, bad_plan)
        except PlanError:
            results[name] = _unchanged(model, before)
    # A failure while the parameters are being sharded: nothing was swapped in yet.
    model = Pair()
    before = _snapshot(model)
    calls = []
    real = tpfn.interpret.prepare.distribute_tensor

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the network went away")
        return real(*args, **kwargs)

    tpfn.interpret.prepare.distribute_tensor = flaky
    try:
        tpfn.parallelize(model, m, {"a": colwise(), "b": rowwise()})
    except RuntimeError:
        results["sharding interrupted"] = _unchanged(model, before)
    finally:
        tpfn.interpret.prepare.distribute_tensor = real
    return results


def test_a_failed_parallelize_leaves_the_module_as_it_was(ranks2):
    assert ranks2.run(_atomicity)[0] == {"plan problems": True, "tied conflict": True,
                                         "sharding interrupted": True}


def test_resolving_does_not_touch_the_module():
    model = transformer(vocab_size=16)
    before = _snapshot(copy.deepcopy(model))
    with pytest.raises(PlanError):
        resolve({"nothing.here": colwise()}, model)
    assert _unchanged(model, before)
