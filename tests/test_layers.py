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
    {"tpfn.errors", "tpfn._fqn", "tpfn._torch", "tpfn.rng"},
    {"tpfn.layout"},
    {"tpfn.tree", "tpfn.algebra", "tpfn.bounded"},
    {"tpfn.style"},
    {"tpfn.plans"},
    {"tpfn.interpret"},
    {"tpfn.kernels"},
    {"tpfn.analysis"},
    {"tpfn.dryrun", "tpfn.adapters", "tpfn.training.progress"},
    {"tpfn.suggest", "tpfn.training"},
    {"tpfn", "tpfn.cli", "tpfn.__main__", "tpfn.record", "tpfn.trace", "tpfn.checkpoint"},
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
    """Two mounts that mount the same: placements, slots, locality and the layouts on shards."""
    assert a.params == b.params
    assert a.inputs == b.inputs and a.outputs == b.outputs
    assert (a.shards.output, a.shards.desired, a.shards.grads, a.shards.param_grads) == (
        b.shards.output, b.shards.desired, b.shards.grads, b.shards.param_grads)


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
    assert mount(rowwise(), linear).row.once == "bias"
    assert mount(rowwise(), embedding).row.forward is tpfn.plans.kinds.vocab_parallel


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


# Private attributes of torch objects (tensors, autograd nodes and Functions, modules, ops,
# process groups, meshes, DTensors and their placements) that tpfn has reached or may reach:
# ``x._name`` on any object with one of these names is a private torch use, whatever ``x`` is.
PRIVATE_TORCH_ATTRS = frozenset({
    # autograd: nodes, Functions, the engine
    "_sequence_nr", "_backward_cls", "_current_graph_task_id", "_current_autograd_node",
    "_will_engine_execute_node", "_get_sequence_nr", "_execution_engine", "_autograd",
    "_forward_cls", "_saved_tensors", "_raw_saved_tensors", "_register_hook_dict",
    # tensors
    "_use_count", "_backward_hooks", "_post_accumulate_grad_hooks", "_grad", "_grad_fn",
    "_make_subclass", "_make_wrapper_subclass", "_typed_storage", "_cdata", "_assert_async",
    # modules
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_forward_pre_hooks",
    "_forward_hooks", "_forward_hooks_always_called", "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs", "_global_forward_pre_hooks", "_global_forward_hooks",
    "_global_backward_hooks", "_full_backward_hooks", "_full_backward_pre_hooks",
    "_state_dict_hooks", "_load_state_dict_pre_hooks", "_apply", "_call_impl",
    # ops
    "_schema", "_overloadpacket",
    # process groups and meshes
    "_register_backend", "_create_internal", "_get_backend", "_set_group_name", "_allgather_base",
    "_reduce_scatter_base", "_unflatten", "_flatten", "_dim_group_names", "_pg_registry",
    "_mesh_resources", "_register_process_group", "_resolve_process_group",
    "_unregister_process_group",
    # DTensor, its spec and placements, LocalTensorMode's symbolic ints
    "_local_tensor", "_spec", "_local_ints", "_split_tensor", "_partition_value", "_reduce_value",
    "_reduce_shard_value", "_to_replicate_tensor", "_StridedShard",
})

# Private by name but part of how everyone inspects tensors (views and in-place versions, as
# autograd's own errors name them), stable for years: allowed anywhere.
ALLOWED_TORCH_ATTRS = frozenset({"_version", "_base", "_is_view"})

def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__") and name not in ALLOWED_TORCH_ATTRS


def _chain(node: ast.Attribute):
    """The root of an attribute chain (a Name, or whatever expression it starts from) and its
    attribute names, outermost last."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return node, names[::-1]


def private_torch_uses(path: pathlib.Path) -> list:
    """``(line, what)`` for each private torch use in the module at ``path``: an import of a
    torch module path with a ``_`` component or of a ``_`` name from torch; an attribute chain
    rooted at a name imported from torch with a ``_`` component; ``._x`` for ``_x`` in
    ``PRIVATE_TORCH_ATTRS`` on anything (also by ``getattr``/``hasattr``/``setattr``)."""
    tree = ast.parse(path.read_text())
    found, torch_names = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    torch_names.add(a.asname or "torch")
                    if any(_private(c) for c in a.name.split(".")):
                        found.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "torch" or node.module.startswith("torch.")):
            private_path = any(_private(c) for c in node.module.split("."))
            for a in node.names:
                torch_names.add(a.asname or a.name)
                if private_path or _private(a.name):
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:  # a whole chain, once
            root, names = _chain(node)
            rooted = isinstance(root, ast.Name) and root.id in torch_names
            for i, name in enumerate(names):
                if name in PRIVATE_TORCH_ATTRS or (rooted and _private(name)):
                    head = root.id if isinstance(root, ast.Name) else "..."
                    found.append((node.lineno, ".".join([head, *names[:i + 1]])))
                    break
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in PRIVATE_TORCH_ATTRS):
            found.append((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
    return sorted(set(found))


def test_private_torch_is_used_in_tpfn_torch_only():
    """Every private PyTorch API goes through ``tpfn/_torch.py``: one file to fix per torch
    release (the DESIGN's "Private torch in one file")."""
    found = [f"tpfn/{path.relative_to(ROOT).as_posix()}:{line} {what}"
             for path in sorted(ROOT.rglob("*.py")) if path != ROOT / "_torch.py"
             for line, what in private_torch_uses(path)]
    assert found == [], "private torch outside tpfn/_torch.py; use (or add) a wrapper there:\n" + "\n".join(found)


def test_the_private_torch_check_sees_each_kind_of_use(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import torch\n"
        "import torch.distributed._functional_collectives as funcol\n"
        "from torch.distributed.tensor.placement_types import _StridedShard\n"
        "from torch.utils import _pytree\n"
        "from torch.nn.modules import pooling\n"
        "from tpfn._torch import FakeProcessGroup\n"
        "a = torch._C._current_graph_task_id()\n"
        "b = node._sequence_nr()\n"
        "c = pooling._MaxPoolNd\n"
        "d = FakeProcessGroup._create_internal(0, 2)\n"
        "e = getattr(dt, '_local_tensor')\n"
        "f = (x._version, x._base, x._is_view(), self._cache, torch.nn.Linear, x.__dict__)\n")
    assert private_torch_uses(source) == [
        (2, "import torch.distributed._functional_collectives"),
        (3, "from torch.distributed.tensor.placement_types import _StridedShard"),
        (4, "from torch.utils import _pytree"),
        (7, "torch._C"),
        (8, "node._sequence_nr"),
        (9, "pooling._MaxPoolNd"),
        (10, "FakeProcessGroup._create_internal"),
        (11, "getattr(..., '_local_tensor')"),
    ]
