"""``tpfn.verify``: a plan run on forked gloo ranks, every output and gradient against one device."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import pytest

import tpfn
from tpfn import PlanError, Replicate, colwise, prepare_in, prepare_out, rowwise
from tpfn.cli import main


class Heads(nn.Module):
    """Attention over q, k, v projections that views its heads as (n_head, -1)."""

    def __init__(self, dim=16, n_head=4):
        super().__init__()
        self.n_head = n_head
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.n_head, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = torch.softmax(q @ k.transpose(-2, -1) / 2.0, dim=-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class FusedGQA(nn.Module):
    """Grouped-query attention with one fused [q | k | v] projection; KV head h % n_kv serves
    query head h, and the widths are read from the (local) output."""

    def __init__(self, dim=16, n_head=4, n_kv=2):
        super().__init__()
        self.head_dim, self.group = dim // n_head, n_head // n_kv
        self.qkv = nn.Linear(dim, (n_head + 2 * n_kv) * self.head_dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, _ = x.shape
        qkv = self.qkv(x)
        w = qkv.shape[-1] // (self.group + 2)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2)
                   for t in qkv.split([self.group * w, w, w], dim=-1))
        k, v = k.repeat(1, self.group, 1, 1), v.repeat(1, self.group, 1, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Tiny(nn.Module):
    """Embedding, one attention block with an MLP, a head."""

    def __init__(self, attention, vocab=32, dim=16):
        super().__init__()
        self.wte, self.norm, self.attn = nn.Embedding(vocab, dim), nn.LayerNorm(dim), attention
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.wte(ids)
        x = x + self.attn(self.norm(x))
        return self.head(x + self.mlp(x))


def heads():
    torch.manual_seed(0)
    return Tiny(Heads())


def fused():
    torch.manual_seed(0)
    return Tiny(FusedGQA())


REST = {"wte": rowwise(), "mlp.0": colwise(), "mlp.2": rowwise(),
        "head": colwise() >> prepare_out(Replicate())}
HEADS = {**REST, "attn": prepare_in(Replicate()), "attn.[qkv]": colwise(), "attn.o": rowwise()}
HEADS_FIXED = {**HEADS, "attn.[qkv]": colwise(local=False)}
FUSED = {**REST, "attn": prepare_in(Replicate()), "attn.qkv": colwise(), "attn.o": rowwise()}
# n_head // n_kv + 2 parts of n_kv heads: each rank holds its share of q, k and v, and its
# queries' output features come in 2 parts (the two groups of queries)
FUSED_FIXED = {**FUSED, "attn.qkv": colwise(parts=4), "attn.o": rowwise(parts=2)}


def test_heads_viewed_with_the_global_count_are_caught_and_named():
    report = tpfn.verify(heads(), HEADS, (2, 6))
    print(report)
    assert not report.ok and report.culprit == "attn"
    assert report.hint.startswith(
        "'attn' (Heads) (prepare_in(Replicate())) computes other numbers than one device (its output's "
        "relative error ")
    line = f"tests/test_verify.py:{Heads.forward.__code__.co_firstlineno + 2}"
    assert f"tpfn.check names the op: aten.view.default ({line}): views its shard as (2, 6, 4, 2) by " \
        "self.n_head = 4 that is the global one" in report.hint
    assert "hold the count per rank with per_rank('n_head')" in report.hint
    assert "attn (Heads)" in str(report) and "<- diverges here" in str(report)


def test_a_fused_gqa_projection_under_plain_colwise_is_caught_and_named():
    report = tpfn.verify(fused(), FUSED, (2, 6))
    print(report)
    assert not report.ok and report.culprit == "attn"
    assert "aten.split_with_sizes.default" in report.hint and "colwise(parts=(16, 8, 8))" in report.hint


@pytest.mark.parametrize("make, plan", [(heads, HEADS_FIXED), (fused, FUSED_FIXED)])
def test_the_correct_plans_pass(make, plan):
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = tpfn.verify(model, plan, (2, 6))
    print(report)
    assert report.ok and report.culprit is None and report.failure is None, str(report)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_plan_that_cannot_apply_raises_the_plan_error_of_parallelize():
    plan = {**HEADS_FIXED, "attn.qvk": colwise()}
    with pytest.raises(PlanError) as found:
        tpfn.verify(heads(), plan, (2, 6))
    with pytest.raises(PlanError) as expected:
        tpfn.resolve(plan, heads())
    assert found.value.problems == expected.value.problems
    assert "'attn.qvk'" in str(found.value)


class Picky(nn.Module):
    """Raises on the rank that holds 3 features (rank 1 of 7 features over 2 ranks)."""

    def forward(self, x):
        if x.shape[-1] == 3:
            raise ValueError("three features are not enough")
        return x


def test_a_rank_that_raises_is_reported_with_its_rank_and_module():
    model = nn.Sequential(nn.Linear(4, 7), Picky(), nn.Linear(7, 4))
    report = tpfn.verify(model, {"0": colwise(), "2": rowwise()}, (3, 4), dtype=torch.float32)
    assert not report.ok and report.checks == ()
    assert report.failure == ("rank 1: the forward failed in '1' (Picky): ValueError: three "
                              "features are not enough")
    assert "raise ValueError" in report.trace
    assert report.text(None).splitlines()[1] == f"FAILED: {report.failure}"  # (str: wrapped at 80)


class Stuck(nn.Module):
    def forward(self, x):
        if x.shape[-1] == 3:
            import time
            time.sleep(60)
        return x


def test_a_rank_that_hangs_is_stopped_and_reported():
    model = nn.Sequential(nn.Linear(4, 7), Stuck(), nn.Linear(7, 4))
    report = tpfn.verify(model, {"0": colwise(), "2": rowwise()}, (3, 4), dtype=torch.float32,
                         timeout=3)
    assert report.failure == ("ranks 0, 1 did not finish within 3s (a collective that some rank "
                              "never joined?); they were stopped")


def test_sequence_parallel_inputs_are_sharded_as_the_root_declares():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    plan = {"": prepare_in(tpfn.Shard(1)), "0": tpfn.sequence_parallel(),
            "1": prepare_in(tpfn.Shard(1), desired=Replicate()) >> colwise(),
            "3": rowwise() >> prepare_out(tpfn.Shard(1))}
    report = tpfn.verify(model, plan, (2, 6, 8), dtype=torch.float32)
    assert report.ok, str(report)


def test_the_command_line_exits_0_when_the_numbers_agree_and_1_when_not(capsys):
    ok = ["verify", "tests.test_verify:heads", "tests.test_verify:HEADS_FIXED", "--input", "2,6"]
    assert main([*ok, "--world-size", "2"]) == 0
    assert capsys.readouterr().out == f"{tpfn.verify(heads(), HEADS_FIXED, (2, 6))}\n"
    wrong = ["verify", "tests.test_verify:fused", "tests.test_verify:FUSED", "--input", "2,6"]
    assert main(wrong) == 1
    out = capsys.readouterr().out
    assert out == f"{tpfn.verify(fused(), FUSED, (2, 6))}\n" and "<- diverges here" in out


BROKEN = {"attn.qvk": colwise()}


def test_the_command_line_exits_1_with_the_problems_of_a_plan_that_cannot_apply(capsys):
    assert main(["verify", "tests.test_verify:heads", "tests.test_verify:BROKEN",
                 "--input", "2,6"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("tpfn verify: ") and "'attn.qvk'" in captured.err


def test_the_report_fits_80_columns_and_says_each_repeated_block_once(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["verify", "examples.llama:Llama", "examples.llama:llama_plan", "--input", "2,16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 80 and lines[2] == "ok: every output and parameter gradient agrees with one device"
    rows = [line for line in lines if line.startswith("blocks.")]
    assert rows[0].startswith("blocks.* (Block) x2") and len(rows) == 12  # the block and its 11 modules, once
    assert any(line.startswith("blocks.*.attn.o") for line in rows)
    report = tpfn.verify(fused(), FUSED, (2, 6))  # the culprit keeps its own line
    assert [line for line in str(report).splitlines() if "<- diverges here" in line][0].startswith("attn (FusedGQA)")


def test_a_padding_embedding_row_wise_is_verified():
    """DTensor hands back the row-sharded weight's gradient replicated: assembled by its own layout."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 8, padding_idx=0), nn.Linear(8, 8))
    report = tpfn.verify(model, {"0": rowwise()}, (2, 5))
    assert report.ok and report.failure is None, str(report)


