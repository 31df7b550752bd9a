"""The report's HTML page: every module, each slot's steps forward and backward, a picture of
each tensor, what each rank holds, the step's collectives in order, the fraction of the
parameters sharded, and a second plan beside the first. The page is read with Python's
``html.parser`` by the checks ``tools/check_report.py`` runs on the DOM Chromium builds."""

import re

import sympy
import torch
import torch.nn as nn

import tpfn
from examples.llama import Llama, llama_plan
from tests.models import local_heads, transformer, transformer_plan
from tools.check_report import Page, known, missing
from tpfn import Partial, Replicate, Shard, colwise, prepare_in, prepare_out, rowwise
from tpfn.cli import main
from tpfn.dryrun import figures
from tpfn.dryrun.picture import picture
from tpfn.dryrun.report import Comm


def _sp(**kw):
    return tpfn.explain(Llama(**kw), llama_plan(sequence_parallel_=True), world_size=2,
                        example_inputs=(2, 16))


def test_every_module_is_there_and_only_repeats_of_a_block_start_closed():
    model = Llama(layers=4)
    page = Page(tpfn.explain(model, llama_plan(True), world_size=2,
                             example_inputs=(2, 16)).to_html())
    assert {f"m-{fqn or 'root'}" for fqn, _ in model.named_modules()} <= set(page.ids)
    assert page.closed == ["m-blocks.1", "m-blocks.2", "m-blocks.3"]  # no depth hides a module
    assert "same as blocks.0" in page.texts["m-blocks.3"]
    assert "m-blocks.3.mlp.down" in page.ids and "p-blocks.3.mlp.down.weight" in page.ids
    # a block unlike the others stays open; the repeats of the second one close
    odd = {"blocks.0.mlp": prepare_in(Replicate()), "blocks.0.mlp.gate": colwise(),
           "blocks.0.mlp.up": colwise(), "blocks.0.mlp.down": rowwise()}
    assert Page(tpfn.explain(model, odd, world_size=2).to_html()).closed == ["m-blocks.2", "m-blocks.3"]


def test_a_slot_shows_the_all_reduce_its_backward_sends():
    # prepare_in(Replicate()) moves nothing forward; q, k and v's input gradients are summed in
    # its backward: the one collective the attention sends
    model = local_heads(transformer(vocab_size=16, dim=64), 2)
    report = tpfn.explain(model, transformer_plan(False), world_size=2, example_inputs=(2, 8))
    flow = figures.flows(report)[("layers.0.attention", "input 0")]
    assert flow.forward == () and len(flow.backward) == 1
    j = flow.backward[0]
    assert report.comms[j] == Comm("layers.0.attention", "backward", "all_reduce", 2 * 8 * 64, 2, 4)
    page = Page(report.to_html())
    row = page.texts["s-layers.0.attention/input_0"]
    assert "nothing moves" in row and f"#{j + 1}" in row and "all_reduce" in row
    assert "no communication" not in row and "no collective" not in row
    assert f"#c{j + 1}" in page.links["m-layers.0.attention"]
    forward = figures.flows(report)[("layers.0.attention.wo", "output 0")]
    assert [report.comms[i].kind for i in forward.forward] == ["all_reduce"]
    assert "AllReduce()" in page.texts["s-layers.0.attention.wo/output_0"]


def test_every_collective_is_a_slots_or_the_end_of_the_backwards():
    report = _sp()
    flows = figures.flows(report)
    slotted = [j for f in report.flows for j in (*f.forward, *f.backward)]
    assert sorted(slotted + figures.ending(report)) == list(range(len(report.comms)))
    for f in report.flows:
        assert all(report.comms[j].fqn == f.fqn and report.comms[j].phase == "forward" for j in f.forward)
        assert all(report.comms[j].fqn == f.fqn and report.comms[j].phase == "backward" for j in f.backward)
    attn, head = flows[("blocks.0.attn", "input 0")], flows[("head", "output 0")]
    assert [report.comms[j].kind for j in (*attn.forward, *attn.backward)] == ["all_gather", "reduce_scatter"]
    assert [report.comms[j].numel for j in head.forward] == [2 * 16 * 256] and head.backward == ()
    # q, k and v hand on the memory the attention's all-gather made: one tensor, counted once
    assert {flows[("blocks.0.attn." + p, "input 0")].storage for p in "qkv"} == {attn.storage}
    assert attn.shape == (2, 16, 64)


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, a, b):
        return self.lin(a) + b


def test_two_inputs_each_get_their_own_all_gather_with_or_without_a_gradient():
    plan = {"": prepare_in(Shard(0), Shard(0), desired=(Replicate(), Replicate()), local=True),
            "lin": colwise() >> prepare_out(Replicate())}
    for grads in ((True, False), (False, True), (False, False)):
        a, b = torch.ones(2, 4, requires_grad=grads[0]), torch.ones(2, 1, requires_grad=grads[1])
        report = tpfn.explain(Two(), plan, world_size=2, example_inputs=(a, b))
        flows = figures.flows(report)
        sizes = [[report.comms[j].numel for j in flows[("", f"input {i}")].forward] for i in (0, 1)]
        assert sizes == [[4 * 4], [4 * 1]], grads  # each rank's 2 rows of a, then of b


