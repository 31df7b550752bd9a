"""``tpfn explain`` on the command line: the table, JSON, the HTML picture, and clear errors."""

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import tomllib
import traceback

import pytest

import sympy
import torch
import torch.nn as nn

import tpfn
from tests.models import local_heads, transformer, transformer_plan
from tpfn import PlanError, colwise, rowwise
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


class Scaled(nn.Module):
    """Two inputs with names: the features and a scale."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)

    def forward(self, x, scale):
        return self.down(self.up(x)) * scale


class Unnamed(nn.Module):
    """A forward that names none of its positional inputs."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 32)

    def forward(self, *xs, scale=None):
        return self.up(xs[0])


SUB_PLAN = {"up": colwise(), "down": rowwise()}
ENV = {**os.environ, "COLUMNS": "80"}


@pytest.fixture(autouse=True)
def _columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # the terminal of every test: 80 columns


def _explain(*extra):
    """The model by ``package.module.name``, the plan by ``package.module:name``."""
    return ["explain", "tests.test_explain_cli.tiny", "tests.test_explain_cli:PLAN", *extra]


def test_prints_the_table_of_the_report(capsys):
    assert main(_explain("--world-size", "4", "--input", "4,8")) == 0
    report = tpfn.explain(tiny(), PLAN, world_size=4, example_inputs=(4, 8))
    assert capsys.readouterr().out == f"{report}\n" == f"{report.text(80)}\n"


def _llama(*extra) -> None:
    assert main(["explain", "examples.llama:Llama", "examples.llama:llama_plan", "--world-size", "2",
                 "--input", "1,256", *extra]) == 0


def test_the_default_table_fits_the_terminal(capsys, monkeypatch):
    _llama()
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 80 and len(lines) < 45
    assert lines[2].split() == ["module", "style", "forward", "backward"]
    assert lines[3:5] == ["embed (Embedding)      rowwise()                      1 all_reduce  -",
                          "                         >> prepare_out(Replicate())    64.0 KiB"]
    assert not any(line.lstrip().startswith(("weight", "input 0")) for line in lines)  # --wide's
    for columns in ("60", "132"):
        monkeypatch.setenv("COLUMNS", columns)
        _llama()
        lines = capsys.readouterr().out.splitlines()
        assert max(map(len, lines)) <= int(columns)
    assert "blocks.*.attn.o (Linear) x2" in lines[8] and "rowwise() >> prepare_out(Replicate())" in lines[8]
    _llama("--width", "100")  # --width over the terminal's
    assert max(map(len, capsys.readouterr().out.splitlines())) == 100


def test_wide_prints_every_parameter_and_slot(capsys):
    _llama("--wide")
    out = capsys.readouterr().out
    from examples.llama import Llama, llama_plan
    report = tpfn.explain(Llama(), llama_plan(), world_size=2, example_inputs=(1, 256))
    assert out == f"{report.text(width=None, wide=True)}\n" and max(map(len, out.splitlines())) > 150
    assert "  weight                       Shard(dim=0)     " in out
    _llama("--wide", "--width", "80")
    assert max(map(len, capsys.readouterr().out.splitlines())) <= 80
    _llama("--width", "0")  # no limit: one line per module
    assert f"{capsys.readouterr().out}" == f"{report.text(width=None)}\n"


def test_the_compact_table_in_full():
    """The wide form in full: tests/test_explain.py."""
    mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    report = tpfn.explain(mlp, {"0": colwise(), "2": rowwise()}, world_size=4,
                          example_inputs=torch.randn(8, 16, requires_grad=True))
    assert str(report) == report.text() == """\
tpfn.explain on 4 ranks: one forward and backward of input 0 (8, 16) float32

module      style      forward             backward
0 (Linear)  colwise()  -                   1 all_reduce 768 B
2 (Linear)  rowwise()  1 all_reduce 768 B  -

collectives per step: forward 1 all_reduce; backward 1 all_reduce;
  total 2 all_reduce
bytes per rank per step: forward 768 B; backward 768 B; total 1,536 B (1.5 KiB)
overlapping weight gradients: 1 of 1 backward collectives
parameter bytes per rank: 2,176 B (2.1 KiB)"""
    for width in (0, 39, 80.0, True):
        with pytest.raises(ValueError, match="'width' must be None \\(no limit\\) or at least 40 "):
            report.text(width)


