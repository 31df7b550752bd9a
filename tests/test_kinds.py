"""What the built-ins mean on module kinds of one's own, carried by the plan: ``plan.kind``."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode

import tpfn
from tests.models import clone, rel_err
from tests.ranks import mesh
from tpfn import (
    Partial, PlanError, Replicate, Shard, colwise, on_shards, params, plan, prepare_in,
    prepare_out, rowwise,
)
from tpfn.plans.kinds import Meaning

# float64 references: rounding ~1e-16 relative; 1e-12 leaves room for sums reordered over 2 ranks.
TOL = 1e-12


class ScaledLinear(nn.Module):
    """A linear layer of another library (not an nn.Linear): weight codes and a buffer of
    per-output-row scales, as int8 and float8 linears store them."""

    def __init__(self, d_in, d_out, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)
        self.bias = nn.Parameter(torch.randn(d_out) / 10) if bias else None
        self.register_buffer("scale", torch.rand(d_out) + 0.5)

    def forward(self, x):
        return F.linear(x, self.weight * self.scale[:, None], self.bias)


def scaled_colwise(core, module, where, owned):
    """colwise() on a ScaledLinear: the rows of the weight, its bias and its scales."""
    return params(weight=Shard(0), bias=Shard(0), scale=Shard(0)) >> on_shards(
        Replicate(), grads=Partial(), output=Shard(-1))


def scaled_rowwise(core, module, where, owned):
    """rowwise() on a ScaledLinear: the weight's columns; the bias added once to the sums."""
    return Meaning(params(weight=Shard(1), bias=Replicate(), scale=Replicate())
                   >> on_shards(Shard(-1), output=Partial()) >> prepare_out(Replicate()),
                   bias_once=True)


class FusedMLP(nn.Module):
    """A gated MLP with its gate and up projections fused in one parameter: one module."""

    def __init__(self, dim=8, hidden=12):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.randn(2 * hidden, dim) / dim**0.5)
        self.w_down = nn.Parameter(torch.randn(dim, hidden) / hidden**0.5)

    def forward(self, x):
        gate, up = F.linear(x, self.w_gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w_down)


def mlp_colwise(core, module, where, owned):
    """colwise() on a FusedMLP: Megatron's MLP in one module, the hidden features split."""
    return (params(w_gate_up=Shard(0, parts=2), w_down=Shard(1))
            >> on_shards(Replicate(), grads=Partial(), output=Partial()) >> prepare_out(Replicate()))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = ScaledLinear(8, 16)
        self.down = ScaledLinear(16, 8)
        self.mlp = FusedMLP()

    def forward(self, x):
        return self.mlp(self.down(F.gelu(self.up(x))))


PLAN = plan({"up": colwise(), "down": rowwise(), "mlp": colwise()}) \
    .kind(ScaledLinear, colwise=scaled_colwise, rowwise=scaled_rowwise) \
    .kind(FusedMLP, colwise=mlp_colwise)


def _block_at_tp2():
    torch.manual_seed(0)
    ref = Block().double()
    tp = tpfn.parallelize(clone(ref), mesh(2), PLAN)
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    with CommDebugMode() as mode:
        out = tp(x2)
        out.pow(2).sum().backward()
    counts = tpfn.trace.counts(mode)
    expected = ref(x)
    expected.pow(2).sum().backward()
    errors = {"output": rel_err(out, expected), "input.grad": rel_err(x2.grad, x.grad)}
    for name, p in tp.named_parameters():
        errors[name + ".grad"] = rel_err(p.grad.full_tensor(), ref.get_parameter(name).grad)
    for name, b in tp.named_buffers():
        errors[name] = rel_err(b.full_tensor(), ref.get_buffer(name))
    counts["placements"] = {n: str(b.placements) for n, b in tp.named_buffers()}
    return errors, counts


def test_a_plan_says_what_colwise_and_rowwise_mean_on_kinds_of_its_own(ranks2):
    for errors, counts in ranks2.run(_block_at_tp2):
        assert max(errors.values()) <= TOL, errors
        assert counts.pop("placements") == {"up.scale": "(Shard(dim=0),)",
                                            "down.scale": "(Replicate(),)"}
        # forward: down's and mlp's partial sums; backward: mlp's and up's input gradients
        assert counts == {"all_reduce": 4}


