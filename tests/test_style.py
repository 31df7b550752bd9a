"""Styles are values: printable, comparable, composed associatively, folded to one
redistribution per slot, bound to module kinds with the right defaults."""

import pytest
import torch
import torch.nn as nn
from hypothesis import assume, example, given
from hypothesis import strategies as st

import tpfn
from tests import virtual
from tpfn import (
    Partial, Replicate, Shard, StyleError, colwise, identity, on_shards, params, per_rank, prepare_in,
    prepare_out, replicate, rowwise, sequence_parallel,
)
from tpfn.algebra import comm_bytes, transition
from tpfn.plans.mount import mount, problems
from tpfn.style.slot import Slot

NAMESPACE = {name: getattr(tpfn, name) for name in tpfn.__all__}

slot_layouts = st.one_of(st.none(), st.sampled_from([Shard(0), Shard(1), Shard(-1), Replicate()]))
out_layouts = st.one_of(slot_layouts, st.just(Partial()))
flags = st.sampled_from([None, True, False])


@st.composite
def prepare_ins(draw):
    n = draw(st.integers(0, 2))
    given = [draw(slot_layouts) for _ in range(n)]
    desired = tuple(draw(slot_layouts) for _ in range(n))
    kwargs = draw(st.dictionaries(st.sampled_from(["mask", "pos"]), st.tuples(slot_layouts, slot_layouts),
                                  max_size=1))
    return prepare_in(*given, desired=desired or None, kwargs=kwargs or None, local=draw(flags))


@st.composite
def prepare_outs(draw):
    n = draw(st.integers(0, 2))
    desired = [draw(slot_layouts) for _ in range(n)]
    givens = tuple(draw(out_layouts) for _ in range(n))
    return prepare_out(*desired, given=givens or None, local=draw(flags))


@st.composite
def on_shards_styles(draw):
    desired = draw(st.lists(slot_layouts, max_size=2).map(tuple))
    each = st.tuples(*[out_layouts for _ in desired])  # one per input, None included
    grads = draw(st.one_of(st.none(), out_layouts, each) if desired else st.one_of(st.none(), each))
    return on_shards(*desired, grads=grads, output=draw(out_layouts), local=draw(flags))


@st.composite
def per_ranks(draw):
    """``per_rank`` over a few names, which overlap between draws (conflicts included)."""
    names = draw(st.lists(st.sampled_from(["num_heads", "config.n_head", "nf"]), max_size=2))
    option = draw(st.sampled_from([{}, {"heads": 2}, {"per_head": 2}, {"heads": 4}]))
    inputs = draw(st.dictionaries(st.sampled_from(["alibi"]), st.sampled_from([4, 8]), max_size=1))
    if option and inputs or not (names or inputs):
        return per_rank(*names or ["num_heads"], **option)
    return per_rank(*names, inputs=inputs or None, **option)


stages = st.one_of(
    per_ranks(),
    prepare_ins(),
    prepare_outs(),
    st.builds(colwise, local=flags),
    st.builds(rowwise, local=flags),
    st.builds(sequence_parallel, st.integers(-2, 2), local=flags),
    on_shards_styles(),
    st.builds(colwise, parts=st.integers(1, 3), local=flags),
    st.builds(lambda **kw: params(**kw), **{"w": st.sampled_from([Shard(0), Replicate()])}),
    st.just(replicate()),
    st.just(identity()),
)


def compose(*parts):
    style = identity()
    for part in parts:
        style = style >> part
    return style


def outcome(thunk):
    try:
        return thunk()
    except StyleError:
        return StyleError


styles = st.lists(stages, max_size=3).map(lambda parts: outcome(lambda: compose(*parts)))
valid_styles = styles.filter(lambda s: s is not StyleError)


@given(valid_styles)
@example(on_shards(Replicate(), grads=(None,)))  # no gradient for the input, not the default
def test_a_style_prints_as_the_code_that_builds_it(style):
    rebuilt = eval(repr(style), NAMESPACE)
    assert rebuilt == style and hash(rebuilt) == hash(style)


@given(valid_styles, valid_styles, valid_styles)
def test_composition_is_associative_including_its_errors(a, b, c):
    assert outcome(lambda: (a >> b) >> c) == outcome(lambda: a >> (b >> c))


@given(valid_styles)
def test_identity_is_neutral(style):
    assert identity() >> style == style == style >> identity()


@given(valid_styles, valid_styles)
def test_equal_styles_hash_alike(a, b):
    assert (a == b) == (repr(a) == repr(b))
    if a == b:
        assert hash(a) == hash(b)


