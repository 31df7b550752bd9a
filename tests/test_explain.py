"""tpfn.explain: a dry run on fake ranks predicts what the plan really does, entry by entry."""

import collections
import json
import re
from html.parser import HTMLParser

import pytest
import sympy
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import tpfn
from tests.models import clone, local_heads, transformer, transformer_plan
from tests.ranks import mesh
from tpfn import (Partial, PlanError, Replicate, Shard, colwise, per_rank, prepare_in, prepare_out,
                  rowwise)
from tpfn.algebra import AllGather, AllReduce
from tpfn.dryrun import fake_mesh
from tpfn.record import record
from tpfn.dryrun.report import Comm, Param, Transition

WORLD_SIZES = (2, 4, 8, 16, 32, 64)
b, s, t = sympy.symbols("b s t", positive=True, integer=True)


def _tokens():
    return torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))


def _reference(sp: bool = False):
    """The reference Transformer with 64 heads (so 64 ranks get one each), a plan and tokens."""
    model = transformer(vocab_size=256, dim=256, n_heads=64, max_seq_len=64)
    return model, transformer_plan(sp), _tokens()


LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=128,
             num_key_value_heads=64, vocab_size=256, max_position_embeddings=128)


def llama_plan() -> dict:
    """The Megatron minimum for Llama, by hand from ``model.tp_plan``'s module names: attention
    and MLP inputs annotated once, so q, k, v (and gate, up) share one gradient all-reduce."""
    return {
        "model.embed_tokens": rowwise(),
        "model.layers.*.self_attn": prepare_in(Replicate()),
        "model.layers.*.self_attn.[qkv]_proj": colwise(),
        "model.layers.*.self_attn.o_proj": rowwise(),
        "model.layers.*.mlp": prepare_in(Replicate()),
        "model.layers.*.mlp.gate_proj": colwise(),
        "model.layers.*.mlp.up_proj": colwise(),
        "model.layers.*.mlp.down_proj": rowwise(),
        "lm_head": colwise() >> prepare_out(Replicate()),
    }


def _llama(sp: bool = False, **config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**LLAMA, **config}))
    return model, llama_plan(), _tokens()


CASES = {"transformer": _reference, "transformer-sp": lambda: _reference(True), "llama": _llama}


def _loss(out):
    return (out.logits if hasattr(out, "logits") else out).sum()


def _heads(case: str, model, tp: int):
    return local_heads(model, tp) if case.startswith("transformer") else model


def _real_run(case: str):
    """On each of 2 gloo ranks: explain first (a default group exists here), then the real run."""
    model, plan, x = CASES[case]()
    predicted = tpfn.explain(_heads(case, clone(model), 2), plan, world_size=2, example_inputs=x)
    expected = _loss(model(x))
    tp = _heads(case, tpfn.parallelize(clone(model), mesh(2), plan), 2)
    with CommDebugMode() as mode, record(tp) as comms:
        loss = _loss(tp(x))
        loss.backward()
    assert torch.allclose(loss, expected, rtol=1e-5), (loss, expected)  # the dry run left no trace
    return tpfn.trace.counts(mode), comms, predicted.comms


@pytest.fixture(scope="module")
def real(ranks2):
    """Per case: CommDebugMode's counts, the measured collectives, and explain's inside the rank."""
    out = {}
    for case in CASES:
        ranks = ranks2.run(_real_run, case)
        assert ranks[0] == ranks[1]
        out[case] = ranks[0]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_the_dry_run_equals_the_real_2_rank_run(real, case):
    counts, measured, in_rank = real[case]
    model, plan, x = CASES[case]()
    report = tpfn.explain(_heads(case, model, 2), plan, world_size=2, example_inputs=x)
    assert report.collectives == counts
    assert report.comms == tuple(measured) == tuple(in_rank)
    assert report.bytes == sum(c.bytes for c in measured)


@pytest.mark.parametrize("case", list(CASES))
def test_counts_and_sizes_are_those_of_the_real_run_at_every_world_size(real, case):
    _, measured, _ = real[case]
    model, plan, x = CASES[case]()
    for n in WORLD_SIZES:
        report = tpfn.explain(_heads(case, clone(model), n), plan, world_size=n, example_inputs=x)
        assert [(c.fqn, c.phase, c.kind, c.numel, c.itemsize) for c in report.comms] == [
            (c.fqn, c.phase, c.kind, c.numel, c.itemsize) for c in measured]
        assert all(c.group_size == n for c in report.comms)
        ring = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1}
        assert report.bytes == sum(sympy.Rational(ring[c.kind], n) * c.numel * c.itemsize
                                   for c in measured)
        assert report.blocks_bytes == report.megatron_bytes  # these plans reach the minimum


def test_one_rank_moves_nothing_and_says_so():
    model = local_heads(transformer(vocab_size=16, n_layers=1), 1)
    report = tpfn.explain(model, transformer_plan(sp=True), world_size=1,
                          example_inputs=torch.zeros(2, 8, dtype=torch.long))
    text = str(report)
    assert report.bytes == 0 and report.collectives == {}
    assert text.startswith("tpfn.explain on 1 rank: ") and "nan" not in text
    model, plan, x = _llama()
    assert str(tpfn.explain(model, plan, world_size=1, example_inputs=x)).endswith(
        "measured in the blocks: 0 B; ratio - (one rank moves nothing)")


def test_inputs_may_be_tensors_meta_tensors_shapes_or_keywords():
    model, plan, x = _llama()
    by_shape = tpfn.explain(model, plan, world_size=2, example_inputs=(2, 64))
    assert by_shape.inputs == (("input 0", (2, 64), "int64"),)
    for inputs in (x, (x,), torch.empty(2, 64, dtype=torch.long, device="meta"), {"input_ids": x}):
        assert tpfn.explain(model, plan, world_size=2, example_inputs=inputs).comms == by_shape.comms
    assert tpfn.explain(model, plan, world_size=2, example_inputs={"input_ids": x}).inputs == (
        ("input_ids", (2, 64), "int64"),)