def test_keyword_inputs_and_their_dtypes(capsys):
    base = ["tests.test_explain_cli:Scaled", "tests.test_explain_cli:SUB_PLAN", "--world-size", "2"]
    assert main(["explain", *base, "--input", "x=2,8,32:float32", "--input", "scale=1:float32",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"] == [{"name": "x", "shape": [2, 8, 32], "dtype": "float32"},
                              {"name": "scale", "shape": [1], "dtype": "float32"}]
    assert data["collectives"]["total"] == {"all_reduce": 1}  # down's output; no input gradient
    # positional then keyword: the positional ones take the names of Scaled.forward
    assert main(["explain", *base, "--input", "2,8,32", "--input", "scale=1", "--dtype", "float32",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"] == data["inputs"]


def test_mixed_inputs_the_forward_cannot_name_and_names_given_twice_are_usage_errors(capsys):
    cases = {
        ("tests.test_explain_cli:Unnamed", "2,32", "scale=1"):
            "Unnamed.forward(self, *xs, scale=None) gives its positional inputs no names (xs), and "
            "explain takes positional inputs (a tuple) or keyword inputs (a dict), not both: name "
            "every input (--input NAME=SHAPE) or none",
        ("tests.test_explain_cli:Scaled", "2,32", "x=2,32"):
            "the positional and keyword inputs do not fit Scaled.forward(self, x, scale) (multiple "
            "values for argument 'x'); name every input (--input NAME=SHAPE) or none",
        ("tests.test_explain_cli:Scaled", "x=2,32", "x=4,32"): "--input x= is given twice",
        ("tests.test_explain_cli:Scaled", "x=2,32:int64:grad", "scale=1"):
            "--input x=2,32:grad needs a floating dtype, not int64: give one, e.g. 2,32:float32:grad",
        ("tests.test_explain_cli:Scaled", "x=2,32:grad:float32", "scale=1"):
            "argument --input: 'x=2,32:grad:float32' is not [NAME=]SHAPE[:DTYPE][:grad] (e.g. "
            "8,16:float32:grad)",
        ("tests.test_explain_cli:Scaled", "1x=2,32", "scale=1"):
            "argument --input: '1x' is not an input's name (NAME=SHAPE, e.g. input_ids=1,256)",
        ("tests.test_explain_cli:Scaled", "x=2,32:float33", "scale=1"):
            "argument --input: 'float33' is not a torch dtype (e.g. int64, float32, bfloat16)",
    }
    for (model, *inputs), message in cases.items():
        with pytest.raises(SystemExit) as e:
            main(["explain", model, "tests.test_explain_cli:SUB_PLAN", "--world-size", "2",
                  *(a for x in inputs for a in ("--input", x))])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: tpfn explain ") and err.endswith(
            f"tpfn explain: error: {message}\n"), (inputs, err)


def test_an_input_that_needs_a_gradient_shows_its_collectives(capsys):
    base = ["explain", "tests.test_explain_cli:Scaled", "tests.test_explain_cli:SUB_PLAN",
            "--world-size", "2", "--input", "scale=1:float32", "--json", "--input"]
    assert main([*base, "x=2,8,32:float32:grad"]) == 0
    data = json.loads(capsys.readouterr().out)
    up = next(m for m in data["modules"] if m["fqn"] == "up")
    assert up["backward"] == {"all_reduce": {"count": 1, "bytes": 2048}}  # x's gradient, 2*8*32 floats
    assert data["collectives"]["backward"] == {"all_reduce": 1}
    assert main([*base, "x=b,8,32:bfloat16:grad"]) == 0  # symbolic, with its own dtype
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"][1] == {"name": "x", "shape": ["b", 8, 32], "dtype": "bfloat16"}
    assert data["collectives"]["backward"] == {"all_reduce": 1}


def test_models_and_plans_from_files(tmp_path, capsys):
    (tmp_path / "helper.py").write_text("WIDTH = 32\n")
    (tmp_path / "net.py").write_text(textwrap.dedent("""\
        import torch.nn as nn
        from helper import WIDTH          # its folder is importable, as under `python net.py`
        from tpfn import colwise, rowwise

        class Net(nn.Sequential):
            def __init__(self):
                super().__init__(nn.Linear(WIDTH, 64), nn.Linear(64, WIDTH))

        PLAN = {"0": colwise(), "1": rowwise()}
        """))
    (tmp_path / "broken.py").write_text("def oops(:\n")
    net = str(tmp_path / "net.py")
    assert main(["explain", f"{net}:Net", f"{net}:PLAN", "--world-size", "2", "--input",
                 "4,32:float32"]) == 0
    assert "0 (Linear)  colwise()" in capsys.readouterr().out
    cases = {
        (f"{tmp_path}/none.py:Net",): f"cannot load the model '{tmp_path}/none.py:Net': there is "
                                      f"no file '{tmp_path}/none.py' (in {os.getcwd()})",
        (net,): f"cannot load the model '{net}': name the object in the file, {net}:NAME",
        (f"{net}:Nothing",): f"cannot load the model '{net}:Nothing': module 'net' has no "
                             "attribute 'Nothing'",
        (f"{tmp_path}/broken.py:Net",):
            f"cannot load the model '{tmp_path}/broken.py:Net': SyntaxError: invalid syntax "
            "(broken.py, line 1) (rerun with --traceback to see where)",
    }
    for (model,), message in cases.items():
        with pytest.raises(SystemExit):
            main(["explain", model, f"{net}:PLAN", "--world-size", "2"])
        assert capsys.readouterr().err.endswith(f"tpfn explain: error: {message}\n"), model


def test_traceback_shows_the_line_that_failed(tmp_path, capsys):
    (tmp_path / "bad.py").write_text(textwrap.dedent("""\
        import torch.nn as nn

        class Bad(nn.Linear):
            def __init__(self):
                super().__init__(8, 8)

            def forward(self, x):
                return x.view(3, -1) @ self.weight   # the user's failing line

        def factory():
            raise RuntimeError("no such checkpoint")
        """))
    bad = str(tmp_path / "bad.py")
    args = ["explain", f"{bad}:Bad", "tpfn:colwise", "--world-size", "2", "--input", "2,8:float32"]
    assert main(args) == 1
    assert capsys.readouterr().err.startswith("tpfn explain: the plan cannot be applied")
    with pytest.raises(PlanError) as e:
        main([*args, "--traceback"])
    text = "".join(traceback.format_exception(e.value))
    assert f'File "{bad}", line 8, in forward' in text and "# the user's failing line" in text
    with pytest.raises(SystemExit):  # a factory that raises: one line, or its traceback
        main(["explain", f"{bad}:factory", "tpfn:colwise", "--world-size", "2"])
    assert capsys.readouterr().err.endswith(
        f"error: calling the model '{bad}:factory' raised RuntimeError: no such checkpoint "
        "(rerun with --traceback to see where)\n")
    with pytest.raises(RuntimeError, match="no such checkpoint") as e:
        main(["explain", f"{bad}:factory", "tpfn:colwise", "--world-size", "2", "--traceback"])
    assert f'File "{bad}", line 11, in factory' in "".join(traceback.format_exception(e.value))


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"tpfn {tpfn.__version__}\n"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert tpfn.__version__ == project["version"]
    for command in ([], ["explain"], ["verify"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        out = capsys.readouterr().out
        assert "``" not in out and out.startswith(f"usage: {' '.join(['tpfn', *command])} ")
    assert "--input SHAPE:DTYPE:grad   an input that needs a gradient" in out


def test_the_package_ships_its_subpackages_and_types():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["setuptools"]["packages"] == {"find": {"include": ["tpfn*"]}}
    assert config["tool"]["setuptools"]["package-data"] == {"tpfn": ["py.typed"]}
    assert (ROOT / "tpfn" / "py.typed").is_file()
    subpackages = {p.parent.name for p in (ROOT / "tpfn").glob("*/__init__.py")}
    assert subpackages == {"adapters", "analysis", "dryrun", "interpret", "kernels", "plans", "style", "suggest",
                           "training"}
    project = config["project"]
    assert "torch>=2.13,<2.15" in project["dependencies"]  # private torch APIs: checked on 2.13, 2.14
    assert "urls" not in project and "Typing :: Typed" in project["classifiers"]


def test_verify_takes_keyword_inputs_with_dtypes(capsys):
    assert main(["verify", "tests.test_explain_cli:Scaled", "tests.test_explain_cli:SUB_PLAN",
                 "--input", "x=2,4,32:float32:grad", "--input", "scale=1:float32"]) == 0
    out = capsys.readouterr().out
    assert "'x' (2, 4, 32) float32" in out, out


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
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode == 0, done.stderr
    report = tpfn.explain(tiny(), PLAN, world_size=4,
                          example_inputs=torch.zeros(2, 8, dtype=torch.int32))
    assert done.stdout == f"{report}\n"


def test_the_tpfn_script_loads_from_the_working_directory():
    # The documented command, run from the repository root as a user runs it from theirs.
    script = os.path.join(os.path.dirname(sys.executable), "tpfn")
    done = subprocess.run([script, "explain", "examples.llama:Llama", "examples.llama:llama_plan",
                           "--world-size", "2", "--input", "2,64"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode == 0, done.stderr
    assert "Megatron minimum, 2 blocks" in done.stdout and done.stdout.endswith("ratio 1.00\n")


def test_the_tpfn_script_is_the_command_line():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"tpfn": "tpfn.cli:main"}


def test_a_plan_that_cannot_work_exits_1_with_its_problems(capsys):
    assert main(["explain", "tests.models:transformer", "tests.test_explain_cli:PLAN",
                 "--world-size", "8", "--input", "2,8"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert max(map(len, lines)) <= 80  # the list wraps to the terminal, between words
    assert lines[0] == "tpfn explain: the plan cannot be applied (1 problem):"
    problems = []
    for line in lines[1:]:
        if line.startswith("  - "):
            problems.append(line[4:])
        else:
            assert line.startswith("    ")
            problems[-1] += " " + line[4:]
    assert problems == [
        "'wq', 'wk', 'wv' of 'layers.0.attention' (Attention) project 4 heads of 4 features: "
        "fewer heads than the 8 ranks, so colwise() cannot give each rank a whole head; use at "
        "most 4 ranks for tensor parallelism (and 1 more like it)."]


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
        err = capsys.readouterr().err
        assert err.startswith("usage: tpfn explain [-h]"), err  # explain's own usage, not tpfn's
        assert err.endswith(f"tpfn explain: error: {message}\n"), args


def test_a_warning_that_the_numbers_would_be_wrong_exits_1_and_a_note_of_a_cost_0(capsys):
    # the global head count held where each rank has half the heads (nothing runs without --input)
    assert main(["explain", "tests.models:transformer", "tests.test_explain_cli:PLAN",
                 "--world-size", "2"]) == 1
    out = capsys.readouterr().out
    assert "\nwarnings (the numbers would be wrong):\n  - 'layers.0.attention' (Attention) holds n_heads = 4" in out
    assert "notes:" not in out
    report = tpfn.explain(transformer(), PLAN, world_size=2)
    assert report.lints == report.warnings and report.notes == ()
    assert report.to_dict()["warnings"] == list(report.warnings)
    assert main(["explain", "tests.test_explain_cli.mlp", "tests.test_explain_cli:MLP_PLAN",
                 "--world-size", "3"]) == 0  # uneven over 3 ranks: works, at a cost
    out = capsys.readouterr().out
    assert "\nnotes:\n  - '0.weight' Shard(dim=0) is uneven over 3 ranks" in out and "warnings" not in out
    report = tpfn.explain(mlp(), MLP_PLAN, world_size=3)
    assert report.warnings == () and report.notes == report.lints != ()


def _words(text: str) -> set:
    """The words of ``text``: what the table may wrap between (spaces, commas, brackets, '='), never inside."""
    return {w for line in text.splitlines() for w in re.findall(r"[^ ,(\[=]+", line)}


def test_wide_at_any_width_wraps_between_words_never_inside_one(capsys):
    _llama("--wide", "--width", "0")
    whole = capsys.readouterr().out
    for width in ("40", "60", "80"):  # under 70 the longest words overflow: wider, not cut
        _llama("--wide", "--width", width)
        wrapped = capsys.readouterr().out
        assert _words(wrapped) <= _words(whole), _words(wrapped) - _words(whole)
        assert max(map(len, wrapped.splitlines())) <= max(int(width), 70)


def _checkpoints(tmp_path):
    """A tiny OPT (no plan of its own) saved with its weights, and a tiny Llama's config."""
    from transformers import LlamaConfig, OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    opt = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                   num_attention_heads=4, word_embed_proj_dim=32,
                                   max_position_embeddings=64))
    opt.save_pretrained(tmp_path / "opt")
    llama = tmp_path / "llama.json"
    llama.write_text(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2).to_json_string())
    return opt, str(tmp_path / "opt"), str(llama)


def test_suggest_prints_the_plan_of_a_checkpoint_or_a_config_as_code(tmp_path, capsys):
    opt, folder, config = _checkpoints(tmp_path)
    assert main(["suggest", folder, "--world-size", "2"]) == 0
    printed = capsys.readouterr().out
    assert eval(printed, {n: getattr(tpfn, n) for n in tpfn.__all__}) == tpfn.suggest(opt, 2)
    assert printed.startswith("plan({\n    # tpfn.suggest over 2 ranks:")
    assert main(["suggest", config, "--world-size", "4"]) == 0
    assert "'model.layers.*.mlp.gate_proj': colwise()," in capsys.readouterr().out
    assert main(["suggest", "tests.test_explain_cli:mlp", "--world-size", "2"]) == 1
    assert capsys.readouterr().err.startswith("tpfn suggest: suggest runs one forward of Sequential")


def test_explain_and_verify_take_a_checkpoint_with_its_plan_or_suggests(tmp_path, capsys):
    _, folder, config = _checkpoints(tmp_path)
    assert main(["explain", config, "--world-size", "2", "--input", "1,8", "--width", "0"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"model\.layers\.\*\.self_attn\.q_proj \(Linear\) x2 +colwise\(\) ", out)  # its own plan
    assert main(["explain", folder, "--world-size", "2", "--input", "1,8", "--width", "0"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"model\.decoder\.layers\.\*\.fc1 \(Linear\) x2 +colwise\(\) ", out)  # suggest's
    assert main(["verify", folder, "--input", "1,8"]) == 0, capsys.readouterr()


def test_explain_dry_runs_a_checkpoint_saved_for_training(tmp_path, capsys):
    """transformers reads the position ids of a model set up for training (use_cache=False) to
    find packed sequences: the dry run's inputs are real, so it runs as it is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 use_cache=False)).save_pretrained(tmp_path / "ckpt")
    assert main(["explain", str(tmp_path / "ckpt"), "--world-size", "2", "--input", "input_ids=1,8",
                 "--width", "80"]) == 0
    assert "collectives per step:" in capsys.readouterr().out