def test_pictures_show_which_rank_holds_which_block():
    uneven = picture((10, 4), Shard(0), 4)
    assert re.findall(r"<title>(rank \d: rows [^<]*)</title>", uneven) == [
        "rank 0: rows 0-2 of 10", "rank 1: rows 3-5 of 10", "rank 2: rows 6-8 of 10",
        "rank 3: rows 9-9 of 10"]
    heights = [float(h) for h in re.findall(r'class="block"[^>]*height="([\d.]+)"', uneven)]
    assert [round(h / heights[3]) for h in heights] == [3, 3, 3, 1]  # to scale
    assert "ranks 0-2: (3, 4), rank 3: (1, 4)" in uneven
    packed = picture((4, 8), Shard(1, parts=2), 2)  # each part cut over the ranks
    assert re.findall(r"<title>rank (\d): columns [^<]*\(part (\d)\)</title>", packed) == [
        ("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")]
    assert packed.count("<line") == 1  # the border between the parts
    heads = picture((16, 4), Shard(0, heads=2), 4)  # each head held by a group of two ranks
    assert re.findall(r"<title>([^<]*)</title>", heads) == ["ranks 0-1: rows 0-7 of 16",
                                                            "ranks 2-3: rows 8-15 of 16"]
    assert picture((4, 8), Replicate(), 2).count('class="block"') == 1
    assert "every rank" in picture((4, 8), Replicate(), 2)
    partial = picture((4, 8), Partial(), 8)
    assert partial.count('class="block"') == 4 and "sum of 8 terms" in partial
    assert 'stroke-dasharray' in picture((4,), None, 2)  # a plain tensor: dashed


def test_the_page_draws_every_parameter_and_every_slot_tensor():
    report = _sp(layers=3)
    page = Page(report.to_html())
    drawn = set(page.tensors)
    assert {"embed.weight", "blocks.0.attn.q.weight", "norm.weight", "blocks.0.attn input 0",
            "head output 0"} <= drawn
    assert not any(t.startswith("blocks.1.") for t in drawn)  # a repeat points to blocks.0's
    assert "pictures: as in blocks.0.attn.q" in page.texts["p-blocks.2.attn.q.weight"]
    assert missing(report.to_html(), report) == []


def test_what_each_rank_holds_parameters_and_activations():
    report = tpfn.explain(nn.Embedding(10, 4), rowwise(), world_size=4, example_inputs=(2, 3))
    # 10 rows on 4 ranks: 3, 3, 3, 1 of 4 floats; the ids (2, 3) and the summed (2, 3, 4) floats
    assert figures.held(report) == [(0, 2, 3 * 16, 48 + 96), (3, 3, 16, 48 + 96)]
    ranks = Page(report.to_html()).texts["ranks"]
    assert "ranks 0-2" in ranks and "rank 3" in ranks and "activations at the slots" in ranks


def test_what_autograd_saves_for_the_backward_is_measured():
    mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    x = torch.ones(8, 16, requires_grad=True)
    # the first linear keeps its input (8, 16), ReLU its output, which the second linear keeps
    # too: 16 of its 64 features on each of 4 ranks; whole without a plan
    sharded = tpfn.explain(mlp, {"0": colwise(), "2": rowwise()}, world_size=4, example_inputs=x)
    whole = tpfn.explain(mlp, {}, world_size=4, example_inputs=x)
    assert (sharded.kept, whole.kept) == (8 * 16 * 4 + 8 * 16 * 4, 8 * 16 * 4 + 8 * 64 * 4)
    megatron = tpfn.explain(Llama(), llama_plan(), world_size=2, example_inputs=(2, 16))
    assert _sp().kept < megatron.kept  # sequence parallelism keeps less
    assert tpfn.explain(mlp, {}, world_size=4).kept is None  # nothing ran
    page = Page(sharded.to_html())
    assert "Saved for the backward on rank 0: 1.0 KiB" in page.texts["kept"]