def test_collectives_belong_to_the_module_that_issued_them():
    model, plan, x = _reference(sp=False)
    report = tpfn.explain(local_heads(model, 4), plan, world_size=4, example_inputs=x)
    assert {key: {k: n for k, (n, _) in v.items()} for key, v in report.traffic().items()} == {
        ("tok_embeddings", "forward"): {"all_reduce": 1},
        ("pos_embeddings", "forward"): {"all_reduce": 1},
        ("layers.0.attention.wo", "forward"): {"all_reduce": 1},
        ("layers.0.feed_forward.w2", "forward"): {"all_reduce": 1},
        ("layers.1.attention.wo", "forward"): {"all_reduce": 1},
        ("layers.1.feed_forward.w2", "forward"): {"all_reduce": 1},
        ("output", "forward"): {"all_gather": 1},
        ("output", "backward"): {"all_reduce": 1},  # the head's input gradient
        ("layers.1.feed_forward.w1", "backward"): {"all_reduce": 1},
        ("layers.1.attention", "backward"): {"all_reduce": 1},  # q, k, v's summed gradient
        ("layers.0.feed_forward.w1", "backward"): {"all_reduce": 1},
        ("layers.0.attention", "backward"): {"all_reduce": 1},
    }


def test_explain_leaves_the_module_as_it_was():
    model, plan, x = _reference(sp=True)
    local_heads(model, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    tpfn.explain(model, plan, world_size=2, example_inputs=x)
    assert dict(model.named_parameters()) == params
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(p.is_meta or isinstance(p, DTensor) or p.grad is not None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks or tpfn.mounted(m) for m in model.modules())
    assert model.output.weight is model.tok_embeddings.weight


def test_the_llama_3_70b_shape_sends_the_megatron_minimum():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                         num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    report = tpfn.explain(model, llama_plan(), world_size=8, example_inputs=(1, 4096))
    assert report.collectives == {"all_reduce": 322, "all_gather": 1}  # 4 per block + 2
    megatron = 80 * 8 * sympy.Rational(7, 8) * 1 * 4096 * 8192 * 2
    assert report.blocks_bytes == report.megatron_bytes == megatron
    head = {"lm_head.weight": (128256, 8192), "model.embed_tokens.weight": (128256, 8192)}
    rows = {f"{r.fqn}.{p.name}": p for r in report.rows for p in r.params}
    assert {k: rows[k].local for k in head} == {k: (((16032, 8192), 0, 7),) for k in head}
    assert "ratio 1.00" in str(report) and report.lints == ()


def test_symbolic_sizes_and_mesh_size_give_exact_formulas():
    model, plan, _ = _llama()
    report = tpfn.explain(model, plan, world_size=t, example_inputs=(b, s))
    assert report.bytes == 21504 * b * s * (t - 1) / t
    assert sympy.simplify(report.blocks_bytes - 2 * 8 * (t - 1) / t * b * s * 256 * 4) == 0
    assert report.blocks_bytes == report.megatron_bytes
    assert sympy.simplify(report.param_bytes - 5120 * (t + 1024) / t) == 0
    concrete = tpfn.explain(model, plan, world_size=4, example_inputs=(3, 10))
    at = {b: 3, s: 10, t: 4}
    assert [(c.kind, c.numel.subs(at), c.bytes.subs(at)) for c in report.comms] == [
        (c.kind, c.numel, c.bytes) for c in concrete.comms]
    assert report.to_dict()["bytes_per_step"] == "21504*b*s*(t - 1)/t"


def test_stand_in_sizes_can_be_chosen():
    model = local_heads(transformer(vocab_size=16, max_seq_len=64), 2)
    with pytest.raises(PlanError, match=r"seq_len <= max_seq_len, got 200 > 64"):
        tpfn.explain(model, transformer_plan(True), world_size=2, example_inputs=(b, s), sizes={s: 8})
    report = tpfn.explain(model, transformer_plan(True), world_size=2, example_inputs=(b, s),
                          sizes={s: 2, b: 1})
    assert report.megatron_bytes == report.blocks_bytes == 2 * 8 * b * s * 16 * 4 / 2


class _Pad(nn.Module):
    """Adds one position before a row-wise linear: its all-reduce moves b * (s + 1) * 4 values."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(4, 4)

    def forward(self, x):
        return self.w(torch.cat([x, x[:, :1]], dim=1))


class _PerRow(nn.Module):
    """Runs its row-wise linear once per batch row: the number of collectives grows with b."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(4, 4)

    def forward(self, x):
        return torch.stack([self.w(row) for row in x])


def test_sizes_that_are_no_product_of_symbols_are_an_error():
    plan = {"w": prepare_in(Replicate()) >> rowwise()}
    with pytest.raises(ValueError) as e:
        tpfn.explain(_Pad(), plan, world_size=2, example_inputs=(b, s, 4), dtype=torch.float32)
    assert str(e.value) == (
        "the forward all_reduce of 'w' moves 24, 264 and 3672 elements at (b, s) = (2, 2), (6, 10), "
        "(18, 50): not a product of powers of b, s, so no formula in them is exact; give these "
        "sizes as numbers, or other stand-ins with sizes=.")
    with pytest.raises(ValueError) as e:
        tpfn.explain(_PerRow(), plan, world_size=2, example_inputs=(b, 3, 4), dtype=torch.float32)
    assert str(e.value) == (
        "the collectives differ between the stand-in sizes (b) = (2), (6), (18): {'all_reduce': 2}, "
        "{'all_reduce': 6}, {'all_reduce': 18}; give these sizes as numbers.")
    assert tpfn.explain(_PerRow(), plan, world_size=2, example_inputs=(5, s, 4),
                        dtype=torch.float32).bytes == 5 * s * 4 * 4


def test_the_classic_global_head_view_fails_at_its_module_with_a_hint():
    model, plan, x = _reference(sp=False)
    with pytest.raises(PlanError) as e:
        tpfn.explain(model, plan, world_size=4, example_inputs=x)  # n_heads left at 64
    assert e.value.problems == [
        "the dry run's forward failed in 'layers.0.attention' (Attention): RuntimeError: shape "
        "'[2, 64, 64, 4]' is invalid for input of size 8192. Hint: 'layers.0.attention' reshapes "
        "the local outputs of its colwise() 'wq', 'wk', 'wv': each of the 4 ranks holds 1/4 of "
        "their features (of the heads), so a view with the global head count fails; hold the local "
        "count (heads // 4) with per_rank('n_heads') (the attribute it views by) in its style, view "
        "with -1, or hand it DTensors with colwise(local=False).",
        "'layers.0.attention' aten.view.default (torch/testing/_internal/distributed/_tensor/"
        "common_dtensor.py:174): views its shard as (2, 64, 64, 4) by self.n_heads = 64 that is the "
        "global one (and cannot: the rank's features do not fill it), where its share of one "
        "device's (2, 64, 64, 4) is (2, 64, 16, 4): the rank's features are cut into the wrong "
        "pieces (heads of the wrong size), silently; hold the count per rank with per_rank('n_heads') "
        "in the module's style, view with -1 for the count and the head size given, or hand the "
        "module DTensors (colwise(local=False))"]
    assert isinstance(e.value.__cause__, RuntimeError)


def test_heads_and_kv_heads_fewer_than_ranks_are_reported():
    model, plan, x = _llama(num_attention_heads=16, num_key_value_heads=4)
    report = tpfn.explain(model, plan, world_size=4, example_inputs=x)
    assert report.lints == ()
    with pytest.raises(PlanError) as e:  # refused by parallelize itself, before any forward
        tpfn.explain(model, plan, world_size=8, example_inputs=x)
    assert e.value.problems == [
        "'k_proj', 'v_proj' of 'model.layers.0.self_attn' (LlamaAttention) project 4 heads of 16 "
        "features: fewer heads than the 8 ranks, so colwise() cannot give each rank a whole head; "
        "use at most 4 ranks for tensor parallelism, or replicate the heads over groups of ranks "
        "with colwise(heads=4) (and 1 more like it)."]
    with pytest.raises(PlanError) as e:
        tpfn.explain(model, plan, world_size=3)
    assert e.value.problems[0] == (
        "'q_proj' of 'model.layers.0.self_attn' (LlamaAttention) projects 16 heads of 16 features: "
        "the 3 ranks do not divide them, so ranks would hold parts of heads; choose a mesh size "
        "that divides 16 (and 1 more like it).")


def test_uneven_dims_and_unsharded_siblings_are_linted():
    model = local_heads(transformer(vocab_size=10, max_seq_len=16), 4)
    plan = transformer_plan(False)
    del plan["layers.*.attention.w[qkv]"]
    plan["layers.*.attention.w[qk]"] = colwise()  # wv forgotten
    report = tpfn.explain(model, plan, world_size=4)
    assert report.lints == (
        "'tok_embeddings.weight' Shard(dim=0) is uneven over 4 ranks: (10, 16) -> (3, 16) on ranks "
        "0-2, (1, 16) on rank 3; pad dim 0 (10) to a multiple of 4, or choose a mesh size that "
        "divides it.",
        "'layers.0.attention.wv' (Linear) keeps weight whole on every rank while its sibling "
        "'layers.0.attention.wq' shards it (weight Shard(dim=0)); bind 'layers.0.attention.wv' in "
        "the plan too, or leave both unsharded (and 1 more like it).",
    )
    first_block_only = {"layers.0.feed_forward.w1": colwise(), "layers.0.feed_forward.w2": rowwise()}
    assert tpfn.explain(model, first_block_only, world_size=2).lints == (
        "'layers.1' (TransformerBlock) keeps feed_forward.w1.weight, feed_forward.w1.bias, "
        "feed_forward.w2.weight whole on every rank while its sibling 'layers.0' shards them "
        "(feed_forward.w1.weight Shard(dim=0), feed_forward.w1.bias Shard(dim=0), "
        "feed_forward.w2.weight Shard(dim=1)); bind 'layers.1' in the plan too, or leave both "
        "unsharded.",)
    plan["layers.*.attention"] = prepare_in(Replicate())  # q, k, v handed one DTensor
    with pytest.raises(PlanError) as e:
        tpfn.explain(model, plan, world_size=4, example_inputs=(2, 8))
    assert e.value.problems[0] == (
        "the dry run's forward failed in 'layers.0.attention.wv' (Linear): RuntimeError: "
        "aten.mm.default got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to "
        "DTensor before calling distributed operators! Hint: 'layers.0.attention.wv' computes on "
        "DTensors it is handed, but holds plain parameters: bind it in the plan (colwise(), "
        "rowwise(), replicate(), ...), or hand it local tensors.")
    assert e.value.problems[1:] == list(report.lints)


def test_rows_hold_placements_local_shapes_and_transitions():
    model = local_heads(transformer(vocab_size=10, max_seq_len=16), 4)
    report = tpfn.explain(model, transformer_plan(False), world_size=4, example_inputs=(2, 8))
    rows = {r.fqn: r for r in report.rows}
    assert [r.fqn for r in report.rows] == [fqn for fqn, _ in model.named_modules()]
    uneven = (((3, 16), 0, 2), ((1, 16), 3, 3))
    assert rows["tok_embeddings"].params == (Param("weight", Shard(0), (10, 16), uneven, 4),)
    assert rows["output"].params == (
        Param("weight", Shard(0), (10, 16), uneven, 4, tied="tok_embeddings.weight"),)
    assert rows["norm"].params[0] == Param("weight", None, (16,), (((16,), 0, 3),), 4)
    assert rows["output"].transitions == (
        Transition("input 0", Replicate(), Replicate(), ()),
        Transition("output 0", Shard(2), Replicate(), (AllGather(dim=2),)))
    assert rows["layers.0.attention.wo"].transitions[1] == Transition(
        "output 0", Partial(), Replicate(), (AllReduce(),))
    assert rows["output"].params[0].text == \
        "(10, 16) -> (3, 16) on ranks 0-2, (1, 16) on rank 3 (tied to tok_embeddings.weight)"
    assert report.param_bytes == _param_bytes(model, 4)
    declared = tpfn.explain(model, transformer_plan(False), world_size=4)
    assert {r.fqn: r.transitions for r in declared.rows}["output"][1] == Transition(
        "output 0", Shard(-1), Replicate(), (AllGather(dim=-1),))
    assert declared.comms == () and declared.megatron is None


def _param_bytes(model: nn.Module, n: int) -> int:
    """Rank 0's parameter bytes by hand: shards of torch.chunk, everything else whole."""
    sharded = {"tok_embeddings.weight": 0, "pos_embeddings.weight": 0}
    for i in range(len(model.layers)):
        for name, dim in (("attention.wq", 0), ("attention.wk", 0), ("attention.wv", 0),
                          ("attention.wo", 1), ("feed_forward.w1", 0), ("feed_forward.w2", 1)):
            sharded[f"layers.{i}.{name}.weight"] = dim
        sharded[f"layers.{i}.feed_forward.w1.bias"] = 0
    total = 0
    for name, p in model.named_parameters():
        numel = p.numel()
        if name in sharded:
            numel = p.chunk(n, sharded[name])[0].numel()
        total += numel * p.element_size()
    return total


def test_the_table_prints_each_module_once_and_repeated_blocks_with_their_count():
    mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    report = tpfn.explain(mlp, {"0": colwise(), "2": rowwise()}, world_size=4,
                          example_inputs=torch.randn(8, 16, requires_grad=True))
    assert report.text(width=None, wide=True) == """\
tpfn.explain on 4 ranks: one forward and backward of input 0 (8, 16) float32

module      style | layout                global -> local | steps  forward             backward
0 (Linear)  colwise()                                              -                   1 all_reduce 768 B
  weight    Shard(dim=0)                  (64, 16) -> (16, 16)
  bias      Shard(dim=0)                  (64,) -> (16,)
  input 0   Replicate() -> Replicate()    -
  output 0  Shard(dim=1) -> Shard(dim=1)  -
2 (Linear)  rowwise()                                              1 all_reduce 768 B  -
  weight    Shard(dim=1)                  (16, 64) -> (16, 16)
  bias      Replicate()                   (16,) -> (16,)
  input 0   Shard(dim=1) -> Shard(dim=1)  -
  output 0  Partial() -> Replicate()      AllReduce()

collectives per step: forward 1 all_reduce; backward 1 all_reduce; total 2 all_reduce
bytes per rank per step: forward 768 B; backward 768 B; total 1,536 B (1.5 KiB)
overlapping weight gradients: 1 of 1 backward collectives
parameter bytes per rank: 2,176 B (2.1 KiB)"""
    model = local_heads(transformer(vocab_size=16, n_layers=3), 2)
    table = tpfn.explain(model, transformer_plan(True), world_size=2,
                         example_inputs=(2, 8)).text(width=None, wide=True)
    assert re.search(r"^layers\.\*\.attention\.wo \(Linear\) x3 +rowwise\(\) >> "
                     r"prepare_out\(Shard\(dim=1\)\) +1 reduce_scatter 512 B +1 all_gather 512 B$",
                     table, re.M)
    assert "Megatron minimum, 3 blocks: 8(t-1)/t*b*s*h*e each with b*s=16, h=16, e=4: 12,288 B " \
           "(12.0 KiB); measured in the blocks: 12,288 B (12.0 KiB); ratio 1.00" in table


def test_to_dict_is_json_ready():
    model, plan, _ = _llama()
    report = tpfn.explain(model, plan, world_size=4, example_inputs=(b, 64))
    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["collectives"] == {"forward": {"all_reduce": 5, "all_gather": 1},
                                   "backward": {"all_reduce": 5},
                                   "total": {"all_reduce": 10, "all_gather": 1}}
    assert data["bytes_per_step"] == str(report.bytes) == "1032192*b"
    head = next(m for m in data["modules"] if m["fqn"] == "lm_head")
    assert head["params"] == [{"name": "weight", "placement": "Shard(dim=0)", "shape": [256, 256],
                               "local": [{"shape": [64, 256], "ranks": [0, 3]}],
                               "bytes_per_rank": 65536, "tied_to": None}]
    assert head["forward"] == {"all_gather": {"count": 1, "bytes": "49152*b"}}
    assert data["megatron"] == {"blocks": 2, "tokens": "64*b", "hidden": 256, "itemsize": 4,
                                "formula_bytes": "786432*b", "measured_bytes": "786432*b"}


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.open = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in ("meta",):
            self.open.append(tag)

    def handle_endtag(self, tag):
        assert self.open.pop() == tag


def test_the_html_picture_is_self_contained_and_shows_every_module():
    model = local_heads(transformer(vocab_size=16), 2)
    report = tpfn.explain(model, transformer_plan(True), world_size=2, example_inputs=(2, 8))
    page = report.to_html()
    parser = _Tags()
    parser.feed(page)
    assert parser.open == []  # every element closed
    assert not re.search(r"https?:|//|<script|<link|<img|<iframe|url\(|@import", page)
    assert {tag for tag, _ in parser.tags} <= {"html", "head", "meta", "title", "style", "body", "h1",
                                               "h2", "h3", "table", "tr", "th", "td", "p", "span",
                                               "div", "b", "a", "main", "header", "section",
                                               "details", "summary", "code", "ul", "li", "figure",
                                               "figcaption", "svg", "rect", "text", "title", "line"}
    for fqn, _ in model.named_modules():
        assert f"<code>{fqn.rpartition('.')[2] or '&lt;root&gt;'}</code>" in page
    assert '<span class="badge shard">Shard(dim=0)</span>' in page
    assert "<code>wo</code> <span class=\"type\">Linear</span>" in page
    assert "sends 1.0 KiB" in page and "ratio 1.00" in page


def test_bad_arguments_are_named():
    mlp = nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"^'world_size' must be a positive int or a sympy Symbol "
                                        r"\(got 0"):
        tpfn.explain(mlp, colwise(), world_size=0)
    with pytest.raises(TypeError, match=r"^'example_inputs' must be a tensor, a shape, a tuple of them"):
        tpfn.explain(mlp, colwise(), world_size=2, example_inputs="x")
    with pytest.raises(ValueError, match=r"^sizes names s, which no example input shape nor the world "
                                         r"size uses \(symbols: b\)\.$"):
        tpfn.explain(mlp, colwise(), world_size=2, example_inputs=(b, 4), sizes={s: 2})
    with pytest.raises(PlanError, match="'norm' -> colwise\\(\\) matches no module"):
        tpfn.explain(mlp, {"norm": colwise()}, world_size=2)


