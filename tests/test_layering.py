"""The file tree is the import tree. A module's layer is its folder: dflash/core/ (the core), backends/, converters/,
and everything else in dflash/ (the API and the applications). Imports point down the layers, inside functions as
well as at module level, and never form a circle; the core imports neither torch nor mlx at module level. Inside a
function a module may import an optional package lazily (torch, mlx, fastapi, ...), never a project module that
its layer may not see. Imports under `if TYPE_CHECKING:` (annotations only) count like the others: a circle of
them is a circle of modules that need each other, whichever runs first; they load nothing, so they do not count as
loading a framework."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"dflash": ROOT / "dflash", "dflash.backends": ROOT / "backends", "dflash.converters": ROOT / "converters"}
FRAMEWORKS = {"torch", "mlx", "mlx_lm", "transformers"}

# what each layer may import from the project (besides its own folder)
MAY_IMPORT = {"core": {"core"}, "backends": {"core", "backends"}, "converters": {"core", "converters"},
              "applications": {"core", "backends", "converters", "applications"}}


def layer(module: str) -> str:
    for folder in ("core", "backends", "converters"):
        if module == f"dflash.{folder}" or module.startswith(f"dflash.{folder}."):
            return folder
    return "applications"


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((pkg,) + parts)] = path
    return out


def imports(name: str, path: Path, known: dict) -> list[tuple[str, bool]]:
    """(what `name` imports, whether it loads at module level) for every import statement in it, resolved to known
    modules or to the top-level name of an outside package."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            root = ".".join(base[:len(base) - node.level + 1]) if node.level else ""
            mod = ".".join(p for p in (root, node.module or "") if p)
            # `from . import x` in a package's own module names the submodule, not the package being imported
            own_package = name == mod or name.startswith(mod + ".")
            targets = ([] if own_package else [mod]) + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        loads = id(node) in top  # (not inside a function, nor under `if TYPE_CHECKING:`)
        for t in targets:
            while t and t not in known and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in known:
                if t != name:
                    found.append((t, loads))
            elif t.split(".")[0] != "dflash":
                found.append((t.split(".")[0], loads))
    return found


def graph(module_level_only: bool = False) -> dict[str, set[str]]:
    known = modules()
    return {m: {t for t, at_top in imports(m, p, known) if at_top or not module_level_only}
            for m, p in known.items()}


def test_no_import_circle():
    g = graph()
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for d in g.get(m, ()):
            if state.get(d) == "open":
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d in g and d not in state:
                visit(d, stack + [d])
        state[m] = "done"

    for m in g:
        if m not in state:
            visit(m, [m])


def test_layers_point_down():
    known = modules()
    for m, deps in graph().items():
        project = {d for d in deps if d in known}
        bad = sorted(d for d in project if layer(d) not in MAY_IMPORT[layer(m)])
        assert not bad, f"{m} ({layer(m)}) imports {bad}"
        if layer(m) == "converters":
            assert not any(layer(d) == "backends" for d in project), (m, deps)
        if m.startswith("dflash.backends."):
            backend = m.split(".")[2]
            others = sorted(d for d in project if d.startswith("dflash.backends.") and d.split(".")[2] != backend
                            and d.split(".")[2] != "base")
            assert not others, f"{m} imports another backend: {others}"


def test_core_loads_no_framework():
    for m, deps in graph(module_level_only=True).items():
        if layer(m) == "core":
            assert not deps & FRAMEWORKS, f"{m} imports {sorted(deps & FRAMEWORKS)} at module level"


def test_layers_are_folders():
    """Nothing outside the core may pass for it: the core's folder holds modules only (no subpackages to skip)."""
    assert all(p.parent == ROOT / "dflash" / "core" for m, p in modules().items() if layer(m) == "core")
