"""The hand-written plans of ``tests/hf_plans.py`` (GPT-2, BERT, T5, OPT, BLOOM, Llama) against
one device at 2 and 4 ranks: the logits, every gradient, the parameters after one optimizer
step and the logits after it; and the collectives at the Megatron minimum. Every model runs in
one call to the session's ranks per mesh size."""

import collections

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

import tpfn
from tests import hf_plans
from tests.models import clone, full
from tests.ranks import mesh

TOL = 1e-12
"""float64 on both sides: rounding ~1e-16 relative, sums over 4 ranks in other orders."""


def _error(a, b, floor: float) -> float:
    """``||a - b|| / ||b||``, ``||b||`` at least ``floor``: a gradient that is zero on one device
    up to rounding (a key's bias, under a softmax), and such a bias after a step from zero, are
    measured against 1e-3 of the model's largest gradient or parameter."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(floor)).item()


def _counting(name: str, model):
    """CommDebugMode; for T5, whose forward CommDebugMode's module tracker cannot follow (an
    IndexError in torch 2.13 on the unparallelized model too), tpfn's own recorder."""
    return tpfn.record.record(model) if name == "t5" else CommDebugMode()


def _counts(seen) -> dict:
    if isinstance(seen, CommDebugMode):
        return tpfn.trace.counts(seen)
    return dict(collections.Counter(c.kind for c in seen))


def _one(name: str, n: int) -> dict:
    from tpfn.interpret.layouts import full_value, layouts

    ref, inputs = hf_plans.build(name)
    tp = tpfn.parallelize(clone(ref), mesh(n), hf_plans.PLANS[name])
    placed = layouts(tp)
    expected = ref(**inputs).logits
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(7), dtype=expected.dtype)
    (expected * cotangent).sum().backward()
    with _counting(name, tp) as forward:
        logits = tp(**inputs).logits
    with _counting(name, tp) as backward:
        (logits * cotangent).sum().backward()
    theirs = dict(ref.named_parameters())
    floor = 1e-3 * max(p.grad.norm().item() for p in theirs.values() if p.grad is not None)
    errors = {"logits": _error(full(logits), expected, 0.0)}
    mine = dict(tp.named_parameters())
    for key, p in mine.items():
        errors[key + ".grad"] = _error(full_value(p.grad, placed.get(key)), theirs[key].grad, floor)
    for model in (ref, tp):
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).step()
    floor = 1e-3 * max(p.norm().item() for p in theirs.values())
    for key, p in mine.items():
        errors[key] = _error(full_value(p.detach(), placed.get(key)), theirs[key].detach(), floor)
    with torch.no_grad():
        errors["logits after the step"] = _error(full(tp(**inputs).logits), ref(**inputs).logits, 0.0)
    grads = [k for k in mine if mine[k].grad is not None]
    return {"errors": errors, "forward": _counts(forward), "backward": _counts(backward),
            "grads": len(grads), "params": len(theirs)}


def _all() -> dict:
    n = dist.get_world_size()
    return {name: _one(name, n) for name in hf_plans.NAMES}


@pytest.fixture(scope="module")
def at2(ranks2):
    return ranks2.run(_all)


@pytest.fixture(scope="module")
def at4(ranks4):
    return ranks4.run(_all)


@pytest.mark.parametrize("name", hf_plans.NAMES)
def test_a_hand_written_plan_equals_one_device_at_2_and_4_ranks(name, at2, at4):
    for n, ranks in ((2, at2), (4, at4)):
        for found in ranks:
            run = found[name]
            assert max(run["errors"].values()) <= TOL, (n, {k: e for k, e in run["errors"].items() if e > TOL})
            assert run["grads"] == run["params"]   # every parameter got its gradient


@pytest.mark.parametrize("name", hf_plans.NAMES)
def test_a_hand_written_plan_communicates_the_megatron_minimum(name, at2, at4):
    for n, ranks in ((2, at2), (4, at4)):
        forward, backward = hf_plans.minimum(name, n)
        assert ranks[0][name]["forward"] == forward, (n, ranks[0][name]["forward"])
        assert ranks[0][name]["backward"] == backward, (n, ranks[0][name]["backward"])


def test_the_plans_hold_no_hook_and_patch_nothing():
    for name in hf_plans.NAMES:
        model, _ = hf_plans.build(name)
        before = {k: v for k, v in vars(model).items()}
        for fqn, style in hf_plans.PLANS[name].rules:
            assert "hook" not in repr(style)
        assert tpfn.resolve(hf_plans.PLANS[name], model)   # every rule binds something
        assert {k: v for k, v in vars(model).items()} == before


def test_the_llama_plan_is_the_one_from_hf_derives_from_transformers_own():
    model, _ = hf_plans.build("llama")
    mine, theirs = ({m.fqn: m for m in tpfn.resolve(p, model)}
                    for p in (hf_plans.PLANS["llama"], tpfn.from_hf(model.tp_plan, model)))
    assert mine.keys() == theirs.keys()
    # its embedding has a padding_idx: from_hf spells rowwise() as DTensor's own embedding
    assert mine.pop("model.embed_tokens").params == theirs.pop("model.embed_tokens").params
    assert {f: m.style for f, m in mine.items()} == {f: m.style for f, m in theirs.items()}