def test_the_timeline_holds_the_steps_collectives_in_order():
    report = _sp()
    page = Page(report.to_html())
    rows = [i for i in page.ids if re.fullmatch(r"c\d+", i)]
    assert rows == [f"c{j}" for j in range(1, 23)]
    phases = [page.texts[r].split()[1] for r in rows]
    assert phases == ["forward"] * 11 + ["backward"] * 11
    assert page.texts["c1"].split()[:5] == ["1", "forward", "embed", "output", "0"]
    assert "(end of the backward)" in page.texts["c22"] and "norm.weight" in page.texts["c22"]
    assert "all_reduce" in page.texts["c22"] and "1.2 KiB" in page.texts["c22"]
    timeline = page.texts["timeline"]
    assert "forward: 11 collectives, 56.0 KiB" in timeline
    assert "backward: 11 collectives, 41.2 KiB" in timeline
    # the sequence-parallel norms' bucketed all-reduce, in the norms' rows too
    assert "#c22" in page.links["m-blocks.0.attn_norm"] and "#c22" in page.links["m-end"]
    assert "its share 256 B" in page.texts["p-blocks.0.attn_norm.weight"]  # 64 of its 320 floats


def test_gpt_oss_own_plan_says_it_shards_only_the_embedding_and_the_head():
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_local_experts=4, num_experts_per_tok=2)
    model = GptOssForCausalLM(config).to(torch.bfloat16)
    report = tpfn.explain(model, tpfn.from_hf(model.tp_plan, model), world_size=2,
                          example_inputs={"input_ids": (2, 8), "use_cache": True})
    shares = figures.sharded(report)
    total = sum(p.numel() for p in model.parameters()) * 2
    embed = sum(m.weight.numel() for m in (model.model.embed_tokens, model.lm_head)) * 2
    assert (shares.tensors, shares.of_tensors) == (2, len(list(model.parameters())))
    assert (shares.bytes, shares.of_bytes) == (embed, total)
    page = Page(report.to_html())
    share = f"{100 * embed / total:.1f}%"
    assert share in page.texts["cards"] and share in page.texts["sharded"]
    assert "model.layers.*.mlp.experts.gate_up_proj" in page.texts["whole"]


def test_a_second_plan_side_by_side():
    report = _sp()
    none = tpfn.explain(Llama(), {}, world_size=2, example_inputs=(2, 16))
    page = Page(report.to_html(none, name="sequence parallel", baseline_name="no TP"))
    text = page.texts["compare"]
    assert "sequence parallel against no TP" in text
    totals = page.texts["compare-totals"]
    assert f"+{tpfn.dryrun.units.fmt_bytes(report.bytes)}" in totals  # no TP sends nothing
    assert "99.7%" in totals and "0.0%" in totals
    modules = page.texts["compare-modules"]
    assert "blocks.*.attn ×2" in modules and "(end of the backward)" in modules
    assert "compare" not in Page(report.to_html()).ids
    baseline = known()[1]  # PyTorch's Megatron plan: 11 all-reduces in the backward
    section = Page(report.to_html(baseline)).texts["compare-totals"]
    assert "11 all_reduce" in section and "5 reduce_scatter, 5 all_gather, 1 all_reduce" in section


def test_the_command_line_sets_a_baseline_plan_beside_the_plan(tmp_path, capsys):
    out = tmp_path / "plan.html"
    args = ["explain", "examples.llama:Llama", "examples.llama:llama_plan", "--world-size", "2",
            "--input", "2,16"]
    assert main([*args, "--html", str(out), "--baseline", "builtins:dict"]) == 0
    capsys.readouterr()
    report = tpfn.explain(Llama(), llama_plan(), world_size=2, example_inputs=(2, 16))
    none = tpfn.explain(Llama(), {}, world_size=2, example_inputs=(2, 16))
    assert out.read_text() == report.to_html(none, name="examples.llama:llama_plan",
                                             baseline_name="builtins:dict")
    try:
        main([*args, "--baseline", "builtins:dict"])
    except SystemExit as e:
        assert e.code == 2
    assert "--baseline sets two plans side by side in the HTML page: give --html FILE too" in \
        capsys.readouterr().err


def test_the_browser_checks_find_every_part_and_miss_a_missing_one():
    report, baseline = known()
    page = report.to_html(baseline, name="a", baseline_name="b")
    assert missing(page, report, baseline, ("a", "b")) == []
    cut = re.sub(r'<section id="timeline">.*?</section>', "", page, flags=re.S)
    assert "the timeline's 22 collectives in order (found 0)" in missing(cut, report, baseline, ("a", "b"))
    assert "module 'blocks.1.attn'" in missing(page.replace('id="m-blocks.1.attn"', ""), report)


def test_symbolic_sizes_give_the_slots_shapes_as_formulas():
    b, s = sympy.symbols("b s", positive=True, integer=True)
    report = tpfn.explain(Llama(), llama_plan(True), world_size=2, example_inputs=(b, s))
    assert figures.flows(report)[("head", "output 0")].shape == (b, s, 256)
    (first, last, params, activations), = figures.held(report)
    assert (first, last, params) == (0, 1, report.param_bytes)
    assert sympy.simplify(activations / (b * s)).is_number  # tokens times a constant
    ranks = Page(report.to_html()).texts["ranks"]
    assert f"ranks 0-1 {tpfn.dryrun.units.fmt_bytes(params)} {activations}" in ranks