def _dtensors():
    model = tpfn.parallelize(nn.Linear(4, 4), mesh(2), colwise())
    found = []
    for module, x in ((model, None), (nn.Linear(4, 4), model.weight)):
        try:
            tpfn.explain(module, colwise(), world_size=2, example_inputs=x)
        except (TypeError, ValueError) as e:
            found.append(str(e))
    return found


def test_explain_takes_the_module_before_parallelize_and_local_inputs(ranks2):
    assert ranks2.run(_dtensors)[0] == [
        "'weight' is already a DTensor: explain takes the module as it is before parallelize "
        "(build it on the meta device if it is big).",
        "example inputs are local values as a rank passes them: give a tensor, a meta tensor or "
        "a shape, not a DTensor (got one of shape (4, 4)).",
    ]


class _Broadcasts(nn.Module):
    def forward(self, x):
        return funcol.broadcast(x, 0, fake_mesh(2))


def test_record_refuses_collectives_outside_the_ring_model():
    model = nn.Sequential(_Broadcasts())
    with pytest.raises(ValueError) as e, record(model):
        model(torch.ones(2, device="meta"))
    assert str(e.value) == (
        "'0' issued _c10d_functional.broadcast.default (broadcast) in the forward: tpfn measures "
        "the collectives tensor parallelism uses, all_gather, all_reduce, reduce_scatter, "
        "all_to_all; record a region without it.")
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks  # record cleaned up


