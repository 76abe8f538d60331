"""The package's layout rules, checked from the source (no import, no GPU).

torchmem/ is layered: runtime/ (the allocator glue), analysis/ (offline), host/,
batch/, monitor/, share/, integrations/, cli/. Two rules keep the layers apart,
and this file keeps them true:

- No import cycles. A cycle makes load order matter (a module half-initialized
  when the other reads it) and hides which layer depends on which. Every import
  counts, a function-level one too: it is a dependency all the same. Importing a
  submodule also runs its packages' __init__ files, so those are edges as well,
  except a package's own (the package loading its submodules is not a cycle).
- One gate to the compiled module: only torchmem/_loader.py imports torchmem._C.
  It loads it lazily and turns a build for another torch into one clear error;
  every other module calls the core through _loader's names (extension()).
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "torchmem"
GATE = "torchmem._loader"


def module_files():
    """{dotted module name: path} for every .py file of the package."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _ancestors(name):
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def imported_names(name, path):
    """Every module name `name` imports (anywhere in the file), absolute, with the names a
    `from X import a` brings in as X.a (a may be a submodule)."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            found.append(base)
            found += [f"{base}.{alias.name}" for alias in node.names]
    return found


def import_graph():
    modules = module_files()
    graph = {}
    for name, path in modules.items():
        own = _ancestors(name) | {name}
        edges = set()
        for target in imported_names(name, path):
            if target not in modules:
                continue
            edges |= ({target} | _ancestors(target)) - own
        graph[name] = edges & set(modules)
    return graph


def cycles(graph):
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def imports_compiled(path):
    """Whether the file imports torchmem._C, or binds the name _C by an import (the gate's
    lazy attribute included: `from torchmem._loader import _C`)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name == "torchmem._C" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module == "torchmem._C"
                                                 or any(a.name == "_C" for a in node.names)):
            return True
    return False


def test_only_the_gate_imports_the_compiled_module():
    importers = sorted(name for name, path in module_files().items() if imports_compiled(path))
    assert importers == [GATE]


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


if __name__ == "__main__":
    for component in cycles(import_graph()):
        print("cycle:", " ".join(component))
    for name, path in module_files().items():
        if name != GATE and imports_compiled(path):
            print("imports _C:", name)


def test_module_paths_from_before_the_subpackages_still_import():
    """Scripts and harnesses name the old flat paths (PyTorch's peer-suite runner calls
    importlib.import_module("torchmem.install").installed_config()): each loads its new module,
    and where a path and a public function share a name the attribute stays the function."""
    import importlib

    import torchmem

    for old, new in torchmem._MOVED.items():
        alias = importlib.import_module(f"torchmem.{old}")
        target = importlib.import_module(new)
        public = [n for n in dir(target) if not n.startswith("_") and callable(getattr(target, n))]
        assert public, new
        assert getattr(alias, public[0]) is getattr(target, public[0]), old
    assert importlib.import_module("torchmem.install").installed_config is importlib.import_module(
        "torchmem.installer").installed_config
    import torchmem.install  # noqa: F401  (binds no attribute: torchmem.install stays the function)
    import torchmem.snapshot  # noqa: F401
    assert callable(torchmem.install) and torchmem.install.__name__ == "install"
    assert torchmem.snapshot.__name__ == "snapshot"
    from torchmem import patch
    assert patch.is_patched is importlib.import_module("torchmem.runtime.patch").is_patched


def test_torchmems_tests_do_not_load_bench():
    """bench/ is run by hand and tested by its own tests (bench/tests/): torchmem's tests neither
    import a bench script nor put bench/ on sys.path."""
    import pathlib

    here = pathlib.Path(__file__).parent
    for path in sorted(here.rglob("*.py")):
        if path.resolve() == pathlib.Path(__file__).resolve():
            continue
        text = path.read_text()
        assert "load_bench" not in text, path
        assert not [line for line in text.splitlines() if "sys.path" in line and "bench" in line], path
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("bench", "common"):
                raise AssertionError(f"{path}: imports {node.module}")
