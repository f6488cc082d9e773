"""Experiment reports: Markdown tables and matplotlib figures rendered from DIR/results.json.

Everything printed is what the experiment measured (pipelines.experiment); the paper's figures stand beside
ours for reference only, and each expectation says plainly whether our result has the paper's sign.
"""

from __future__ import annotations

import io
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
from scipy import stats

from soma_cluster.diskerrors import require_writable_dir
from soma_cluster.errors import SomaError
from soma_cluster.methods import method_named
from soma_cluster.storage import Store, temp_prefix
from soma_cluster.targets import EXPERIMENT_FILE, RESULTS_FILE, not_an_experiment

ZO_NOTE = (
    "SOMA is a zero-order method: it is meant to beat other zero-order training (monolithic SPSA, EGGROLL) "
    "at matched compute, not backpropagation, which remains far better per GPU-hour."
)
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _ci(v: dict) -> str:
    return f"{v['nats_per_byte']:.4f} [{v['ci95'][0]:.4f}, {v['ci95'][1]:.4f}]"


def _diff(v: dict | None) -> str:
    return "-" if v is None else f"{v['nats_per_byte']:+.4f} [{v['ci95'][0]:+.4f}, {v['ci95'][1]:+.4f}]"


def _name(r: dict) -> str:
    extra = f", {r['method']}" + (f", {r['objective']} loss" if r["objective"] != "independent" else "")
    return f"{r['label'] or 'arm'} (N = {r['n_experts']}, d = {r['d']}{extra})"


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval across seeds (a single seed gives a zero-width interval)."""
    a = np.asarray(values, dtype=np.float64)
    if len(a) < 2:
        return float(a.mean()), float(a.mean()), float(a.mean())
    half = stats.t.ppf(0.975, df=len(a) - 1) * a.std(ddof=1) / math.sqrt(len(a))
    return float(a.mean()), float(a.mean() - half), float(a.mean() + half)


# -- arms experiments -------------------------------------------------------------------------------------
def results_table(res: dict) -> str:
    unit = next(
        (r["gpu_hours_unit"] for arms in res["seeds"].values() for r in arms.values() if "gpu_hours_unit" in r),
        "GPU-hours",
    )
    head = (
        f"| seed | arm | parameters | updates / expert | forwards | {unit} | test nats/byte [95% CI] | bits/byte | "
        f"minus {res['reference']}, paired [95% CI] | byte-tokens/s | routing share |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = []
    for seed, arms in res["seeds"].items():
        for r in arms.values():
            rows.append(
                f"| {seed} | {_name(r)} | {r['parameters']:,} | {np.mean(r['updates']):.0f} | {r['forwards']:,} | "
                f"{r['gpu_hours']:.4f} | {_ci(r['ensemble'])} | {r['ensemble']['bits_per_byte']:.4f} | "
                f"{_diff(r['vs_reference'])} | {r['byte_tokens_per_second']:,.0f} | "
                f"{100 * r['routing_time_share']:.2f}% |"
            )
    return head + "\n" + "\n".join(rows)


def seed_summary(res: dict) -> str:
    """With several seeds: each arm's mean test loss and mean paired difference, with t-intervals across seeds."""
    seeds = list(res["seeds"].values())
    if len(seeds) < 2:
        return ""
    lines = [
        f"Across {len(seeds)} seeds (mean, 95% t-interval over seeds):",
        "",
        f"| arm | test nats/byte | minus {res['reference']}, paired |",
        "|---|---|---|",
    ]
    for name in seeds[0]:
        loss = mean_interval([s[name]["ensemble"]["nats_per_byte"] for s in seeds])
        diffs = [s[name]["vs_reference"]["nats_per_byte"] for s in seeds if s[name]["vs_reference"]]
        d = mean_interval(diffs) if diffs else None
        lines.append(
            f"| {_name(seeds[0][name])} | {loss[0]:.4f} [{loss[1]:.4f}, {loss[2]:.4f}] | "
            + (f"{d[0]:+.4f} [{d[1]:+.4f}, {d[2]:+.4f}] |" if d else "- |")
        )
    return "\n".join(lines)


