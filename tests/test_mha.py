"""``colwise()`` on ``nn.MultiheadAttention``: heads sharded, ``out_proj`` row-wise, one
all-reduce forward and one per replicated input backward."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import tpfn
from tests.models import clone, full, rel_err
from tests.ranks import mesh
from tpfn import PlanError, Shard, colwise, prepare_out, rowwise
from tpfn.dryrun import fake_mesh

# float64 references: rounding ~1e-16 relative; 1e-12 leaves room for sums reordered over 2 ranks.
TOL = 1e-12


def _errors(tp, ref, pairs) -> dict:
    """Relative errors of the output pairs, every parameter and every parameter gradient."""
    errors = {name: rel_err(a, b) for name, (a, b) in pairs.items()}
    refs = dict(ref.named_parameters())
    for name, p in tp.named_parameters():
        errors[name] = rel_err(full(p), refs[name])
        errors[name + ".grad"] = rel_err(full(p.grad), refs[name].grad)
    return errors


def _attention(batch_first: bool, bias: bool, cross: bool):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(16, 4, bias=bias, batch_first=batch_first).double()
    tp = tpfn.parallelize(clone(ref), mesh(2), colwise())
    shape = (lambda length: (3, length, 16)) if batch_first else (lambda length: (length, 3, 16))
    x = torch.randn(shape(5), dtype=torch.float64, requires_grad=True)
    memory = torch.randn(shape(7), dtype=torch.float64, requires_grad=True) if cross else x
    expected, none = ref(x, memory, memory, need_weights=False)
    expected.pow(2).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    memory2 = memory.detach().clone().requires_grad_() if cross else x2
    with CommDebugMode() as forward:
        out, weights = tp(x2, memory2, memory2, need_weights=False)
    with CommDebugMode() as backward:
        out.pow(2).sum().backward()
    pairs = {"output": (out, expected), "x.grad": (x2.grad, x.grad)}
    if cross:
        pairs["memory.grad"] = (memory2.grad, memory.grad)
    local = tp.in_proj_weight.to_local().shape, tp.out_proj.weight.to_local().shape
    return (_errors(tp, ref, pairs), tpfn.trace.counts(forward), tpfn.trace.counts(backward),
            weights is none is None, local)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_self_attention_sharded_by_heads_equals_one_device(ranks2, batch_first, bias):
    for errors, forward, backward, no_weights, local in ranks2.run(_attention, batch_first, bias, False):
        assert max(errors.values()) <= TOL, errors
        assert len(errors) == 2 + 2 * (4 if bias else 2)  # output, x.grad, parameters, grads
        assert forward == {"all_reduce": 1}    # out_proj's partial sums
        assert backward == {"all_reduce": 1}   # q, k and v's input gradient, summed first
        assert no_weights and local == ((24, 16), (16, 8))  # 2 of 4 heads of q, k and v


@pytest.mark.parametrize("batch_first", [False, True])
def test_cross_attention_sharded_by_heads_equals_one_device(ranks2, batch_first):
    for errors, forward, backward, _, _ in ranks2.run(_attention, batch_first, True, True):
        assert max(errors.values()) <= TOL, errors
        assert len(errors) == 3 + 8
        assert forward == {"all_reduce": 1}
        assert backward == {"all_reduce": 2}   # the query's gradient; the key's and value's


def _masks():
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(16, 4, batch_first=True).double()
    tp = tpfn.parallelize(clone(ref), mesh(2), colwise())
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])
    causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    per_head = torch.randn(3 * 4, 5, 5, dtype=torch.float64)    # one bias per batch and head
    calls = {
        "padding": dict(key_padding_mask=pad),
        "causal": dict(attn_mask=causal, is_causal=True),
        "causal and padding": dict(attn_mask=causal, key_padding_mask=pad, is_causal=True),
        "boolean": dict(attn_mask=causal.isinf()),
        "per head": dict(attn_mask=per_head, key_padding_mask=pad),
        "unbatched": dict(attn_mask=per_head[:4]),
    }
    errors = {}
    for name, kwargs in calls.items():
        xs = x[0] if name == "unbatched" else x
        for net in (ref, tp):
            net.zero_grad()
        expected, _ = ref(xs, xs, xs, need_weights=False, **kwargs)
        expected.pow(2).sum().backward()
        with CommDebugMode() as mode:
            out, _ = tp(xs, xs, xs, need_weights=False, **kwargs)
            out.pow(2).sum().backward()
        assert tpfn.trace.counts(mode) == {"all_reduce": 2}, name
        errors.update({f"{name}: {k}": v for k, v in _errors(tp, ref, {"output": (out, expected)}).items()})
    return errors


def test_masks_are_sliced_by_head(ranks2):
    for errors in ranks2.run(_masks):
        assert max(errors.values()) <= TOL, errors


def _layer():
    """nn.TransformerEncoderLayer calls its self_attn with need_weights=False; the block's
    feed-forward is Megatron's MLP. Float32: one forward and backward, the usual 1e-5."""
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    plan = {"self_attn": colwise(), "linear1": colwise(), "linear2": rowwise()}
    tp = tpfn.parallelize(clone(ref), mesh(2), plan)
    x, w = torch.randn(3, 5, 16, requires_grad=True), torch.randn(3, 5, 16)
    x2 = x.detach().clone().requires_grad_()
    ref(x).mul(w).sum().backward()   # the sum of a norm's output (or its squares) is constant
    with CommDebugMode() as mode:
        out = tp(x2)
        out.mul(w).sum().backward()
    return _errors(tp, ref, {"output": (out, ref(x)), "x.grad": (x2.grad, x.grad)}), \
        tpfn.trace.counts(mode)


