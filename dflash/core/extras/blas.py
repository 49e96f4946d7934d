"""MLX on a Linux CPU: the mlx[cpu] wheel links the reference BLAS it bundles, whose matmul is 20-30x slower than
OpenBLAS; on it a 16-token verify costs so much more than a one-token step that DFlash runs slower than plain
decoding. Debian's OpenBLAS (`apt-get install libopenblas0-pthread`) takes its place when it is preloaded, which
only works at process start: an MLX CLI run re-executes itself with LD_PRELOAD set, and says in one line what to do
where it cannot.

OpenBLAS never goes into a process that imports torch: transformers (which mlx-lm and the tokenizer loader use)
imports torch whenever it is installed, so the preload happens only in environments without torch.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from .deps import installed

# where Debian / Ubuntu's libopenblas0-pthread puts it; DFLASH_OPENBLAS names another build
DEBIAN_OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
_told = False


def openblas_path() -> Path:
    return Path(os.environ.get("DFLASH_OPENBLAS") or DEBIAN_OPENBLAS)


def wheel_reference_blas() -> Path | None:
    """The reference libblas the mlx[cpu] wheel bundles (auditwheel's mlx_cpu.libs/), or None: macOS, another
    MLX build, or no MLX at all. Found on disk, so it can be asked before mlx is imported."""
    if not sys.platform.startswith("linux") or not installed("mlx"):
        return None
    spec = importlib.util.find_spec("mlx")
    locations = (spec.submodule_search_locations if spec is not None else None) or []
    for package_dir in map(Path, locations):
        found = sorted((package_dir.parent / "mlx_cpu.libs").glob("libblas*.so*"))
        if found:
            return found[0]
    return None


def openblas_preloaded() -> bool:
    """An OpenBLAS in LD_PRELOAD: any libopenblas*, or the DFLASH_OPENBLAS file (so a restart never loops)."""
    preloaded = [Path(p) for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    return openblas_path() in preloaded or any("openblas" in p.name for p in preloaded)


def mlx_blas() -> str:
    """"fast" (another BLAS, or OpenBLAS already preloaded), else why MLX is on the reference one: "torch" (torch
    is installed, so no preload), "no-openblas" (nothing to preload) or "preloadable"."""
    if wheel_reference_blas() is None or openblas_preloaded():
        return "fast"
    if installed("torch"):
        return "torch"
    return "preloadable" if openblas_path().is_file() else "no-openblas"


def advice(state: str) -> str | None:
    """The one line for an MLX process on the reference BLAS (None when there is nothing to say)."""
    slow = "dflash: MLX is on the mlx[cpu] wheel's reference BLAS (matmul 20-30x slower than OpenBLAS)"
    return {
        "torch": f"{slow}; OpenBLAS is preloaded only where torch is not installed (transformers would load it into "
                 "the process): pip install -e '.[mlx]' in a venv of its own, and apt-get install libopenblas0-pthread",
        "no-openblas": f"{slow}: sudo apt-get install libopenblas0-pthread, and MLX runs preload it",
        "preloadable": f"{slow}: start the process with LD_PRELOAD={openblas_path()}",
    }.get(state)


def tell_once(line: str | None) -> None:
    global _told
    if line and not _told:
        _told = True
        print(line, file=sys.stderr, flush=True)


def _started_as_a_dflash_cli() -> bool:
    """True when this process is `python [options] -m dflash.<cli> ...`: a command line a restart can repeat as is
    (not a script or a test that calls a CLI's main())."""
    argv = sys.orig_argv
    return "-m" in argv[1:-1] and argv[argv.index("-m", 1) + 1].startswith("dflash.")


def restart_mlx_run_with_openblas() -> None:
    """For a CLI whose run is decided to be MLX, before it has done any work: re-execute the same command with
    OpenBLAS preloaded when that is possible and safe. Where it is not, dflash.load says why once, after its
    input checks (a refused run gets its one error line and nothing else)."""
    if mlx_blas() != "preloadable" or not _started_as_a_dflash_cli():
        return
    preload = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p] + [str(openblas_path())]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], dict(os.environ, LD_PRELOAD=":".join(preload)))


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (Intel AMX, AVX512-BF16): there bf16 autocast is faster than
    float32; elsewhere (AVX2 only, e.g. most AMD EPYC and older Xeons) it is emulated and many times slower. Read from
    the kernel's CPU flags (Linux); False where they cannot be read."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags
