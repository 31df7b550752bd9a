"""``per_rank``: attributes that hold global sizes (head counts, widths, a config's head count, the
query heads per KV head) hold their per-rank values inside the module's forward, and inputs laid
out per head (ALiBi) are sliced to the rank's heads: one device's numbers, nothing patched, and
the attributes restored whatever happens."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tpfn
from tests.models import clone, counts, one_step, rel_err
from tests.ranks import mesh
from tpfn import PlanError, Replicate, colwise, per_rank, prepare_in, rowwise
from tpfn.dryrun import fake_mesh

# float64 references: rounding ~1e-16 relative; 1e-12 leaves room for sums reordered over 4 ranks.
TOL = 1e-12


class Config:
    """A config shared by every attention of a model, as transformers' is."""

    def __init__(self, heads: int, kv_heads: int | None = None):
        self.num_attention_heads, self.num_key_value_heads = heads, kv_heads or heads


class Attention(nn.Module):
    """Attention that reads global sizes from attributes, as GPT-2, OPT and BLOOM do: q, k, v
    split by ``split_size``, q viewed by ``num_heads``, k and v by the shared config's head count."""

    def __init__(self, config: Config, dim: int = 16):
        super().__init__()
        self.config, self.num_heads, self.split_size = config, config.num_attention_heads, dim
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)
        self.seen = []

    def forward(self, x):
        self.seen.append((self.num_heads, self.split_size, self.config.num_attention_heads))
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(self.split_size, dim=-1)
        q = q.view(b, t, self.num_heads, -1).transpose(1, 2)
        k, v = (y.view(b, t, self.config.num_attention_heads, -1).transpose(1, 2) for y in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Stack(nn.Module):
    """Two attentions sharing one config, the stack itself also reading it: forwards nest."""

    def __init__(self, heads: int = 4, dim: int = 16):
        super().__init__()
        self.config = Config(heads)
        self.layers = nn.ModuleList(Attention(self.config, dim) for _ in range(2))
        self.seen = []

    def forward(self, x):
        for layer in self.layers:
            self.seen.append(self.config.num_attention_heads)
            x = x + layer(x)
        return x


SIZES = per_rank("num_heads", "split_size", "config.num_attention_heads")
PLAN = {"": per_rank("config.num_attention_heads"),
        "layers.*": prepare_in(Replicate(), local=True) >> SIZES,
        "layers.*.qkv": colwise(parts=3), "layers.*.o": rowwise()}


def _stack(n: int):
    torch.manual_seed(0)
    ref = Stack(heads=4).double()
    tp = tpfn.parallelize(clone(ref), mesh(n), PLAN)
    errors, forward, backward = one_step(tp, ref, torch.randn(2, 6, 16, dtype=torch.float64))
    sizes = [(a.num_heads, a.split_size) for a in tp.layers] + [tp.config.num_attention_heads]
    return errors, forward, backward, tp.layers[0].seen, tp.seen, sizes


def test_attributes_hold_per_rank_values_in_nested_forwards_with_a_shared_config(ranks2):
    for errors, forward, backward, seen, stack_seen, after in ranks2.run(_stack, 2):
        assert max(errors.values()) <= TOL, errors
        # the Megatron minimum: one all-reduce per attention each way; per_rank moves nothing
        assert forward == {"all_reduce": 2} and backward == {"all_reduce": 2}
        assert seen == [(2, 8, 2)] and stack_seen == [2, 2]   # the rank's heads and widths
        assert after == [(4, 16), (4, 16), 4]                # restored, once each


def test_four_ranks_hold_one_head_each(ranks4):
    for errors, forward, backward, seen, _, after in ranks4.run(_stack, 4):
        assert max(errors.values()) <= TOL, errors
        assert seen == [(1, 4, 1)] and after == [(4, 16), (4, 16), 4]


class GQA(nn.Module):
    """Grouped-query attention that views by its attributes, as transformers' eager attention
    does: ``num_key_value_groups`` query heads per KV head, ``num_key_value_heads`` KV heads."""

    def __init__(self, dim=32, heads=4, kv_heads=2, head_dim=8):
        super().__init__()
        self.num_heads, self.num_key_value_heads = heads, kv_heads
        self.num_key_value_groups = heads // kv_heads
        self.q_proj = nn.Linear(dim, heads * head_dim)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim)
        self.o_proj = nn.Linear(heads * head_dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, -1).transpose(1, 2)
        k, v = (p(x).view(b, t, self.num_key_value_heads, -1).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        k, v = (y.repeat_interleave(self.num_key_value_groups, dim=1) for y in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


GQA_PLAN = {"": prepare_in(Replicate(), local=True) >> per_rank("num_heads")
            >> per_rank("num_key_value_heads", heads=2) >> per_rank("num_key_value_groups", per_head=2),
            "q_proj": colwise(), "[kv]_proj": colwise(heads=2), "o_proj": rowwise()}


def _gqa(n: int):
    torch.manual_seed(0)
    ref = GQA().double()
    tp = tpfn.parallelize(clone(ref), mesh(n), GQA_PLAN)
    return one_step(tp, ref, torch.randn(2, 6, 32, dtype=torch.float64))


def test_kv_heads_replicated_over_more_ranks_hold_their_local_ratio(ranks4):
    for errors, forward, backward in ranks4.run(_gqa, 4):
        assert max(errors.values()) <= TOL, errors
        assert forward == {"all_reduce": 1}
        # the input gradient once, and within each pair of ranks the KV heads' gradients
        assert backward == {"all_reduce": 2}


def test_kv_heads_the_ranks_divide_keep_their_ratio(ranks2):
    for errors, forward, backward in ranks2.run(_gqa, 2):
        assert max(errors.values()) <= TOL, errors
        assert forward == backward == {"all_reduce": 1}


class Alibi(nn.Module):
    """BLOOM's attention in small: scores are ``alibi.baddbmm(q, k^T)``, with ``alibi`` laid out
    per head, ``(batch * num_heads, 1, keys)``, built by the caller for every head."""

    def __init__(self, dim=16, heads=4):
        super().__init__()
        self.num_heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.dense = nn.Linear(dim, dim)

    def forward(self, x, alibi=None):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, self.num_heads, 3, -1).unbind(3)
        q, k, v = (y.transpose(1, 2).reshape(b * self.num_heads, t, -1) for y in (q, k, v))
        scores = alibi.baddbmm(q, k.transpose(1, 2), alpha=q.shape[-1] ** -0.5)
        y = torch.bmm(scores.softmax(-1), v).view(b, self.num_heads, t, -1)
        return self.dense(y.transpose(1, 2).reshape(b, t, -1))


def _slopes(batch: int, heads: int, t: int):
    slopes = 2.0 ** -torch.arange(1, heads + 1, dtype=torch.float64)
    return (slopes[:, None, None] * torch.arange(t, dtype=torch.float64)).repeat(batch, 1, 1)


def _alibi(n: int):
    torch.manual_seed(0)
    ref = Alibi().double()
    plan = {"": per_rank("num_heads", inputs={"alibi": 4}), "qkv": colwise(), "dense": rowwise()}
    tp = tpfn.parallelize(clone(ref), mesh(n), plan)
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    bias = _slopes(3, 4, 5).requires_grad_()   # a learned bias: its gradient gathered back whole
    bias2 = bias.detach().clone().requires_grad_()
    ref(x, alibi=bias).square().sum().backward()
    with torch.no_grad():
        plain = tp(x, _slopes(3, 4, 5))                        # by position, no gradient: no collective
    mine = counts(lambda: tp(x, alibi=bias2).square().sum().backward())
    errors = {"output": rel_err(plain, ref(x, alibi=bias)), "alibi.grad": rel_err(bias2.grad, bias.grad)}
    errors.update({n + ".grad": rel_err(p.grad, dict(ref.named_parameters())[n].grad)
                   for n, p in tp.named_parameters()})
    return errors, mine


def test_a_per_head_input_is_sliced_to_the_rank_s_heads_and_its_gradient_gathered(ranks2):
    for errors, mine in ranks2.run(_alibi, 2):
        assert max(errors.values()) <= TOL, errors
        # forward: dense's partial sums; backward: alibi's gradient gathered (x needs none)
        assert mine == {"all_reduce": 1, "all_gather": 1}


class Recursive(nn.Module):
    """A forward that calls itself, reading ``num_heads`` at every depth."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.seen = 8, []

    def forward(self, x, depth: int = 2):
        self.seen.append(self.num_heads)
        if depth == 3:
            raise KeyboardInterrupt
        if depth == 4:
            raise ValueError("a failing forward")
        return x if depth == 0 else self(x, depth - 1) * 2


def test_values_are_restored_after_recursion_an_exception_and_an_interrupt():
    model = tpfn.parallelize(Recursive(), fake_mesh(2), per_rank("num_heads"), src_rank=None)
    seen_by_hook = []
    model.register_forward_pre_hook(lambda m, args: seen_by_hook.append(m.num_heads))
    assert torch.equal(model(torch.ones(2)), torch.full((2,), 4.0))
    assert model.seen == [4, 4, 4] and model.num_heads == 8
    assert seen_by_hook == [8, 4, 4]   # the outer call's hooks run before its forward
    for depth, error in ((3, KeyboardInterrupt), (4, ValueError)):
        with pytest.raises(error):
            model(torch.ones(2), depth)
        assert model.num_heads == 8 and model.seen[-1] == 4


def test_an_attribute_changed_after_parallelize_is_named_not_divided_again():
    model = tpfn.parallelize(Recursive(), fake_mesh(2), per_rank("num_heads"), src_rank=None)
    model.num_heads = 6
    with pytest.raises(tpfn.errors.ModuleError, match=r"^'<root>' \(Recursive\): num_heads is 6, not the 8 "
                                                      r"whose per-rank value parallelize made 4; set it before "
                                                      r"parallelize\.$"):
        model(torch.ones(2))
    assert model.num_heads == 6 and model.seen == []


def test_what_ranks_cannot_hold_is_refused_by_name_before_anything_changes():
    model = Stack(heads=6)
    with pytest.raises(PlanError) as e:
        tpfn.parallelize(model, fake_mesh(4), PLAN, src_rank=None)
    assert ("per_rank('config.num_attention_heads') at '<root>' (Stack): config.num_attention_heads = 6 "
            "does not split evenly over the 4 ranks; choose a mesh size that divides it, or leave "
            "'config.num_attention_heads' out of per_rank.") in e.value.problems
    assert tpfn.mounted(model) is None and model.config.num_attention_heads == 6
    with pytest.raises(PlanError) as e:
        tpfn.parallelize(GQA(), fake_mesh(3), {"": per_rank("num_key_value_groups", per_head=2)})
    assert e.value.problems == [
        "per_rank('num_key_value_groups', per_head=2) at '<root>' (GQA): 3 ranks neither divide the 2 "
        "heads nor are a multiple of them; choose a mesh size that divides 2 or is a multiple of it."]
    with pytest.raises(PlanError) as e:
        tpfn.parallelize(Alibi(heads=6, dim=24), fake_mesh(4), per_rank(inputs={"alibi": 6}))
    assert e.value.problems == [
        "per_rank(inputs={'alibi': 6}) at '<root>' (Alibi): the 6 heads of input 'alibi' do not split "
        "evenly over 4 ranks; choose a mesh size that divides 6."]


def test_attributes_and_inputs_the_module_lacks_are_plan_problems():
    problems = tpfn.plans.mount.problems
    assert problems(per_rank("num_head", "config.n_heads", "seen"), Stack(), "") == [
        "per_rank('config.n_heads') at '<root>' (Stack): config (Config) has no attribute 'n_heads'.",
        "per_rank('num_head') at '<root>' (Stack): the module (Stack) has no attribute 'num_head'.",
        "per_rank('seen') at '<root>' (Stack): seen is [], not a positive int; per_rank divides counts and "
        "widths (num_heads, split_size)."]
    assert problems(per_rank("num_head"), GQA(), "attn") == [
        "per_rank('num_head') at 'attn' (GQA): the module (GQA) has no attribute 'num_head' (did you "
        "mean 'num_heads'?)."]
    assert problems(per_rank(inputs={"bias": 4}), Alibi(), "attn") == [
        "per_rank(inputs={'bias': 4}) at 'attn' (Alibi) prepares keyword input 'bias' but "
        "Alibi.forward has no such input."]


def _alibi_of_another_shape():
    tp = tpfn.parallelize(Alibi(), mesh(2), per_rank("num_heads", inputs={"alibi": 4}))
    try:
        tp(torch.randn(1, 5, 16), alibi=torch.zeros(6, 1, 5))
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)


def test_a_per_head_input_of_another_shape_is_named(ranks2):
    name, message = ranks2.run(_alibi_of_another_shape)[0]
    assert name == "LayoutError"
    assert message == (
        "input 'alibi' of '<root>' (Alibi) is laid out per head, (batch * 4, ...) in dim 0, on every rank "
        "alike (per_rank(inputs=...)), but it is shape (6, 1, 5); hand it the whole tensor, or give "
        "per_rank its number of heads.")