def test_a_transformer_encoder_layer_trains_as_megatron_does(ranks2):
    for errors, counts in ranks2.run(_layer):
        assert max(errors.values()) <= 1e-5, errors
        assert counts == {"all_reduce": 4}   # attention's and the MLP's, forward and backward


def _sequence_parallel_output():
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(16, 4, batch_first=True).double()
    tp = tpfn.parallelize(clone(ref), mesh(2), colwise() >> prepare_out(Shard(1)))
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    with CommDebugMode() as mode:
        out, _ = tp(x, x, x, need_weights=False)
    rank = torch.distributed.get_rank()
    return rel_err(out, ref(x, x, x, need_weights=False)[0].chunk(2, dim=1)[rank]), \
        tpfn.trace.counts(mode)


def test_the_output_can_leave_reduce_scattered(ranks2):
    for err, counts in ranks2.run(_sequence_parallel_output):
        assert err <= TOL and counts == {"reduce_scatter": 1}


def _unchanged(model) -> bool:
    return not any(isinstance(p, DTensor) for p in model.parameters()) and \
        all(tpfn.mounted(m) is None for m in model.modules())


def test_heads_the_mesh_does_not_divide_are_refused_by_name():
    model = nn.MultiheadAttention(24, 6)   # 24 features split over 4 ranks, 6 heads do not
    with pytest.raises(PlanError) as e:
        tpfn.parallelize(model, fake_mesh(4), {"": colwise()}, src_rank=None)
    assert e.value.problems == [
        "colwise() at '<root>' (MultiheadAttention): its 6 heads do not split evenly over 4 "
        "ranks, and each rank computes whole heads; choose a mesh size that divides 6."]
    assert _unchanged(model)


class _OwnForward(nn.MultiheadAttention):
    def forward(self, query, key, value, **kwargs):
        return super().forward(query, key, value, **kwargs)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4)


@pytest.mark.parametrize("module, plan, message", [
    (nn.MultiheadAttention(16, 4, kdim=8, vdim=8), colwise(),
     "nn.MultiheadAttention(kdim=8, vdim=8) keeps q, k and v in separate weights (q_proj_weight, "
     "k_proj_weight, v_proj_weight), which colwise() does not shard; build it with kdim = vdim = "
     "embed_dim (16), or leave it out of the plan."),
    (nn.MultiheadAttention(16, 4, add_bias_kv=True), colwise(),
     "nn.MultiheadAttention(add_bias_kv=True) appends a key and value to every sequence, which "
     "colwise() does not compute on shards; build it without add_bias_kv, or leave it out of "
     "the plan."),
    (nn.MultiheadAttention(16, 4, add_zero_attn=True), colwise(),
     "nn.MultiheadAttention(add_zero_attn=True) appends a key and value to every sequence"),
    (_OwnForward(16, 4), colwise(),
     "_OwnForward overrides nn.MultiheadAttention.forward, and colwise() computes "
     "nn.MultiheadAttention's own on each rank's heads"),
    (nn.MultiheadAttention(16, 4), colwise(parts=3),
     "colwise(parts=3) at '<root>' (MultiheadAttention): nn.MultiheadAttention packs its q, k "
     "and v in in_proj_weight and colwise() shards them by heads itself; use colwise()."),
    (_Block(), {"attn": colwise(), "attn.out_proj": rowwise()},
     "colwise() at 'attn' (MultiheadAttention): its out_proj is bound to a style of its own, but "
     "nn.MultiheadAttention.forward reads out_proj's parameters itself (it never calls "
     "out_proj); leave out_proj out of the plan: colwise() on the attention shards it."),
])
def test_what_it_cannot_shard_is_refused_by_name(module, plan, message):
    with pytest.raises(PlanError) as e:
        tpfn.parallelize(module, fake_mesh(2), plan, src_rank=None)
    assert any(message in p for p in e.value.problems), e.value.problems
    assert _unchanged(module)


def _call_refusals():
    tp = tpfn.parallelize(nn.MultiheadAttention(16, 4), mesh(2), colwise())
    x = torch.randn(5, 3, 16, requires_grad=True)
    found = []
    for kwargs in ({}, {"need_weights": False, "attn_mask": torch.zeros(3, 4, 5, 5)},
                   {"need_weights": False, "attn_mask": torch.zeros(5, 5), "is_causal": False,
                    "key_padding_mask": torch.zeros(3, 5, dtype=torch.bool)}):
        with CommDebugMode() as mode:
            try:
                tp(x, x, x, **kwargs)
                found.append(None)
            except (ValueError, RuntimeError) as e:
                found.append(str(e))
        assert tpfn.trace.counts(mode) in ({}, {"all_reduce": 1}), kwargs
    return found


def test_what_it_cannot_compute_per_rank_is_refused_at_the_call(ranks2):
    for need_weights, four_d, fine in ranks2.run(_call_refusals):
        assert need_weights == (
            "'<root>' (MultiheadAttention) computes on each rank's heads (colwise()), so "
            "need_weights=True would return attention weights averaged over one rank's heads; "
            "call it with need_weights=False (nn.TransformerEncoderLayer does), or leave it out "
            "of the plan.")
        assert four_d == (
            "'<root>' (MultiheadAttention) got attn_mask of shape (3, 4, 5, 5); sharded by heads "
            "it takes one mask for every head, (target, source), or one per head, (batch * "
            "num_heads, target, source) = (12, 5, source).")
        assert fine is None
