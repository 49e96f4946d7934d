"""The file tree is the import tree: module-level imports point down the layers (applications -> API -> core ->
leaves; backends under the core; converters beside them) and never form a circle; the core imports neither torch
nor mlx at module level."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"dflash": ROOT / "dflash", "dflash.backends": ROOT / "backends", "dflash.converters": ROOT / "converters"}
CORE = {"dflash.engine", "dflash.loop", "dflash.draft_context", "dflash.spec", "dflash.checkpoint", "dflash.sampling",
        "dflash.stats", "dflash.text", "dflash.io", "dflash.errors", "dflash.tokenizer", "dflash.datasets",
        "dflash.answers", "dflash.prefix_cache"}
APPLICATIONS = ("dflash.api", "dflash.cli", "dflash.generate", "dflash.chat", "dflash.train", "dflash.data",
                "dflash.serve", "dflash.server", "dflash.remote_regeneration",
                "dflash.convert", "dflash.models", "dflash.bench", "dflash.reference")


def is_application(module: str) -> bool:
    return any(module == a or module.startswith(a + ".") for a in APPLICATIONS)


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((pkg,) + parts)] = path
    return out


def module_level_imports(name: str, path: Path, known: dict) -> set[str]:
    """What `name` imports when it is imported (not inside functions), resolved to known modules."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in tree.body:
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
        for t in targets:
            while t and t not in known and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in known and t != name:
                found.add(t)
            elif t.split(".")[0] in ("torch", "mlx", "mlx_lm", "transformers"):
                found.add(t.split(".")[0])
    return found


def graph():
    known = modules()
    return {m: module_level_imports(m, p, known) for m, p in known.items()}


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
    g = graph()
    for m, deps in g.items():
        if m in CORE:
            assert not deps & {"torch", "mlx", "mlx_lm", "transformers"}, f"{m} imports a framework at module level"
            assert not any(is_application(d) or d.startswith("dflash.backends") for d in deps), (m, deps)
        if m.startswith(("dflash.backends", "dflash.converters")):
            bad = [d for d in deps if is_application(d)]
            assert not bad, f"{m} imports the API / application layer: {bad}"
        if m.startswith("dflash.converters"):
            assert not any(d.startswith("dflash.backends") for d in deps), (m, deps)