def matched_forwards(res: dict) -> str:
    """Each arm's curve point at the largest forward count every zero-order arm reached (seed 0 of each). BPTT
    runs one forward (and one backward) per update, so it is shown where it stands at that count, not matched."""
    arms = next(iter(res["seeds"].values()))
    zo = [r for r in arms.values() if method_named(r["method"]).zero_order] or list(arms.values())
    target = min(r["curve"][-1]["forwards"] for r in zo)
    bptt = (
        " A BPTT update is one forward and one backward (about two forwards more of compute), so BPTT rarely "
        "reaches that count within the same GPU-hours."
        if len(zo) < len(arms)
        else ""
    )
    lines = [
        f"At matched forward passes: each arm at its last evaluated checkpoint with at most {target:,} forwards, the "
        f"smallest total any zero-order arm reached (seed-stage forwards included).{bptt}",
        "",
        "| arm | step | forwards | GPU-hours | test nats/byte [95% CI] |",
        "|---|---|---|---|---|",
    ]
    for r in arms.values():
        p = [q for q in r["curve"] if q["forwards"] <= target][-1]
        lines.append(f"| {_name(r)} | {p['step']} | {p['forwards']:,} | {p['gpu_hours']:.4f} | {_ci(p)} |")
    return "\n".join(lines)


def _pair_diffs(seeds: list[dict], better: str, worse: str, ref: str | None) -> list[dict]:
    """loss(better) - loss(worse) per seed: paired through the reference arm when one of them is it."""
    out = []
    for s in seeds:
        if worse == ref and s[better]["vs_reference"]:
            out.append(s[better]["vs_reference"])
        elif better == ref and s[worse]["vs_reference"]:
            v = s[worse]["vs_reference"]
            out.append({"nats_per_byte": -v["nats_per_byte"], "ci95": [-v["ci95"][1], -v["ci95"][0]], "paired": True})
        else:
            d = s[better]["ensemble"]["nats_per_byte"] - s[worse]["ensemble"]["nats_per_byte"]
            out.append({"nats_per_byte": d, "ci95": [math.nan, math.nan]})
    return out


def verdicts(res: dict) -> list[str]:
    seeds = list(res["seeds"].values())
    lines = []
    for e in res["expect"]:
        diffs = _pair_diffs(seeds, e["better"], e["worse"], res["reference"])
        mean = float(np.mean([d["nats_per_byte"] for d in diffs]))
        strong = all(d["ci95"][1] < 0 for d in diffs)
        sign = "matches the paper's sign" if mean < 0 else "does NOT match the paper's sign"
        conf = (
            " (every seed's paired 95% CI excludes zero)"
            if strong
            else " (not every seed's paired CI excludes zero)"
            if mean < 0
            else ""
        )
        per = ", ".join(f"{d['nats_per_byte']:+.4f}" for d in diffs)
        lines.append(
            f"- **{e['better']} vs {e['worse']}** (final test loss, each arm at its own budget): "
            f"{e['better']} minus {e['worse']} = {mean:+.4f} nats/byte "
            f"(per seed: {per}): {sign}{conf}. Paper: {e['paper']}."
        )
    return lines


# -- figures ----------------------------------------------------------------------------------------------
def _curves_by_arm(res: dict) -> dict[str, list[list[dict]]]:
    out: dict[str, list[list[dict]]] = {}
    for arms in res["seeds"].values():
        for name, r in arms.items():
            out.setdefault(name, []).append(r["curve"])
    return out


def _figure(size: tuple[float, float]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=size)