def _c10d_collectives():
    model = nn.Linear(2, 2)
    x = torch.ones(4, 2)
    with record(model) as comms:
        dist.all_reduce(x)
        dist.all_gather_into_tensor(torch.empty(8, 2), x)
        dist.reduce_scatter_tensor(torch.empty(2, 2), x)
        dist.all_reduce_coalesced([x, torch.ones(2)])
    return comms


def test_record_measures_c10d_collectives_too(ranks2):
    assert ranks2.run(_c10d_collectives)[0] == [
        Comm(None, "forward", "all_reduce", 8, 2, 4),
        Comm(None, "forward", "all_gather", 16, 2, 4),
        Comm(None, "forward", "reduce_scatter", 8, 2, 4),
        Comm(None, "forward", "all_reduce", 10, 2, 4),  # coalesced: one collective of both
    ]


def test_a_collective_after_the_backward_belongs_to_no_module():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    engine = torch.autograd.Variable._execution_engine

    def reduce_at_the_end(param):
        engine.queue_callback(lambda: funcol.all_reduce(param.grad, "sum", fake_mesh(4)))

    model.weight.register_post_accumulate_grad_hook(reduce_at_the_end)
    with record(model) as comms:
        model(torch.ones(2, 4, device="meta")).sum().backward()
    assert comms == [Comm(None, "backward", "all_reduce", 16, 4, 4)]


