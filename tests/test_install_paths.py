"""A newcomer's path, as written: the install commands install this project, the README's first lines say what the
bundled pair is, an MLX-only environment runs what it can and says in one line what it cannot, and the docs
describe the project (and only files that exist or that a named command writes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
           HF_HUB_DISABLE_PROGRESS_BARS="1")


def run_without(blocked: tuple[str, ...], module: str, *args, cwd=None):
    """`python -m module args` in a process where `blocked` packages cannot be imported (as if not installed)."""
    hide = "".join(f"sys.modules[{m!r}] = None; " for m in blocked)
    code = f"import runpy, sys; {hide}runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=600)


# ---- packaging -------------------------------------------------------------------------------------------------------
def test_distribution_name_is_not_pypis_dflash():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = project["name"]
    assert name != "dflash"  # PyPI's dflash is the authors' reference package, without dflash.generate / train
    extras = project["optional-dependencies"]
    own = [req for reqs in extras.values() for req in reqs if re.match(r"dflash\b", req)]
    assert own and all(req.startswith(f"{name}[") for req in own), own  # `.[all]` must resolve to this project
    assert set(extras["all"][0][len(name) + 1:-1].split(",")) == set(extras) - {"all"}



def test_every_package_folder_is_installed():
    """pyproject lists its packages by hand: a folder with an __init__.py missing there is left out of the wheel."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"dflash": ROOT / "dflash", "dflash.backends": ROOT / "backends",
               "dflash.converters": ROOT / "converters"}
    found = {".".join((pkg, *init.parent.relative_to(folder).parts))
             for pkg, folder in folders.items() for init in folder.rglob("__init__.py")
             if pkg != "dflash" or init.relative_to(folder).parts[0] not in ("backends", "converters")}
    assert found == set(tool["packages"]), sorted(found ^ set(tool["packages"]))

def test_install_commands_install_this_checkout():
    """No `pip install dflash...` (PyPI's other project): every install of this project is from the checkout."""
    code = [*ROOT.glob("dflash/**/*.py"), *ROOT.glob("backends/**/*.py"), *ROOT.glob("converters/*.py"),
            *(p for p in ROOT.glob("scripts/*") if p.is_file()), ROOT / ".ci" / "run"]
    for path in [*DOCS, *code]:
        for cmd in re.findall(r"pip install [^\n`#]*", path.read_text()):
            specs = [word.strip("'\"") for word in cmd.split()[2:]]
            assert not any(re.fullmatch(r"dflash(\[[^\]]*\])?", s) for s in specs), \
                f"{path.relative_to(ROOT)}: {cmd!r} installs PyPI's dflash"
    readme = (ROOT / "README.md").read_text()
    assert "cannot live in one environment" in readme and "dflash-toolkit" in readme


def torch_extras() -> set[str]:
    """The extras of pyproject.toml that install torch, directly or through another extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras, name = project["optional-dependencies"], project["name"]
    pulls = {e for e, reqs in extras.items() if any(re.match(r"torch\b", r) for r in reqs)}
    while True:
        more = {e for e, reqs in extras.items() for r in reqs if r.startswith(f"{name}[")
                and set(r[len(name) + 1:r.index("]")].split(",")) & pulls} - pulls
        if not more:
            return pulls
        pulls |= more


def test_every_install_that_pulls_torch_pins_it():
    """An unpinned torch resolves PyPI's newest (on Linux, the multi-GB CUDA build); the docs pin the tested one."""
    pulls = torch_extras()
    assert {"torch", "all"} <= pulls
    checked = 0
    for path in DOCS:  # (tables quote error messages, not commands to run)
        text = "\n".join(line for line in path.read_text().splitlines() if not line.startswith("|"))
        for cmd in re.findall(r"pip install [^\n`#]*", text):
            extras = {x for spec in re.findall(r"\.\[([^\]]*)\]", cmd) for x in spec.split(",")}
            if extras & pulls or re.search(r"(^|\s)['\"]?torch\b", cmd[len("pip install"):]):
                checked += 1
                assert "torch==2.13.0" in cmd, f"{path.relative_to(ROOT)}: {cmd.strip()!r} leaves torch unpinned"
    assert checked >= 5