# A chain of slots folds into one: the direct transition, never dearer than the chain.
@given(st.lists(st.tuples(slot_layouts, out_layouts), min_size=1, max_size=4), st.integers(0, 99))
def test_a_chain_of_slots_mounts_as_one_redistribution(pairs, seed):
    stages_ = [prepare_out(d, given=g) for d, g in pairs]
    style = outcome(lambda: compose(*stages_))
    assume(style is not StyleError)
    m = mount(style, nn.Identity())
    assert len(m.outputs.slots) <= 1
    chain = [s for stage in style.stages for s in stage.slots if not s.untouched]
    assume(chain and chain[0].given is not None)
    folded = m.outputs.slots[0]
    shape, mesh = (4, 6, 5), (2,)
    t = torch.randint(-9, 10, shape, generator=torch.Generator().manual_seed(seed)).double()
    start = folded.given
    try:
        direct = transition(start, folded.out, ndim=3)
    except ValueError:
        return  # e.g. Partial -> Partial of another op: rejected either way
    held = virtual.scatter(t, start, mesh, seed)
    step_by_step, cost, current = held, 0, start
    for slot in chain:
        steps = transition(current, slot.out, ndim=3)
        step_by_step = virtual.execute(steps, step_by_step, mesh)
        cost += comm_bytes(steps, shape, mesh, 8)
        current = slot.out
    at_once = virtual.execute(direct, held, mesh)
    torch.testing.assert_close(virtual.gather(at_once, folded.out, mesh),
                               virtual.gather(step_by_step, current, mesh))
    assert comm_bytes(direct, shape, mesh, 8) <= cost


def test_prepare_in_then_colwise_is_pytorchs_colwise_with_input_layouts():
    m = mount(prepare_in(Shard(1)) >> colwise() >> prepare_out(Replicate()), nn.Linear(2, 2))
    assert m.inputs.slots == (Slot(Shard(1), Replicate()),)
    assert m.outputs.slots == (Slot(Shard(-1), Replicate()),)
    assert m.outputs.local is True
    # nn.Linear's layouts are known: it computes on local shards (tpfn.plans.kinds).
    assert m.shards is not None and m.inputs.local is True


def test_modules_with_their_own_forward_compute_on_dtensors():
    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    m = mount(colwise(), Scaled(2, 2))
    assert m.shards is None and m.inputs.local is False
    assert mount(rowwise(), nn.Embedding(4, 2, padding_idx=0)).shards is None  # DTensor masks it
    assert mount(rowwise(), nn.Embedding(4, 2, scale_grad_by_freq=True)).shards is None


def test_rowwise_then_shard_reduce_scatters_directly():
    m = mount(rowwise() >> prepare_out(Shard(1)), nn.Linear(2, 2))
    assert m.outputs.slots == (Slot(Partial(), Shard(1)),)
    assert transition(Partial(), Shard(1)) == (tpfn.algebra.ReduceScatter(1),)


def test_defaults_follow_the_module_kind():
    assert mount(rowwise(), nn.Embedding(4, 2)).inputs.slots == (Slot(None, Replicate()),)
    assert mount(rowwise(), nn.Embedding(4, 2)).params == (("weight", Shard(0)),)
    assert mount(rowwise(), nn.Linear(4, 2)).inputs.slots == (Slot(None, Shard(-1)),)
    assert mount(rowwise(), nn.Linear(4, 2)).params == (("bias", Replicate()), ("weight", Shard(1)))
    assert mount(colwise(), nn.Embedding(4, 2)).params == (("weight", Shard(1)),)
    assert mount(colwise(), nn.Linear(4, 2, bias=False)).params == (("weight", Shard(0)),)
    sp = mount(sequence_parallel(), nn.LayerNorm(4))
    assert sp.params == (("bias", Replicate()), ("weight", Replicate()))
    assert sp.inputs.slots == (Slot(None, Shard(1)),) and sp.outputs.local is False
    assert mount(sequence_parallel(dim=0), nn.Dropout()).outputs.slots == (Slot(Shard(0)),)


def test_local_is_the_rightmost_choice():
    assert mount(colwise(local=False), nn.Linear(2, 2)).outputs.local is False
    assert mount(colwise(local=False) >> prepare_out(local=True), nn.Linear(2, 2)).outputs.local is True
    assert mount(sequence_parallel(local=True), nn.LayerNorm(2)).outputs.local is True
    assert mount(prepare_in(Shard(0), local=True), nn.Identity()).inputs.local is True