@given(vocab=st.integers(1, 40), n=st.integers(1, 9), tokens=st.integers(1, 6))
def test_local_shapes_tile_and_bytes_follow_the_ring_model(vocab, n, tokens):
    model = nn.Sequential(nn.Embedding(vocab, 4), nn.Linear(4, vocab, bias=False))
    report = tpfn.explain(model, {"0": rowwise(), "1": colwise() >> prepare_out(Replicate())},
                          world_size=n, example_inputs=(tokens,))
    sizes = [len(c) for c in torch.arange(vocab).chunk(n)]
    sizes += [0] * (n - len(sizes))  # torch.chunk leaves the last ranks empty
    for row in report.rows:
        for p in row.params:
            assert [shape for shape, first, last in p.local for _ in range(first, last + 1)] == [
                (size, 4) for size in sizes]
    padded = n * -(-vocab // n) * tokens  # DTensor pads uneven shards to gather them
    expected = [] if n == 1 else [Comm("0", "forward", "all_reduce", tokens * 4, n, 4),
                                  Comm("1", "forward", "all_gather", padded, n, 4),
                                  Comm("1", "backward", "all_reduce", tokens * 4, n, 4, True)]
    assert list(report.comms) == expected
    ring = sympy.Rational(n - 1, n)
    assert report.bytes == 4 * ring * (2 * tokens * 4 * 2 + padded)


# Attention code as people write it: nanoGPT's (it keeps its config on the root), minGPT's
# (no config anywhere), a fused q, k, v for grouped-query attention.


class GPTConfig:
    def __init__(self, n_embd=64, n_head=4, n_layer=2, vocab_size=64, block_size=16):
        self.n_embd, self.n_head, self.n_layer = n_embd, n_head, n_layer
        self.vocab_size, self.block_size = vocab_size, block_size


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one fused c_attn split by n_embd, heads viewed by n_head."""

    def __init__(self, config, view_by_heads: bool = False):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.view_by_heads = view_by_heads

    def forward(self, x):
        B, T, C = x.size()
        if self.view_by_heads:  # the usual "fix" of the split, which leaves the heads wrong
            q, k, v = self.c_attn(x).chunk(3, dim=-1)
        else:
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(B, T, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, config, **kw):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(config.n_embd), CausalSelfAttention(config, **kw)

    def forward(self, x):
        return x + self.attn(self.ln_1(x))


class GPT(nn.Module):
    """nanoGPT's shape: the config on the root, blocks under transformer.h."""

    def __init__(self, config, keep_config: bool = True, **kw):
        super().__init__()
        if keep_config:
            self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList(Block(config, **kw) for _ in range(config.n_layer))))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(x)


