"""``tpfn explain`` on the command line: the table, JSON, the HTML picture, and clear errors."""

import json
import os
import pathlib
import subprocess
import sys
import tomllib

import sympy
import torch
import torch.nn as nn

import tpfn
from tests.models import local_heads, transformer, transformer_plan
from tpfn import colwise, rowwise
from tpfn.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLAN = transformer_plan(sp=True)
MLP_PLAN = {"0": rowwise(), "1": colwise(), "3": rowwise()}


def tiny():
    """A factory the command line loads: a 2-block Transformer with heads local to 4 ranks."""
    return local_heads(transformer(vocab_size=16, max_seq_len=64), 4)


def mlp():
    """An embedding and an MLP: they run on any number of ranks."""
    return nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))


def _explain(*extra):
    """The model by ``package.module.name``, the plan by ``package.module:name``."""
    return ["explain", "tests.test_explain_cli.tiny", "tests.test_explain_cli:PLAN", *extra]


def test_prints_the_table_of_the_report(capsys):
    assert main(_explain("--world-size", "4", "--input", "4,8")) == 0
    report = tpfn.explain(tiny(), PLAN, world_size=4, example_inputs=(4, 8))
    assert capsys.readouterr().out == f"{report}\n"


def test_json_and_symbolic_sizes(capsys):
    assert main(["explain", "tests.test_explain_cli:mlp", "tests.test_explain_cli:MLP_PLAN",
                 "--world-size", "t", "--input", "b,s", "--size", "s=3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    b, s, t = sympy.symbols("b s t", positive=True, integer=True)
    report = tpfn.explain(mlp(), MLP_PLAN, world_size=t, example_inputs=(b, s), sizes={s: 3})
    assert data == report.to_dict()
    # three all-reduces of b*s*32 floats: embedding and second linear forward, first linear backward
    assert data["bytes_per_step"] == str(768 * b * s * (t - 1) / t) == "768*b*s*(t - 1)/t"


def test_html_writes_the_picture(tmp_path, capsys):
    page = tmp_path / "plan.html"
    assert main(_explain("--world-size", "4", "--input", "4,8", "--html", str(page))) == 0
    capsys.readouterr()
    report = tpfn.explain(tiny(), PLAN, world_size=4, example_inputs=(4, 8))
    assert page.read_text() == report.to_html()


def test_python_dash_m_tpfn_runs_the_same_command():
    done = subprocess.run([sys.executable, "-m", "tpfn", *_explain("--world-size", "4", "--input", "2,8",
                                                                   "--dtype", "int32")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = tpfn.explain(tiny(), PLAN, world_size=4,
                          example_inputs=torch.zeros(2, 8, dtype=torch.int32))
    assert done.stdout == f"{report}\n"


def test_the_tpfn_script_loads_from_the_working_directory():
    # The documented command, run from the repository root as a user runs it from theirs.
    script = os.path.join(os.path.dirname(sys.executable), "tpfn")
    done = subprocess.run([script, "explain", "examples.llama:Llama", "examples.llama:llama_plan",
                           "--world-size", "2", "--input", "2,64"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Megatron minimum, 2 blocks" in done.stdout and done.stdout.endswith("ratio 1.00\n")


def test_the_tpfn_script_is_the_command_line():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"tpfn": "tpfn.cli:main"}


def test_a_plan_that_cannot_work_exits_1_with_its_problems(capsys):
    assert main(["explain", "tests.models:transformer", "tests.test_explain_cli:PLAN",
                 "--world-size", "8", "--input", "2,8"]) == 1
    assert capsys.readouterr().err == (
        "tpfn explain: the plan cannot be applied (2 problems):\n"
        "  - the dry run's forward failed in 'layers.0.attention' (Attention): RuntimeError: shape "
        "'[2, 8, 4, 4]' is invalid for input of size 32\n"
        "  - 'wq', 'wk', 'wv' of 'layers.0.attention' (Attention) project 4 heads of 4 features: "
        "fewer heads than the 8 ranks, so colwise() cannot give each rank a whole head; use at "
        "most 4 ranks for tensor parallelism (and 1 more like it).\n")


def test_bad_paths_and_arguments_are_usage_errors(capsys):
    cases = {
        ("tests.test_explain_cli:nothing", "--world-size", "2"):
            "cannot load the model 'tests.test_explain_cli:nothing': module "
            "'tests.test_explain_cli' has no attribute 'nothing'",
        ("tests.models:transformer_plan", "--world-size", "2"):
            "the model 'tests.models:transformer_plan' is a function that needs arguments "
            "(missing a required argument: 'sp'); point to one that takes none, or to the value itself",
        ("tests.test_explain_cli:PLAN", "--world-size", "2"):
            "the model 'tests.test_explain_cli:PLAN' is a dict, not an nn.Module",
        ("tests.test_explain_cli:tiny", "--world-size", "4", "--input", "4,x-1"):
            "argument --input: 'x-1' is neither a size nor a name",
        ("tests.test_explain_cli:tiny", "--world-size", "4", "--dtype", "int65"):
            "argument --dtype: 'int65' is not a torch dtype (e.g. int64, float32, bfloat16)",
    }
    for args, message in cases.items():
        model, *rest = args
        try:
            main(["explain", model, "tests.test_explain_cli:PLAN", *rest])
        except SystemExit as e:
            assert e.code == 2
        assert capsys.readouterr().err.endswith(f"error: {message}\n"), args