def test_a_lone_named_layout_means_what_a_positional_one_does():
    # An input's lone layout is the one it arrives in; an output's, the one it leaves in.
    assert prepare_in(kwargs={"mask": Shard(0)}) == prepare_in(kwargs={"mask": (Shard(0), None)})
    assert prepare_out(keys={"logits": Replicate()}) == prepare_out(keys={"logits": (None, Replicate())})
    assert prepare_out(Replicate()).stages[0].slots[0] == Slot(None, Replicate())


def test_params_and_replicate_place_parameters():
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.zeros(2, 3, 4))
            self.inner = nn.Linear(2, 2)

    m = mount(params(w1=Shard(0), **{"inner.weight": Shard(1)}) >> replicate(), Experts())
    assert m.params == (("inner.weight", Shard(1)), ("w1", Shard(0)))
    assert mount(replicate(), nn.LayerNorm(3)).params == (("bias", Replicate()), ("weight", Replicate()))


@pytest.mark.parametrize("build, error, message", [
    (lambda: colwise() >> 3, TypeError,
     "`>>` composes styles (colwise(), prepare_in(...), ...); got 3 that is a <class 'int'>."),
    (lambda: "colwise" >> rowwise(), TypeError,
     "`>>` composes styles (colwise(), prepare_in(...), ...); got 'colwise' that is a "
     "<class 'str'> on its left."),
    (lambda: colwise() >> prepare_in(Shard(1)), StyleError,
     "prepare_in(Shard(dim=1)) comes after colwise(): inputs are prepared before the module "
     "computes; put it first, e.g. prepare_in(Shard(dim=1)) >> colwise()."),
    (lambda: colwise() >> rowwise(), StyleError,
     "colwise() >> rowwise(): a style shards its module one way; bind each to its own module "
     "in a plan."),
    (lambda: prepare_out(Replicate()) >> colwise(), StyleError,
     "prepare_out(Replicate()) comes before colwise(): outputs are prepared after the module "
     "computes; write colwise() >> prepare_out(Replicate())."),
    (lambda: colwise() >> prepare_out(Shard(0), given=Replicate()), StyleError,
     "output 0: one stage delivers Shard(dim=-1) and the next declares it arrives as "
     "Replicate(); make the declarations agree (or leave given=None)."),
    (lambda: colwise(parts=2) >> prepare_out(Replicate(), given=Shard(1)), StyleError,  # packed != plain
     "output 0: one stage delivers Shard(dim=-1, parts=2) and the next declares it arrives as "
     "Shard(dim=1); make the declarations agree (or leave given=None)."),
    (lambda: params(w=Shard(0)) >> params(w=Shard(1)), StyleError,
     "parameter 'w' is placed twice: Shard(dim=0) and Shard(dim=1); keep one."),
    (lambda: prepare_in("S1"), TypeError,
     "prepare_in: input 0 must be a placement (Shard, Replicate, Partial) or None "
     "(got 'S1' that is a <class 'str'>)."),
    (lambda: prepare_in(Shard(1), Shard(0), desired=Replicate()), TypeError,
     "prepare_in: 'desired' has one layout for 2 slots: give a tuple of 2 (None: untouched)."),
    (lambda: prepare_in(Shard(1), kwargs={"mask": "R"}), TypeError,
     "prepare_in: 'kwargs'['mask'] must be a placement or a (given, desired) pair (got 'R')."),
    (lambda: colwise(local="yes"), TypeError,
     "'local' must be True, False or None (got 'yes' that is a <class 'str'>)."),
    (lambda: sequence_parallel(dim=1.0), TypeError,
     "'dim' must be <class 'int'> (got 1.0 that is a <class 'float'>)."),
    (lambda: params(w=Partial()), TypeError,
     "params: 'w' must be Shard(dim) or Replicate() (got Partial() that is a "
     "<class 'tpfn.layout.Partial'>); a parameter holds values, never pending partial sums."),
])
def test_bad_compositions_and_arguments_are_named(build, error, message):
    with pytest.raises(error) as info:
        build()
    assert str(info.value) == message


@given(st.lists(per_ranks(), min_size=1, max_size=3))
def test_per_rank_folds_into_one_rule_per_attribute_and_input(parts):
    style = outcome(lambda: compose(*parts))
    rules = [r for p in parts for r in p.stages[0].rules()]
    held = {}
    clash = any(held.setdefault((what, name), rule) != rule for what, name, rule in rules)
    assert (style is StyleError) == clash
    if not clash:
        assert style.normal.sizes == tuple(sorted((n, r) for (w, n), r in held.items() if w == "attribute"))
        assert style.normal.per_head == tuple(sorted((n, r.inputs[0][1]) for (w, n), r in held.items()
                                                     if w == "input"))