GPT_PLAN = {
    "transformer.h.*.attn": prepare_in(Replicate()),
    "transformer.h.*.attn.c_attn": colwise(parts=3),
    "transformer.h.*.attn.c_proj": rowwise(),
    "lm_head": colwise() >> prepare_out(Replicate()),
}

GLOBAL_N_HEAD = (
    "'transformer.h.0.attn' (CausalSelfAttention) holds n_head = 4, the global head count of "
    "'c_attn', whose colwise(parts=3) hands on local shards: each of the 2 ranks holds 2 of the 4 "
    "heads, so a view by n_head heads (view(B, T, self.n_head, -1)) makes heads of the wrong "
    "size, silently; hold the local count (2) with per_rank('n_head') in its style, view with -1 "
    "heads of the head size, or hand it DTensors with colwise(local=False) (and 1 more like it).")
VIEW_LINE = f"tests/test_explain.py:{CausalSelfAttention.forward.__code__.co_firstlineno + 6}"
SPLIT_LINE = f"tests/test_explain.py:{CausalSelfAttention.forward.__code__.co_firstlineno + 5}"


def test_a_global_head_count_next_to_local_shards_is_linted_though_nothing_fails():
    model = GPT(GPTConfig(), view_by_heads=True)
    report = tpfn.explain(model, GPT_PLAN, world_size=2, example_inputs=(2, 8))  # runs: -1 absorbs
    assert report.lints == report.warnings == (  # what the analysis saw on the ranks
        f"'transformer.h.*.attn' aten.view.default ({VIEW_LINE}): views its shard as (2, 8, 4, 8) by "
        "self.n_head = 4 that is the global one, where its share of one device's (2, 8, 4, 16) is "
        "(2, 8, 2, 16): the rank's features are cut into the wrong pieces (heads of the wrong size), "
        "silently; hold the count per rank with per_rank('n_head') in the module's style, view with "
        "-1 for the count and the head size given, or hand the module DTensors (colwise(local=False)) "
        "(and 5 more like it)",)
    minigpt = GPT(GPTConfig(), keep_config=False, view_by_heads=True)  # minGPT keeps no config
    assert tpfn.explain(minigpt, GPT_PLAN, world_size=2).lints == (GLOBAL_N_HEAD,)
    held = {**GPT_PLAN, "transformer.h.*.attn": prepare_in(Replicate()) >> per_rank("n_head")}
    report = tpfn.explain(model, held, world_size=2, example_inputs=(2, 8))  # the fix the lint names
    assert report.lints == ()
    attn = next(m for m in report.to_dict()["modules"] if m["fqn"] == "transformer.h.0.attn")
    assert attn["per_rank"] == [{"name": "n_head", "global": 4, "local": 2}]
    assert re.search(r"\n  n_head +per rank +4 -> 2\n", report.text(width=None, wide=True))
    for block in model.transformer.h:  # the local count set by hand (config.n_head is 4): the names
        block.attn.n_head //= 2          # look right, but the model now has 2 heads, and the ranks 4
    assert tpfn.explain(model, GPT_PLAN, world_size=2).lints == ()
    assert "views its shard as (2, 8, 2, 16) by self.n_head = 2 that is the global one" in tpfn.explain(
        model, GPT_PLAN, world_size=2, example_inputs=(2, 8)).lints[0]
    for block in minigpt.transformer.h:  # without a config: its numbers are all local
        block.attn.n_head //= 2
        block.attn.n_embd //= 2
    assert tpfn.explain(minigpt, GPT_PLAN, world_size=2).lints == ()
    gathered = {**GPT_PLAN, "transformer.h.*.attn.c_attn": colwise(parts=3, local=False)}
    assert tpfn.explain(GPT(GPTConfig(), view_by_heads=True), gathered, world_size=2).lints == ()
    report = tpfn.explain(GPT(GPTConfig(n_embd=48, n_head=3), view_by_heads=True), GPT_PLAN,
                          world_size=2)
    assert report.lints[0] == (
        "'transformer.h.0.attn' (CausalSelfAttention) holds n_head = 3, the global head count of "
        "'c_attn', whose colwise(parts=3) hands on local shards: the 2 ranks cannot split 3 heads "
        "into whole heads each; choose a mesh size that divides 3 (and 1 more like it).")


def test_a_split_by_the_global_width_after_colwise_fails_with_a_hint():
    with pytest.raises(PlanError) as e:
        tpfn.explain(GPT(GPTConfig()), GPT_PLAN, world_size=2, example_inputs=(2, 8))
    assert e.value.problems == [
        "the dry run's forward failed in 'transformer.h.0.attn' (CausalSelfAttention): ValueError: "
        "not enough values to unpack (expected 3, got 2). Hint: 'transformer.h.0.attn' splits the "
        "local output of its colwise(parts=3) 'c_attn': each of the 2 ranks holds 96 of its 192 "
        "features (1/2 of each of its 3 parts), so a split by the global size (n_embd = 64) gives "
        "2 pieces, not 3; split by the local size (64 // 2 = 32) with per_rank('n_embd') in its "
        "style, or with .chunk(3, dim=-1), or hand it DTensors with colwise(local=False).",
        f"'transformer.h.0.attn' aten.split.Tensor ({SPLIT_LINE}): splits its shard into a piece of "
        "(2, 8, 64) by 64, a size that is the global one, where its share of one device's (2, 8, 64) "
        "is (2, 8, 32): each rank holds 1/2 of the features it splits; split by the local size (held "
        "with per_rank(...) in the module's style), or with chunk(...)"]
    plain = {**GPT_PLAN, "transformer.h.*.attn.c_attn": colwise()}
    with pytest.raises(PlanError) as e:
        tpfn.explain(GPT(GPTConfig()), plain, world_size=4, example_inputs=(2, 8))
    assert e.value.problems[0].endswith(
        "Hint: 'transformer.h.0.attn' splits the local output of its colwise() 'c_attn': each of "
        "the 4 ranks holds 48 of its 192 features, so a split by the global size (n_embd = 64) "
        "gives 1 piece, not 3; bind it to colwise(parts=3), so that each rank holds its slice of "
        "every part, and split by the local size with per_rank('n_embd') in its style or with "
        ".chunk(3, dim=-1).")
    assert e.value.problems[1] == (  # one device's split, typed: the analysis
        f"'transformer.h.*.attn' aten.split.Tensor ({SPLIT_LINE}): split cuts dim 2 into pieces of "
        "(64, 64, 64), but each of the 4 ranks holds a contiguous 1/4 of its 192 features, not its share "
        "of each piece (rank 0 holds the first 48); shard the projection that makes them with "
        "colwise(parts=3), so that each rank holds its slice of every piece (and 1 more like it)")
    assert tpfn.explain(GPT(GPTConfig()), plain, world_size=4).lints[1] == (  # without inputs: the names
        "'c_attn' of 'transformer.h.0.attn' (CausalSelfAttention) fuses q, k and v (4 heads of 16 "
        "features each: 3 x 64 = 192 features), and colwise() cuts its output into 4 contiguous "
        "shards of 48 features, across q, k and v, so each rank computes attention on the wrong "
        "features, silently; use colwise(parts=3), which gives each rank its slice of q, of k and "
        "of v (and 1 more like it).")


