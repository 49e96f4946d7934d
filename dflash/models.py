"""python -m dflash.models: the registry of known target/drafter pairs, and which models the HF cache already holds.

Nothing is downloaded and the hub is not contacted: the cache is read with huggingface_hub.scan_cache_dir.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import cli, hub


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash.models", description=__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--debug", action="store_true", help="full tracebacks")
    args = p.parse_args(argv)

    cached = hub.cached_models()
    if args.json:
        print(json.dumps({
            "cache": hub.cache_dir(),
            "pairs": [{"target": q.target, "draft": q.draft, "backends": list(q.backends), "note": q.note,
                       "target_cached": q.target in cached, "draft_cached": q.draft in cached} for q in hub.PAIRS],
            "cached": [{"repo": r.repo_id, "size_on_disk": r.size_on_disk, "path": str(r.repo_path)}
                       for r in sorted(cached.values(), key=lambda r: r.repo_id)],
        }))
        return 0

    def size(repo: str) -> str:
        return cached[repo].size_on_disk_str if repo in cached else "-"

    rows = [("TARGET", "SIZE", "DRAFTER", "SIZE", "BACKENDS")]
    rows += [(q.target, size(q.target), q.draft, size(q.draft), ", ".join(q.backends) or q.note) for q in hub.PAIRS]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print("Known DFlash pairs (--model TARGET picks its drafter; SIZE is what the HF cache holds, - = not cached):")
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())

    known = {q.target: "target" for q in hub.PAIRS} | {q.draft: "drafter" for q in hub.PAIRS}
    total = sum(r.size_on_disk for r in cached.values())
    print(f"\nHF cache {hub.cache_dir()}: {len(cached)} model(s)" + (":" if cached else ""))
    for r in sorted(cached.values(), key=lambda r: r.repo_id):
        role = known.get(r.repo_id, "")
        print(f"  {r.repo_id:<48} {r.size_on_disk_str:>8}  {role}".rstrip())
    if cached:
        from huggingface_hub.utils import _format_size  # the same units as size_on_disk_str

        print(f"  {'total':<48} {_format_size(total):>8}")
    print(f"\nPre-fetch a pair (then it also works offline, HF_HUB_OFFLINE=1):\n  {hub.download_command(hub.PAIRS[1].target)}"
          f"\n  {hub.download_command(hub.PAIRS[1].draft)}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