def test_per_rank_divides_as_the_heads_are_held():
    # h key/value heads on n ranks: colwise(heads=h) gives each rank h // n heads, or 1 head
    # where n is a multiple of h, shared by n // h ranks that split its query heads.
    for n, h, heads, per_head in [(1, 2, 1, 1), (2, 2, 2, 1), (4, 2, 2, 2), (8, 2, 2, 4), (2, 8, 2, 1)]:
        assert per_rank("kv", heads=h).stages[0].divisor(n) == heads
        assert per_rank("groups", per_head=h).stages[0].divisor(n) == per_head
        assert per_rank("num_heads").stages[0].divisor(n) == n
    assert per_rank("kv", heads=2).stages[0].divisor(3) is None
    assert per_rank("b", "a", "a") == per_rank("a", "b") and repr(per_rank("b", "a")) == "per_rank('a', 'b')"


@pytest.mark.parametrize("build, message", [
    (lambda: per_rank("num-heads"), "per_rank: attribute names must be attribute paths such as 'num_heads' "
                                    "or 'config.num_attention_heads' (got 'num-heads')."),
    (lambda: per_rank(), "per_rank needs an attribute name or inputs=..., e.g. per_rank('num_heads')."),
    (lambda: per_rank("n", heads=0), "per_rank: 'heads' must be a positive int, the number of key/value "
                                     "heads (got 0 that is a <class 'int'>)."),
    (lambda: per_rank("n", heads=2, per_head=2), "per_rank(heads=2, per_head=2): an attribute counts heads "
     "or things per head, not both; give each its own per_rank(...) and compose them with >>."),
    (lambda: per_rank(inputs={"alibi": "num_heads"}), "per_rank: 'inputs' maps input names to their number "
     "of heads, e.g. inputs={'alibi': 16} (got {'alibi': 'num_heads'})."),
])
def test_bad_per_rank_arguments_are_named(build, message):
    with pytest.raises(TypeError) as info:
        build()
    assert str(info.value) == message


def test_per_rank_held_two_ways_is_a_style_error():
    with pytest.raises(StyleError, match=r"^attribute 'num_heads' is held per rank two ways, "
                                         r"per_rank\('num_heads'\) and per_rank\('num_heads', heads=2\); keep one\.$"):
        per_rank("num_heads") >> colwise() >> per_rank("num_heads", heads=2)
    assert (per_rank("num_heads") >> per_rank("num_heads")).normal.sizes == per_rank("num_heads").normal.sizes


def test_a_style_on_a_module_kind_it_cannot_handle_lists_the_kinds():
    assert problems(colwise(), nn.LayerNorm(4), "layers.0.norm") == [
        "colwise() at 'layers.0.norm' (LayerNorm): it shards nn.Linear, nn.Embedding, "
        "nn.MultiheadAttention, transformers' Conv1D, nn.Conv1d/2d/3d, nn.ConvTranspose1d/2d/3d, nn.BatchNorm1d/2d/3d and nn.GroupNorm, not LayerNorm."]
    assert problems(sequence_parallel(), nn.Linear(4, 4), "w1") == [
        "sequence_parallel() at 'w1' (Linear): sequence parallelism runs a module on each "
        "position alone, so its parameters must be 1-D (norms, dropout), but weight is not; "
        "shard it with colwise() or rowwise()."]
    assert problems(params(wieght=Shard(0)), nn.Linear(4, 4), "w1") == [
        "params(wieght=Shard(dim=0)) at 'w1' (Linear): no parameter 'wieght'; it has weight, "
        "bias (did you mean 'weight'?)."]


def test_more_input_slots_than_the_forward_takes_is_a_problem():
    assert problems(prepare_in(Shard(0), Shard(0)), nn.Linear(2, 2), "w") == [
        "prepare_in(Shard(dim=0), Shard(dim=0)) at 'w' (Linear) prepares input 1 but "
        "Linear.forward takes 1 positional input (input)."]
    assert problems(prepare_in(kwargs={"mask": Replicate()}), nn.Linear(2, 2), "w") == [
        "prepare_in(kwargs={'mask': (Replicate(), None)}) at 'w' (Linear) prepares keyword "
        "input 'mask' but Linear.forward has no such input."]
