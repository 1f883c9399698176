"""PNG figures for the measurement reports (matplotlib, no screen needed)."""

from __future__ import annotations

from pathlib import Path

from specdecode.analysis import expected_tokens, optimal_gamma, walltime_improvement


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_alpha(results: list[dict], drafts: list[str], path: str) -> Path:
    """Grouped bars: α (paper's way, 95% interval) per task × temperature, one bar per draft."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(results)), 4))
    width = 0.8 / len(drafts)
    for j, draft in enumerate(drafts):
        xs, ys, errs = [], [], [[], []]
        for i, r in enumerate(results):
            entry = r["paper"].get(draft)
            if entry is None:
                continue
            xs.append(i + j * width)
            ys.append(entry["alpha"])
            low, high = entry["ci95"]
            errs[0].append(max(entry["alpha"] - low, 0) if low == low else 0)
            errs[1].append(max(high - entry["alpha"], 0) if high == high else 0)
        ax.bar(xs, ys, width, yerr=errs, label=draft, capsize=2)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))],
                  [f"{r['task']}\nT={r['temperature']:g}" for r in results])
    ax.set_ylabel("α (mean Σ min(p, q))")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("Acceptance rate α per task and draft (paper Table 3's measure)")
    return _save(fig, path)


def plot_speedup_vs_gamma(points: list[dict], path: str) -> Path:
    """Measured speedup vs γ, with Thm 3.8's prediction and the prediction corrected by r(γ+1).
    points: dicts with gamma, measured, predicted, predicted_corrected."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    gammas = [p["gamma"] for p in points]
    ax.plot(gammas, [p["measured"] for p in points], "o-", label="measured")
    ax.plot(gammas, [p["predicted"] for p in points], "s--", label="Thm 3.8 (measured α, c)")
    ax.plot(gammas, [p["predicted_corrected"] for p in points], "^:", label="Thm 3.8 with r(γ+1)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("γ (num_speculative_tokens)")
    ax.set_ylabel("speedup over the target alone")
    ax.legend()
    ax.set_title("Speedup vs γ")
    return _save(fig, path)


def plot_expected_tokens(points: list[dict], path: str) -> Path:
    """Paper Fig. 2: Eq. 1's tokens per call vs α for several γ, with measured (α̂, tokens/call)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    alphas = [i / 100 for i in range(0, 100)]
    for gamma in sorted({p["gamma"] for p in points} | {1, 3, 5, 7}):
        line, = ax.plot(alphas, [expected_tokens(a, gamma) for a in alphas], lw=1, label=f"Eq. 1, γ={gamma}")
        measured = [p for p in points if p["gamma"] == gamma]
        if measured:
            ax.plot([p["alpha"] for p in measured], [p["tokens_per_call"] for p in measured], "o",
                    color=line.get_color())
    ax.set_xlabel("α")
    ax.set_ylabel("tokens per target call")
    ax.legend(fontsize=7)
    ax.set_title("Expected tokens per call (paper Fig. 2); dots: measured")
    return _save(fig, path)


def plot_optimal_gamma(alpha: float, c: float, path: str) -> Path:
    """Paper Fig. 3: the optimal γ vs α for several c, with this machine's (α, c) marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    alphas = [a / 100 for a in range(30, 96)]
    for cost in sorted({0.01, 0.05, 0.1, 0.2, 0.4, round(c, 3)}):
        usable = [a for a in alphas if a > cost]
        ax.plot(usable, [optimal_gamma(a, cost) for a in usable], lw=1, label=f"c={cost:g}")
    ax.plot([alpha], [optimal_gamma(alpha, c)], "k*", ms=12,
            label=f"measured α={alpha:.2f}, c={c:.2f}: γ*={optimal_gamma(alpha, c)}, "
                  f"{walltime_improvement(alpha, optimal_gamma(alpha, c), c):.2f}x")
    ax.set_yscale("log")
    ax.set_xlabel("α")
    ax.set_ylabel("optimal γ (Thm 3.8)")
    ax.legend(fontsize=7)
    ax.set_title("Optimal γ vs α (paper Fig. 3)")
    return _save(fig, path)


def _save(fig, path: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