class Half(nn.Module):
    def forward(self, x):
        return x * 0.5


class Outside(nn.Module):
    """A row-wise output left a partial sum, halved by a module outside the plan, summed at the end."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.scale = nn.Linear(16, 64), nn.Linear(64, 16, bias=False), Half()

    def forward(self, x):
        return self.scale(self.down(torch.relu(self.up(x))))


def test_a_partial_sum_through_a_module_outside_the_plan_is_compared_as_a_sum():
    torch.manual_seed(0)
    plan = {"": prepare_out(Replicate(), given=tpfn.Partial()), "up": colwise(),
            "down": rowwise() >> prepare_out(tpfn.Partial())}
    report = tpfn.verify(Outside(), plan, torch.randn(2, 6, 16))
    assert report.ok and report.culprit is None, str(report)
    assert max(c.output for c in report.checks if c.output is not None) < 1e-5


def test_a_nonlinear_op_of_a_partial_sum_is_named_by_its_op():
    torch.manual_seed(0)
    model = Outside()
    model.scale = nn.ReLU()
    plan = {"up": colwise(), "down": rowwise() >> prepare_out(tpfn.Partial())}
    report = tpfn.verify(model, plan, torch.randn(2, 6, 16))
    assert not report.ok and report.culprit == "scale"
    assert report.hint.startswith("'scale' (ReLU) computes other numbers than one device (its output's "
                                  "relative error ")
    assert ("tpfn.check names the op: aten.relu.default (tests/test_verify.py:" in report.hint
            and "relu of a partial sum (output 0 of 'down')" in report.hint)