def test_the_plan_s_rows_come_before_the_class_s_and_the_table_s():
    class Proj(ScaledLinear):
        tpfn_rows = {"colwise": lambda core, module, where, owned: "the class's own row"}

    assert tpfn.resolve(plan({"": colwise()}).kind(Proj, colwise=scaled_colwise), Proj(4, 8))[0] \
        .params == (("bias", Shard(0)), ("scale", Shard(0)), ("weight", Shard(0)))
    with pytest.raises(PlanError, match="the class's own row"):
        tpfn.resolve(colwise(), Proj(4, 8))
    # on nn.Linear itself, for this plan only: its weight's rows in two equal parts
    gated = plan({"": colwise()}).kind(nn.Linear, colwise=lambda core, module, where, owned: (
        params(weight=Shard(0, parts=2)) >> on_shards(Replicate(), grads=Partial(),
                                                      output=Shard(-1, parts=2))))
    assert tpfn.resolve(gated, nn.Linear(4, 8, bias=False))[0].params == (
        ("weight", Shard(0, parts=2)),)
    assert tpfn.resolve(colwise(), nn.Linear(4, 8, bias=False))[0].params == (("weight", Shard(0)),)
    with pytest.raises(PlanError, match=r"colwise\(\) at '<root>' \(ScaledLinear\): it shards "
                                        r"nn.Linear, nn.Embedding, nn.MultiheadAttention, "
                                        r"transformers' Conv1D, nn.Conv1d/2d/3d, nn.ConvTranspose1d/2d/3d, "
                                        r"nn.BatchNorm1d/2d/3d and nn.GroupNorm, not ScaledLinear\."):
        tpfn.resolve(colwise(), ScaledLinear(4, 8))


def test_kinds_travel_with_the_plan_through_its_operations():
    base = plan({"up": colwise()})
    assert (base | PLAN).kinds == PLAN.kinds
    assert PLAN.override({"up": rowwise()}).kinds == PLAN.kinds
    assert PLAN.without("mlp").kinds == PLAN.kinds
    assert plan({"block": PLAN}).kinds == PLAN.kinds
    assert plan({"up": colwise()}, kinds={FusedMLP: {"colwise": mlp_colwise}}) == \
        base.kind(FusedMLP, colwise=mlp_colwise)
    assert repr(plan({"mlp": colwise()}).kind(FusedMLP, colwise=mlp_colwise)) == \
        "plan({'mlp': colwise()}, kinds={FusedMLP: {'colwise': mlp_colwise}})"
    other = plan({}).kind(FusedMLP, colwise=scaled_colwise)
    with pytest.raises(PlanError, match=r"FusedMLP has two rows for colwise\(\): mlp_colwise and "
                                        r"scaled_colwise; keep one, or replace it: "
                                        r"plan.kind\(FusedMLP, colwise=scaled_colwise\)"):
        PLAN | other
    assert PLAN.override(other).kinds[-1] == (FusedMLP, (("colwise", scaled_colwise),))


@pytest.mark.parametrize("build, error, message", [
    (lambda: plan({}, kinds={"ScaledLinear": {"colwise": scaled_colwise}}), TypeError,
     "plan kinds: a rule is for a module class (a subclass of nn.Module), e.g. "
     "{nn.MultiheadAttention: {'colwise': row}}; got 'ScaledLinear' that is a <class 'str'>."),
    (lambda: plan({}).kind(ScaledLinear(2, 2), colwise=scaled_colwise), TypeError,
     "plan.kind: a rule is for a module class (a subclass of nn.Module), e.g. "
     "{nn.MultiheadAttention: {'colwise': row}}; got ScaledLinear() that is a <class "
     "'tests.test_kinds.ScaledLinear'>: pass its class, ScaledLinear."),
    (lambda: plan({}).kind(torch.Tensor, colwise=scaled_colwise), TypeError,
     "plan.kind: a rule is for a module class (a subclass of nn.Module), e.g. "
     "{nn.MultiheadAttention: {'colwise': row}}; got <class 'torch.Tensor'> that is a "
     "<class 'torch._C._TensorMeta'>."),
    (lambda: plan({}).kind(ScaledLinear, columnwise=scaled_colwise), ValueError,
     "plan.kind[ScaledLinear]: 'columnwise' is no built-in; rows are for 'colwise', 'rowwise', "
     "'sequence_parallel'."),
    (lambda: plan({}).kind(ScaledLinear, colwise=colwise()), TypeError,
     "plan.kind[ScaledLinear]['colwise'] must be a function (core, module, where, owned) -> style "
     "(got colwise() that is a <class 'tpfn.style.style.Style'>)."),
])
def test_a_rule_for_what_is_not_a_module_class_is_refused_by_name(build, error, message):
    with pytest.raises(error) as e:
        build()
    assert str(e.value) == message


