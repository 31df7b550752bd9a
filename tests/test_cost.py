"""A step's time predicted from a dry run: the work it counts is the real run's, the arithmetic is
the model's, and a machine measured on real ranks is the same on every rank."""

import attrs
import pytest
import sympy
import torch
import torch.nn as nn

import tpfn
from tests.models import local_heads, transformer, transformer_plan
from tests.ranks import mesh
from tpfn import colwise, rowwise
from tpfn.dryrun.cost import ADAM_PASSES, SIZES, Link, Machine, Phase, StepTime, calibrate, predict
from tpfn.dryrun.work import Work, count

MLP_PLAN = {"0": colwise(), "2": rowwise()}


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))


def test_a_dry_run_counts_each_ranks_matrix_products():
    x = torch.ones(8, 16, requires_grad=True)
    report = tpfn.explain(_mlp(), MLP_PLAN, world_size=4, example_inputs=x)
    work = dict(report.work)
    # each rank: 16 of 64 hidden features; forward x @ W1.T (8x16x16) and h @ W2.T (8x16x16)
    assert work["forward"].flops == 2 * (2 * 8 * 16 * 16)
    # backward: each product's input gradient and weight gradient (x needs a gradient)
    assert work["backward"].flops == 2 * work["forward"].flops
    assert work["forward"].ops > 0 and work["forward"].bytes > 0


def _real_work(model_fn, plan, x):
    model = tpfn.parallelize(model_fn(), mesh(2), plan)
    with count() as counts:
        out = model(x)
        counts.phase = "backward"
        out.sum().backward()
    return counts.of("forward"), counts.of("backward")


def _reference():
    torch.manual_seed(0)
    return local_heads(transformer(vocab_size=64, dim=32, n_heads=4, n_layers=2, max_seq_len=16), 2)


def test_the_dry_runs_work_is_the_real_runs(ranks2):
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for build, plan, x in ((_mlp, MLP_PLAN, torch.ones(8, 16, requires_grad=True)),
                           (_reference, transformer_plan(False), tokens)):
        report = tpfn.explain(build(), plan, world_size=2, example_inputs=x)
        real = ranks2.run(_real_work, build, plan, x)
        dry = dict(report.work)
        # The CPU's attention kernel computes the scores q @ k.T again in its backward (2 layers,
        # batch 2, 2 local heads, 16 positions, head size 8), the meta device's math path does not.
        again = 2 * (2 * 2 * 2 * 16 * 16 * 8) if build is _reference else 0
        for forward, backward in real:  # (bytes and ops differ by a copy here and there: not checked)
            assert (dry["forward"].flops, dry["backward"].flops + again) == (forward.flops, backward.flops)


MACHINE = Machine(flops=1e9, bandwidth=1e8, op=1e-5,
                  links=(("all_reduce", Link(1e-4, 1e7)), ("all_gather", Link(2e-4, 5e6))))


def test_a_step_is_each_phases_work_and_collectives_at_the_machines_rates():
    report = tpfn.explain(_mlp(), MLP_PLAN, world_size=4, example_inputs=torch.ones(8, 16, requires_grad=True),
                          machine=MACHINE)
    work = dict(report.work)
    compute = lambda w: w.flops / 1e9 + w.bytes / 1e8 + w.ops * 1e-5  # noqa: E731
    # one all-reduce each way of 8 x 16 floats among 4 ranks: 6 ring steps, 768 bytes sent
    comm = 6 * 1e-4 + 768 / 1e7
    assert report.step == StepTime(Phase(compute(work["forward"]), comm), Phase(compute(work["backward"]), comm),
                                   ADAM_PASSES * report.param_bytes / 1e8)
    assert report.step == predict(report, MACHINE)
    assert predict(report, MACHINE, optimizer=False).optimizer == 0
    assert "predicted step time: forward" in str(report)
    assert report.to_dict()["step_time_s"]["total"] == pytest.approx(report.step.total)


def test_a_machine_prints_as_the_code_that_builds_it():
    assert eval(repr(MACHINE)) == MACHINE
    assert attrs.evolve(MACHINE, op=0).compute(Work(2e9, 1e8, 3)) == 3.0


def test_a_prediction_needs_numbers_and_links_for_every_collective_kind():
    b = sympy.Symbol("b", positive=True, integer=True)
    with pytest.raises(ValueError, match=r"give example_inputs at numbers \(not symbols: b\)"):
        tpfn.explain(_mlp(), MLP_PLAN, world_size=4, example_inputs=(b, 16), dtype=torch.float32, machine=MACHINE)
    with pytest.raises(ValueError, match="give example_inputs at numbers"):
        tpfn.explain(_mlp(), MLP_PLAN, world_size=4, machine=MACHINE)
    sp = tpfn.explain(_reference(), transformer_plan(True), world_size=2,
                      example_inputs=torch.zeros(2, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="no link figures for 'reduce_scatter'.*give Link"):
        predict(sp, MACHINE)


def _calibrated():
    return calibrate(mesh(2), repeats=3)


def test_a_machine_is_measured_once_and_every_rank_takes_rank_0s_figures(ranks2):
    machines = ranks2.run(_calibrated)
    assert machines[0] == machines[1]
    machine = machines[0]
    assert machine.flops > 1e8 and machine.bandwidth > 1e7 and machine.op > 0
    assert {kind for kind, _ in machine.links} == {"all_reduce", "all_gather", "reduce_scatter"}
    assert all(link.latency >= 0 and link.bandwidth > 0 for _, link in machine.links)
    for _, link in machine.links:  # each kind timed at every size, a larger one never cheaper, on these ranks
        sent = [b for b, _ in link.measured]
        took = [t for _, t in link.measured]
        assert link.ranks == 2 and len(sent) == len(SIZES) and sent == sorted(sent) and took == sorted(took)
    assert eval(repr(machine)) == machine


def test_a_measured_link_is_read_between_its_points_and_the_ring_model_elsewhere():
    link = Link(1e-4, 1e9, measured=((1e3, 2e-4), (1e6, 3e-3), (4e6, 5e-3)), ranks=2)
    assert link.seconds(2, 1e6) == 3e-3 and link.seconds(2, 2.5e6) == pytest.approx(4e-3)
    assert link.seconds(2, 5e5) == pytest.approx(2e-4 + 2.8e-3 * (5e5 - 1e3) / (1e6 - 1e3))
    assert link.seconds(2, 5e6) == pytest.approx(5e-3 + 1e6 / 1e9)  # past the last point: its bandwidth
    assert link.seconds(2, 100) == pytest.approx(2e-4 + 100 / 1e9)  # below the first: the ring model
    assert link.seconds(6, 1e6, n=4) == pytest.approx(6e-4 + 1e6 / 1e9)  # measured among 2 ranks, not 4
    machine = Machine(1e9, 1e8, 1e-5, links=(("all_reduce", link),))
    assert machine.collective("all_reduce", 2, 1e6) == 3e-3 and eval(repr(machine)) == machine
