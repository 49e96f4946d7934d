"""The file tree is the import tree. A module's layer is its folder: dflash/core/ (the core), backends/, converters/,
and everything else in dflash/ (the API and the applications). Imports point down the layers, inside functions as
well as at module level, and never form a circle; the core imports neither torch nor mlx at module level. Inside a
function a module may import an optional package lazily (torch, mlx, fastapi, ...), never a project module that
its layer may not see. Imports under `if TYPE_CHECKING:` (annotations only) count like the others: a circle of
them is a circle of modules that need each other, whichever runs first; they load nothing, so they do not count as
loading a framework.

The core's own folder holds the speculative loop and what it stands on (contract, engine, loop, budget, trees,
sampling, rows, caches' policy, specs, errors, io); its subfolders hold what serves loading, training and the
applications: model_files/ (drafter checkpoint, a target's config and tokenizer), training/ (training settings and
data), extras/ (optional packages, BLAS, plots). The loop's modules import none of them; each subfolder imports the
loop's folder and itself, never another subfolder."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"dflash": ROOT / "dflash", "dflash.backends": ROOT / "backends", "dflash.converters": ROOT / "converters"}
FRAMEWORKS = {"torch", "mlx", "mlx_lm", "transformers"}

CORE_FOLDERS = ("model_files", "training", "extras")  # the core's subfolders: dflash/core/NAME/
CORE = {"core"} | {f"core/{f}" for f in CORE_FOLDERS}

# what each layer may import from the project (besides its own folder)
MAY_IMPORT = {"core": {"core"}, **{f"core/{f}": {"core", f"core/{f}"} for f in CORE_FOLDERS},
              "backends": CORE | {"backends"}, "converters": CORE | {"converters"},
              "applications": CORE | {"backends", "converters", "applications"}}


def layer(module: str) -> str:
    for folder in CORE_FOLDERS:
        if module == f"dflash.core.{folder}" or module.startswith(f"dflash.core.{folder}."):
            return f"core/{folder}"
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
        if layer(m) in CORE:
            assert not deps & FRAMEWORKS, f"{m} imports {sorted(deps & FRAMEWORKS)} at module level"


def test_layers_are_folders():
    """Nothing outside the core may pass for it: the core's folder holds modules and the subfolders named in
    CORE_FOLDERS, each of them modules only (no deeper packages to skip, no subfolder without a rule)."""
    core = ROOT / "dflash" / "core"
    folders = {core} | {core / f for f in CORE_FOLDERS}
    for m, p in modules().items():
        if layer(m) in CORE:
            assert p.parent in folders, f"{p.relative_to(ROOT)}: the core's folders are {sorted(CORE)}"
    assert {p.name for p in core.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(CORE_FOLDERS)