def test_a_parallelize_with_a_bad_kind_row_changes_nothing():
    model = Block()
    bad = plan({"up": colwise()}).kind(ScaledLinear, colwise=lambda core, module, where, owned: (
        params(weights=Shard(0)) >> on_shards(Replicate(), output=Shard(-1))))
    with pytest.raises(PlanError, match=r"no parameter or buffer 'weights'; it has weight, bias, "
                                        r"scale \(did you mean 'weight'\?\)"):
        tpfn.parallelize(model, tpfn.dryrun.fake_mesh(2), bad, src_rank=None)
    assert all(tpfn.mounted(m) is None for m in model.modules())
    assert not any(isinstance(t, torch.distributed.tensor.DTensor)
                   for t in (*model.parameters(), *model.buffers()))


# transformers' Conv1D (GPT-2): a row of the table, known by its name (transformers is only a
# test dependency), its weight (in, out), its output features nf held per rank.

class GPT2Parts(nn.Module):
    """GPT-2's projections, each a Conv1D: q, k and v packed, then the MLP."""

    def __init__(self, dim=8):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.c_attn, self.c_proj = Conv1D(3 * dim, dim), Conv1D(dim, dim)
        self.c_fc, self.mlp_proj = Conv1D(4 * dim, dim), Conv1D(dim, 4 * dim)

    def forward(self, x):
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        h = x + self.c_proj(q * k.sigmoid() + v)
        return h + self.mlp_proj(F.gelu(self.c_fc(h)))


def _conv1d_at_tp2():
    from tests.models import one_step

    torch.manual_seed(0)
    ref = GPT2Parts().double()
    for p in ref.parameters():
        p.data.normal_()  # Conv1D's bias starts at zero: make its gradient a real test
    plan = {"c_attn": colwise(parts=3), "c_proj": rowwise(), "c_fc": colwise(), "mlp_proj": rowwise()}
    tp = tpfn.parallelize(clone(ref), mesh(2), plan)
    shapes = (tp.c_attn.weight.to_local().shape, tp.c_fc.weight.to_local().shape, tp.c_attn.nf)
    return (*one_step(tp, ref, torch.randn(2, 5, 8, dtype=torch.float64)), shapes)


def test_transformers_conv1d_is_a_linear_layer_stored_transposed(ranks2):
    from transformers.pytorch_utils import Conv1D

    row = tpfn.resolve(colwise(parts=3), Conv1D(24, 8))[0]
    assert row.params == (("bias", Shard(0, parts=3)), ("weight", Shard(1, parts=3)))
    assert repr(row.sizes) == "(('nf', per_rank('nf')),)"
    assert repr(tpfn.resolve(colwise(heads=2), Conv1D(16, 8))[0].sizes) == "(('nf', per_rank('nf', heads=2)),)"
    assert tpfn.resolve(rowwise(), Conv1D(8, 16))[0].params == (("bias", Replicate()), ("weight", Shard(0)))
    for errors, forward, backward, shapes in ranks2.run(_conv1d_at_tp2):
        assert max(errors.values()) <= TOL, errors
        assert shapes == ((8, 12), (8, 16), 24)   # nf global outside its forward
        assert forward == {"all_reduce": 2}       # c_proj's and mlp_proj's partial sums
        assert backward == {"all_reduce": 2}      # c_attn's and c_fc's input gradients