def _png(fig, ax) -> bytes:
    import matplotlib.pyplot as plt

    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _plot_curves(res: dict, x_key: str, xlabel: str) -> bytes:
    fig, ax = _figure((7, 4.2))
    names = {n: _name(r) for n, r in next(iter(res["seeds"].values())).items()}
    for name, curves in _curves_by_arm(res).items():
        color = None
        for i, c in enumerate(curves):
            x = np.array([p[x_key] for p in c], dtype=np.float64)
            y = np.array([p["nats_per_byte"] for p in c])
            lo, hi = np.array([p["ci95"][0] for p in c]), np.array([p["ci95"][1] for p in c])
            (line,) = ax.plot(
                x, y, marker=".", color=color, label=names[name] if i == 0 else None, alpha=1.0 if i == 0 else 0.6
            )
            color = line.get_color()
            ax.fill_between(x, lo, hi, color=color, alpha=0.15)
    if x_key == "forwards":
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test nats/byte (routed ensemble)")
    ax.set_title(f"{res['title']} ({res['scale']} scale)\nbands: 95% document-bootstrap CI per seed", fontsize=9)
    return _png(fig, ax)


def _plot_variance(res: dict) -> bytes:
    fig, ax = _figure((6, 4))
    v = next(iter(res["seeds"].values()))  # the first seed's measurements
    for probe, marker in (("rademacher", "o"), ("ternary", "s")):
        rows = [r for r in v["fixed"] if r["probe"] == probe]
        ax.plot(
            [r["n_blocks"] for r in rows],
            [r["reduction"] for r in rows],
            marker=marker,
            ls="",
            label=f"measured, {probe} probes",
        )
    rad = [r for r in v["fixed"] if r["probe"] == "rademacher"]
    ax.plot([r["n_blocks"] for r in rad], [1 / r["predicted_ratio"] for r in rad], "k--", label="(M-1)/(M/N-1)")
    if "model" in v:
        ax.plot([v["model"]["n_blocks"]], [v["model"]["reduction"]], "r*", ms=12, label="measured, real experts")
    ax.set_xlabel("N (blocks / experts)")
    ax.set_ylabel("variance reduction: shared / independent")
    ax.set_title("Relative variance of SPSA: shared loss / independent loss", fontsize=9)
    return _png(fig, ax)


