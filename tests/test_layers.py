"""The layers, as folders, import only downward; built-ins are compositions of primitives."""

import ast
import pathlib

import torch.nn as nn

import tpfn
from tpfn import Partial, Replicate, Shard, colwise, on_shards, params, prepare_out, replicate, rowwise
from tpfn.plans.mount import mount

ROOT = pathlib.Path(tpfn.__file__).parent

# Floors, lowest first; a module may import from its own floor and the floors below.
FLOORS = [
    {"tpfn.errors", "tpfn._fqn", "tpfn._torch"},
    {"tpfn.layout"},
    {"tpfn.algebra"},
    {"tpfn.style"},
    {"tpfn.plans"},
    {"tpfn.interpret"},
    {"tpfn.dryrun", "tpfn.adapters", "tpfn.training"},
    {"tpfn", "tpfn.cli", "tpfn.__main__", "tpfn.record", "tpfn.trace", "tpfn.rng", "tpfn.checkpoint"},
]


def _name(path: pathlib.Path) -> str:
    parts = ("tpfn",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _floor(module: str) -> int:
    for i, names in enumerate(FLOORS):
        if module in names:
            return i
    parent = module.rpartition(".")[0]
    if parent in ("", "tpfn"):
        raise AssertionError(f"{module} is on no floor: add it to FLOORS")
    return _floor(parent)


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tpfn"):
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("tpfn"):
                    yield node.lineno, a.name, []


def test_each_layer_imports_only_the_layers_below_it_and_no_private_names():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        me = _name(path)
        for line, module, names in _imports(path):
            target = module
            for name in names:  # `from tpfn.dryrun import lints` imports the module lints
                if (ROOT / pathlib.Path(*module.split(".")[1:], name + ".py")).exists():
                    target = f"{module}.{name}"
            if _floor(target) > _floor(me):
                found.append(f"{me}:{line} imports {target}, a higher layer")
            private = [n for n in names if n.startswith("_") and not n.endswith("__")]
            if private:
                found.append(f"{me}:{line} imports private {private} from {module}")
    assert found == []


def test_adapters_ask_the_plans_never_the_runtime():
    for path in (ROOT / "adapters").rglob("*.py"):
        for _, module, _ in _imports(path):
            assert not module.startswith(("tpfn.interpret", "tpfn.dryrun")), (path, module)


def _same(a, b):
    """Two mounts that mount the same: placements, slots, locality and kernel layouts."""
    assert a.params == b.params
    assert a.inputs == b.inputs and a.outputs == b.outputs
    assert (a.kernel.output, a.kernel.inputs, a.kernel.grads) == (
        b.kernel.output, b.kernel.inputs, b.kernel.grads)


def test_colwise_on_a_linear_is_its_composition_of_primitives():
    linear = nn.Linear(4, 8)
    _same(mount(colwise(), linear),
          mount(replicate() >> params(weight=Shard(0), bias=Shard(0))
                >> on_shards(Replicate(), grads=Partial(), output=Shard(-1)), linear))
    _same(mount(colwise(parts=2), linear),
          mount(params(weight=Shard(0, parts=2), bias=Shard(0, parts=2))
                >> on_shards(Replicate(), grads=Partial(), output=Shard(-1, parts=2)), linear))


def test_rowwise_on_a_linear_and_an_embedding_are_their_compositions_of_primitives():
    linear, embedding = nn.Linear(8, 4), nn.Embedding(16, 4)
    _same(mount(rowwise(), linear),
          mount(params(weight=Shard(1), bias=Replicate()) >> on_shards(Shard(-1), output=Partial())
                >> prepare_out(Replicate()), linear))
    _same(mount(rowwise(), embedding),
          mount(params(weight=Shard(0)) >> on_shards(Replicate(), grads=(None,), output=Partial())
                >> prepare_out(Replicate()), embedding))
    _same(mount(colwise(), embedding),
          mount(params(weight=Shard(1)) >> on_shards(Replicate(), grads=(None,), output=Shard(-1)),
                embedding))
    # beyond the primitives: the replicated bias is added once to the partial sums, and an
    # embedding sharded over its vocabulary masks the ids outside each rank's slice
    assert mount(rowwise(), linear).kernel.bias_once and mount(rowwise(), embedding).kernel.vocab


def test_sequence_parallel_is_replicated_parameters_on_a_shard_of_the_sequence():
    norm = nn.LayerNorm(4)
    sp = mount(tpfn.sequence_parallel(), norm)
    _same(sp, mount(params(weight=Replicate(), bias=Replicate())
                    >> on_shards(Shard(1), output=Shard(1), param_grads={"weight": Partial(),
                                                                         "bias": Partial()},
                                 local=False), norm))


def test_every_public_function_is_annotated():
    """Type hints on the public surface: every parameter and the return of each function in
    ``tpfn.__all__`` (py.typed ships them)."""
    import inspect

    missing = []
    for name in tpfn.__all__:
        obj = getattr(tpfn, name)
        if inspect.isfunction(obj):
            sig = inspect.signature(obj)
            missing += [f"{name}({p})" for p, v in sig.parameters.items()
                        if v.annotation is inspect.Parameter.empty]
            if sig.return_annotation is inspect.Signature.empty:
                missing.append(f"{name} -> ?")
    assert missing == []