class FusedGQA(nn.Module):
    """Grouped-query attention with one fused q, k, v projection of unequal parts."""

    def __init__(self, dim=128, num_heads=8, num_key_value_heads=2):
        super().__init__()
        self.num_heads, self.num_key_value_heads = num_heads, num_key_value_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, (num_heads + 2 * num_key_value_heads) * self.head_dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        q, k, v = self.qkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q, k, v = (z.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.o(y.transpose(1, 2).flatten(2))


def test_a_fused_qkv_of_unequal_parts_under_colwise_is_linted():
    plan = {"": prepare_in(Replicate()), "qkv": colwise(), "o": rowwise()}
    with pytest.raises(PlanError) as e:
        tpfn.explain(FusedGQA(), plan, world_size=2, example_inputs=(2, 8, 128), dtype=torch.float32)
    line = f"tests/test_explain.py:{FusedGQA.forward.__code__.co_firstlineno + 2}"
    assert e.value.problems[1:] == [
        f"'<root>' aten.split_with_sizes.default ({line}): split_with_sizes cuts dim 2 into pieces of "
        "(128, 32, 32), but each of the 2 ranks holds a contiguous 1/2 of its 192 features, not its "
        "share of each piece (rank 0 holds the first 96); shard the projection that makes them with "
        "colwise(parts=(128, 32, 32)), so that each rank holds its slice of every piece"]
    assert tpfn.explain(FusedGQA(), plan, world_size=2).lints == (  # without inputs: the names
        "'qkv' of '<root>' (FusedGQA) fuses q, k and v of unequal sizes (8 heads and 2 + 2 KV heads "
        "of 16 features: 128 + 32 + 32 = 192 features), and colwise() cuts its output into 2 "
        "contiguous shards of 96 features, across q, k and v, so each rank computes attention on "
        "the wrong features, silently; use colwise(parts=(128, 32, 32)), which gives each rank its "
        "slice of q, of k and of v.",)
    equal_parts = tpfn.explain(FusedGQA(), {**plan, "qkv": colwise(parts=3)}, world_size=2)
    assert equal_parts.lints == (
        "'qkv' of '<root>' (FusedGQA) fuses q, k and v of unequal sizes (8 heads and 2 + 2 KV heads "
        "of 16 features: 128 + 32 + 32 = 192 features), and colwise(parts=3) cuts it into parts of "
        "64 + 64 + 64 features, not q, k and v, so each rank computes attention on the wrong "
        "features, silently; use colwise(parts=(128, 32, 32)), which gives each rank its slice of "
        "q, of k and of v.",)
    assert [lint for lint in tpfn.explain(FusedGQA(), {**plan, "qkv": colwise(parts=(128, 32, 32))},
                                          world_size=2).lints if "fuses" in lint] == []
    gathered = {"qkv": colwise() >> prepare_out(Replicate()), "o": prepare_in(Replicate()) >> rowwise()}
    assert tpfn.explain(FusedGQA(), gathered, world_size=2, example_inputs=(2, 8, 128),
                        dtype=torch.float32).lints == ()
    assert tpfn.explain(FusedGQA(), plan, world_size=1).lints == ()


def test_a_rowwise_linear_with_no_colwise_partner_fails_with_a_hint():
    mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    with pytest.raises(PlanError) as e:
        tpfn.explain(mlp, {"2": rowwise()}, world_size=2, example_inputs=(8, 16), dtype=torch.float32)
    assert e.value.problems == [
        "the dry run's forward failed in '2' (Linear): RuntimeError: a and b must have same "
        "reduction dim, but got [8, 64] X [32, 16]. Hint: '2' is rowwise(): each rank holds 32 of "
        "its 64 input features, so it takes the local shard that a colwise() module hands on, but "
        "its input has all 64 (the global in_features): no colwise() module feeds it; bind the "
        "projection before it to colwise(), or split a replicated input with "
        "prepare_in(Replicate()) >> rowwise().",
        "'2' input 0: arrives as replicated where its style (rowwise(), on Linear) takes a local tensor "
        "as Shard(dim=-1): it takes the value as if it were laid out so, and the module computes on "
        "other numbers than one device; lay out the slot as it arrives (prepare_in(Replicate()) or "
        "given=), or move it before"]
    assert tpfn.explain(mlp, {"2": prepare_in(Replicate()) >> rowwise()}, world_size=2,
                        example_inputs=(8, 16), dtype=torch.float32).count("forward") == {
        "all_reduce": 1}


def test_a_symbolic_world_size_names_its_stand_in():
    model, plan, _ = _llama(num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(PlanError) as e:
        tpfn.explain(model, plan, world_size=t, example_inputs=(b, s))
    assert e.value.problems == [
        "'k_proj', 'v_proj' of 'model.layers.0.self_attn' (LlamaAttention) project 2 heads of 64 "
        "features: fewer heads than the 4 ranks (the stand-in world size t=4), so colwise() cannot "
        "give each rank a whole head; use at most 2 ranks for tensor parallelism, or replicate the "
        "heads over groups of ranks with colwise(heads=2) (and 1 more like it)."]


TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def test_a_hugging_face_model_set_up_for_training_dry_runs_on_its_inputs():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, use_cache=False))  # reads its position ids' values
    plan = tpfn.from_hf(model.tp_plan, model)
    report = tpfn.explain(model, plan, world_size=2, example_inputs=(2, 8))   # the ids real
    cached = LlamaForCausalLM(LlamaConfig(**TINY))
    assert report.comms == tpfn.explain(cached, plan, world_size=2, example_inputs=(2, 8)).comms
    assert report.lints == ()


