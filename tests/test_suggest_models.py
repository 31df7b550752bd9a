"""tpfn.suggest on GPT-2, BERT, T5, OPT, BLOOM, a Llama and a Mixtral (its fused experts), none
of which but Llama and Mixtral declares a plan: each tiny model (``tests/suggest_zoo.py``) with the plan suggest derives, on 2 gloo
ranks and on 4, against one device: the output, every gradient, and every parameter after
one SGD step. All run in one call to the session's ranks per mesh size.

The sweep over every model type is ``python tools/suggest_sweep.py``; its table is the one in
docs/suggest.md, and the rows of these models must say what this run measures.
"""

import pathlib

import pytest

from tests import hf_zoo, suggest_zoo

MODELS = ("gpt2", "bert", "t5", "opt", "bloom", "llama", "mixtral")
DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "suggest.md"


def _steps(names: list, n: int) -> list:
    return [suggest_zoo.optimizer_step(name, n) for name in names]


@pytest.fixture(scope="module")
def two(ranks2):
    return dict(zip(MODELS, ranks2.run(_steps, list(MODELS), 2)[0]))


@pytest.fixture(scope="module")
def four(ranks4):
    return dict(zip(MODELS, ranks4.run(_steps, list(MODELS), 4)[0]))


def _worst(found: dict) -> tuple:
    return max([("output", found["output"]), *found["grads"].items(),
                *((f"{k} after the step", v) for k, v in found["stepped"].items())], key=lambda kv: kv[1])


@pytest.mark.parametrize("ranks", ["two", "four"])
def test_each_model_is_at_one_devices_numbers_after_an_optimizer_step(request, ranks):
    for name, found in request.getfixturevalue(ranks).items():
        where, error = _worst(found)
        assert error <= hf_zoo.TOLERANCE, (name, where, error)


def test_the_docs_rows_say_what_is_measured(two):
    rows = hf_zoo.rows(DOC, "suggest")
    for name, found in two.items():
        assert rows[name][1] == "yes" and rows[name][3] == f"{round(100 * found['share'])}%", name