# -- variance experiment ----------------------------------------------------------------------------------
def variance_table(res: dict) -> str:
    lines = [
        "| seed | objective | probes | N | M | relative variance, independent | shared | reduction measured "
        "| predicted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for seed, v in res["seeds"].items():
        rows = [("fixed separable", r) for r in v["fixed"]] + (
            [("real experts (seed init.)", v["model"])] if "model" in v else []
        )
        for what, r in rows:
            lines.append(
                f"| {seed} | {what} | {r['probe']} | {r['n_blocks']} | {r['params']:,} | "
                f"{r['rel_var_independent']:.1f} | "
                f"{r['rel_var_shared']:.1f} | {r['reduction']:.2f}x | {r['predicted_reduction']:.2f}x |"
            )
    return "\n".join(lines)


# -- assembly ---------------------------------------------------------------------------------------------
def figures(res: dict) -> dict[str, bytes]:
    if res["kind"] == "variance":
        return {"variance.png": _plot_variance(res)}
    return {
        "loss_vs_gpu_hours.png": _plot_curves(
            res, "gpu_hours", "aggregate GPU-hours (seed included; on CPU: wall s x logical GPUs)"
        ),
        "loss_vs_forwards.png": _plot_curves(res, "forwards", "forward passes of B windows (seed included)"),
    }


def headline(res: dict) -> str:
    """The part of a report that also goes into the README: the question, the tables, the verdicts."""
    parts = [f"**Question.** {res['question']}", ""]
    if res["kind"] == "variance":
        parts += [
            variance_table(res),
            "",
            "Prediction: (M/N - 1)/(M - 1) for Rademacher probes; "
            "exactly 1/N for SOMA's ternary probes (E z^2 = E z^4 = 1/2). "
            "Paper: 3.19-4.64x lower at N = 4 on the model, 4.02x on a fixed objective.",
        ]
    else:
        parts += [results_table(res), ""]
        summary = seed_summary(res)
        parts += [summary, ""] if summary else []
        parts += [matched_forwards(res), "", *verdicts(res)]
    return "\n".join(parts)


def render(res: dict, figure_names: list[str]) -> str:
    pics = "\n".join(f"![{n}]({n})" for n in figure_names)
    what, seeds, wall = f"Experiment `{res['experiment']}`", ", ".join(res["seeds"]), f"{res['wall_seconds']:.0f} s"
    return f"""# {res["title"]} ({res["scale"]} scale)

{what}, overrides {res["overrides"] or "none"}, seeds {seeds}; this run's wall time
{wall}. Every arm is a campaign under this directory (s<seed>/<arm>/), trained by the same Driver, actors,
ledger and checkpoints as any campaign and evaluated with the paper's protocol: 1,025-byte windows, the 768 predictions
after a 256-byte prefix scored, FP64 reduction, 95% paired document bootstrap. GPU-hours are the ledger's (seed stage
included, evaluation not); on a CPU-only host a logical GPU's GPU-seconds are its wall seconds.

{headline(res)}

{pics}

{ZO_NOTE}
"""


def read_results(stores: list[Store], readme: str | None) -> list[dict]:
    """`soma report`'s inputs, each checked before any report is rewritten: the README (`--readme`) exists and its
    directory is writable, and every experiment directory is writable and holds results.json. Their results."""
    if readme:
        if not os.path.isfile(readme):
            raise SomaError(
                f"--readme {readme} is not a file; pass the README whose results section to rewrite "
                "(it must exist and hold one)"
            )
        try:
            Path(readme).read_text(encoding="utf-8")  # rewritten after the reports: read here, before them
        except UnicodeDecodeError as exc:
            raise SomaError(
                f"--readme {readme} is not UTF-8 text (byte {exc.start}); pass the project's README (markdown)"
            ) from None
    results = []
    for store in stores:  # every input read before any place is probed for writing (a probe changes its mtime)
        if not store.exists(RESULTS_FILE):
            marker = store.read_json(EXPERIMENT_FILE) if store.exists(EXPERIMENT_FILE) else {}
            raise not_an_experiment(store.url, store.listdir(""), marker.get("experiment"))
        results.append(store.read_json(RESULTS_FILE))
    if readme:
        require_writable_dir(os.path.dirname(os.path.abspath(readme)), what="the README's directory")
    for store in stores:
        store.check_writable()
    return results


def write_report(store: Store, res: dict) -> str:
    pngs = figures(res)
    for name, png in pngs.items():
        store.write_bytes(name, png)
    store.write_bytes("report.md", render(res, list(pngs)).encode())
    return f"{store.url}/report.md"


def readme_section(results: list[tuple[str, dict]]) -> str:
    """The README's results section: each experiment's headline, and where its full report is."""
    out = [BEGIN, "## Results (generated by `soma report`; numbers measured by `soma experiment`)", ""]
    for url, res in results:
        out += [
            f"### {res['title']} ({res['scale']} scale)",
            "",
            headline(res),
            "",
            f"Full report and figures: `{url}/report.md`.",
            "",
        ]
    out += [ZO_NOTE, END]
    return "\n".join(out)


def update_readme(path: str, section: str) -> None:
    """Replace the marked results block of README.md (or insert it before '## Layout'); nothing else changes."""
    text = Path(path).read_text(encoding="utf-8")
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: section, text, flags=re.S)
    elif "\n## Layout" in text:
        text = text.replace("\n## Layout", "\n" + section + "\n\n## Layout", 1)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    # beside it, then renamed: a disk that fills up mid-write leaves the old README whole, never a truncated one
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=temp_prefix())
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