class Rotary(nn.Module):
    """An MLP whose input is rotated by a table its forward builds with torch.arange (no device=)."""

    def __init__(self, dim=16):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        angles = torch.arange(x.shape[1]).float()[:, None] * self.inv_freq   # on the CPU, beside a buffer
        table = torch.cat([angles.cos(), angles.sin()], dim=-1)
        return self.down(torch.relu(self.up(x * table)))


def test_a_rotary_table_built_without_a_device_dry_runs():
    plan = {"up": colwise(), "down": rowwise()}
    report = tpfn.explain(Rotary(), plan, world_size=2, example_inputs=(2, 8, 16), dtype=torch.float32)
    assert report.collectives == {"all_reduce": 1} and report.lints == ()


def test_a_value_read_from_the_weights_fails_with_a_hint():
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x) if self.proj(x).sum() > 0 else x

    with pytest.raises(PlanError) as e:
        tpfn.explain(Gate(), {"proj": colwise() >> prepare_out(Replicate())}, world_size=2,
                     example_inputs=(2, 4), dtype=torch.float32)
    assert "the dry run's parameters are meta tensors, which hold no values" in e.value.problems[0]


def test_hugging_face_attention_gets_no_head_lints():
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                              Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    torch.manual_seed(0)
    for model in (LlamaForCausalLM(LlamaConfig(**TINY)), Qwen2ForCausalLM(Qwen2Config(**TINY)),
                  Phi3ForCausalLM(Phi3Config(**TINY, pad_token_id=0))):
        report = tpfn.explain(model, tpfn.from_hf(model.tp_plan, model), world_size=2,
                              example_inputs=(2, 8))
        assert report.lints == (), type(model)
    # Phi-3 gathers its fused q, k, v; left on local shards they are cut across.
    phi3 = Phi3ForCausalLM(Phi3Config(**TINY, pad_token_id=0))
    assert tpfn.explain(phi3, {"model.layers.*.self_attn.qkv_proj": colwise()},
                        world_size=2).lints[0].startswith(
        "'qkv_proj' of 'model.layers.0.self_attn' (Phi3Attention) fuses q, k and v of unequal "
        "sizes (4 heads and 2 + 2 KV heads of 8 features: 32 + 16 + 16 = 64 features), and "
        "colwise() cuts its output into 2 contiguous shards of 32 features")
    # GPT-2's Conv1D projections pack q, k and v: colwise() cuts across them, colwise(parts=3)
    # does not, and the attention then holds its global head count.
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64,
                                      n_positions=16, eos_token_id=0, bos_token_id=0))
    gpt2_plan = {"transformer.wte": rowwise(), "lm_head": colwise() >> prepare_out(Replicate())}
    assert tpfn.explain(gpt2, gpt2_plan, world_size=2, example_inputs=(2, 8)).lints == ()
    assert tpfn.explain(gpt2, {"transformer.h.*.attn.c_attn": colwise()}, world_size=2).lints[0].startswith(
        "'c_attn' of 'transformer.h.0.attn' (GPT2Attention) fuses q, k and v (4 heads of 8 features "
        "each: 3 x 32 = 96 features), and colwise() cuts its output into 2 contiguous shards")
    packed = {"transformer.h.*.attn.c_attn": colwise(parts=3)}
    assert "hold the local count (2) with per_rank('num_heads') in its style" in tpfn.explain(
        gpt2, packed, world_size=2).lints[0]
    held = {**packed, "transformer.h.*.attn": per_rank("num_heads", "split_size")}
    assert tpfn.explain(gpt2, held, world_size=2).lints == ()


def test_the_dry_run_takes_the_route_a_real_run_takes():
    # q, k and v read their attention's replica: with kernels, one all-reduce of their summed
    # partial input gradients (the replica's, in the attention); on the reference route, each its
    # own. Each linear kernel that moves its input gradient back computes its weight gradient
    # meanwhile (overlap): w1 and the head.
    model = local_heads(transformer(vocab_size=64, dim=32, n_heads=4, n_layers=2, max_seq_len=16), 2)
    for sp in (False, True):
        reports = {kernels: tpfn.explain(model, transformer_plan(sp), world_size=2, example_inputs=(2, 16),
                                         kernels=kernels) for kernels in (True, False)}
        back = {k: collections.Counter(c.fqn for c in r.comms if c.phase == "backward"
                                       and c.kind in ("all_reduce", "reduce_scatter"))
                for k, r in reports.items()}
        assert back[True]["layers.0.attention"] == 1 and back[True]["layers.0.attention.wq"] == 0
        assert back[False]["layers.0.attention"] == 0 and back[False]["layers.0.attention.wq"] == 1
        assert sum(back[False].values()) == sum(back[True].values()) + 2 * 2  # 2 of 3 per layer
        overlapping = {c.fqn for c in reports[True].comms if c.phase == "backward" and c.overlaps}
        assert overlapping == {"layers.0.feed_forward.w1", "layers.1.feed_forward.w1", "output"}, sp
        assert not any(c.overlaps for c in reports[False].comms)