def test_readme_first_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    # a CPU-only machine gets torch's CPU build before the installs that would otherwise pull the CUDA one
    assert lines[3].startswith('pip install "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu ')
    assert lines[4].startswith('pip install "torch==2.13.0" -e ".[torch]" && python -m dflash.generate --prompt ')
    assert lines[5].startswith('pip install "torch==2.13.0" -e ".[all]" && python -m pytest -q')
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = lines[5].split("&& ", 1)[1].split("#")[0].strip()
    assert 'python -m pip install -q "torch==2.13.0" -e ".[all]"' in ci and test_command in ci
    intro = " ".join(lines[7:14])
    assert "8.4M-parameter" in intro and "toy" in intro and "--model Qwen/Qwen3-8B" in intro
    assert re.search(r"test command ran in \d+(-\d+)? s on a quiet 2-core", intro)  # its time beside it


def test_generate_on_the_bundled_pair_says_what_it_is():
    p = subprocess.run([sys.executable, "-m", "dflash.generate", "--backend", "torch", "--prompt", "def f(x):",
                        "--max-new-tokens", "2"], capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode == 0, p.stderr
    # (on a busy machine the --verify auto profile's own notice may come first)
    assert any(line.startswith("dflash: the bundled pair is an 8.4M-parameter toy") for line in p.stderr.splitlines())


# ---- an environment without torch (or matplotlib) --------------------------------------------------------------------
@pytest.mark.mlx
def test_backend_auto_picks_mlx_when_torch_is_missing():
    pytest.importorskip("mlx_lm")
    p = run_without(("torch",), "dflash.generate", "--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["generation_tokens"] == 3


@pytest.mark.slow
def test_bench_without_matplotlib_writes_results_and_says_so(tmp_path):
    p = run_without(("matplotlib",), "dflash.bench", "--methods", "no_draft", "--prompts", "reference",
                    "--num-prompts", "1", "--max-new-tokens", "2", "--warmup", "0", "--threads", "1",
                    "--out", tmp_path / "out", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert "bench: matplotlib is not installed, so no plots" in p.stderr.splitlines()[0]
    assert sorted(f.name for f in (tmp_path / "out").iterdir()) == ["logs", "results.json", "results.md"]
    assert "Traceback" not in p.stderr


# ---- docs ------------------------------------------------------------------------------------------------------------
def test_docs_describe_the_project_not_its_making():
    making = re.compile(r"\b(the issue|this session|the sessions?|was asked|asked for)\b", re.IGNORECASE)
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            assert not making.search(line), f"{doc.name}:{n}: {line.strip()}"


def test_readme_paths_exist_or_are_written_by_a_named_command():
    readme = (ROOT / "README.md").read_text()
    for path in sorted(set(re.findall(r"\b((?:docs|tests|scripts|backends|dflash|converters)/[\w./{},*-]+\w)",
                                      readme))):
        expanded = [path.replace("{1,4,8}", n) for n in "148"] if "{" in path else [path]
        for p in expanded:
            assert list(ROOT.glob(p)) or list((ROOT / "docs").glob(p)), path


@pytest.mark.slow
def test_readme_train_section_runs_as_written(tmp_path):
    """The Train section's regenerate and train lines, with the bundled target for Qwen/Qwen3-8B and tiny sizes
    added: the shipped prompt file exists where the README names it (from a checkout's root), and both commands
    run (in a scratch directory, so paths relative to the root are made absolute)."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Train a drafter", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line.split("#")[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    commands = [line.split()[2:] for line in lines if line.startswith(("python -m dflash.data regenerate",
                                                                        "python -m dflash.train "))]
    assert len(commands) == 2 and "dflash/reference/train_prompts.jsonl" in commands[0]
    target = str(ROOT / "dflash" / "reference" / "assets" / "target")
    tiny = {"dflash.data": ["--max-new-tokens", "4", "--device", "cpu", "--no-progress"],
            "dflash.train": ["--max-steps", "1", "--num-layers", "1", "--num-anchors", "4", "--device", "cpu",
                             "--eval-max-prompts", "1", "--eval-max-new-tokens", "4", "--no-progress", "--plot",
                             "false"]}
    for module, *args in commands:
        args = [target if a == "Qwen/Qwen3-8B" else str(ROOT / a) if a.startswith("dflash/") else a for a in args]
        p = subprocess.run([sys.executable, "-m", module, *args, *tiny[module]], capture_output=True, text=True,
                           env=ENV, cwd=tmp_path, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "runs" / "q8" / "draft" / "model.safetensors").is_file()
