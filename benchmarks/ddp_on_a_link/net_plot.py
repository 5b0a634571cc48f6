"""bench_net.py's picture: step time bars of every engine per model and rate, with the floors."""

from __future__ import annotations

from benchlib.models import MODEL_TITLES


def plot(report: dict, path: str) -> None:
    """Step time bars of every engine per model and rate, with the compute, comm and floor lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(report["rates"])
    models = list(next(iter(report["rates"].values())))
    shown = ("local", "allreduce", "ddp", "ddp_gbv", "ours", "ddp_bf16", "ours_bf16")
    colors = ("tab:gray", "tab:olive", "tab:red", "tab:orange", "tab:blue", "tab:pink", "tab:cyan")
    fig, axes = plt.subplots(len(models), len(rates), figsize=(4.8 * len(rates), 3.2 * len(models)), squeeze=False)
    for col, rate in enumerate(rates):
        for row, name in enumerate(models):
            ax = axes[row][col]
            m = report["rates"][rate].get(name)
            if m is None:
                ax.set_visible(False)
                continue
            e, f = m["engines"], m["floors"]
            values = [e[k]["step_ms"]["median"] for k in shown]
            errors = [
                [e[k]["step_ms"]["median"] - e[k]["step_ms"]["q1"] for k in shown],
                [e[k]["step_ms"]["q3"] - e[k]["step_ms"]["median"] for k in shown],
            ]
            ax.bar(range(len(shown)), values, color=colors, yerr=errors, capsize=2)
            ax.set_xticks(range(len(shown)), [k.replace("_", "\n") for k in shown], fontsize=7)
            ax.axhline(f["fp32"]["floor_ms"], color="black", lw=1.2, label="floor fp32 (fwd + comm)")
            ax.axhline(f["fp32"]["comm_ms"], color="black", lw=1, ls=":", label="comm fp32 (S / rate)")
            ax.axhline(f["bf16"]["floor_ms"], color="tab:purple", lw=1, ls="--", label="floor bf16")
            ax.axhline(e["local"]["step_ms"]["median"], color="tab:gray", lw=1, ls="-.", label="compute (local)")
            ax.set_title(f"{MODEL_TITLES.get(name, name)} @ {rate}", fontsize=8)
            ax.set_ylabel("step ms", fontsize=8)
            ax.tick_params(axis="y", labelsize=7)
            if row == 0 and col == 0:
                ax.legend(fontsize=6)
    fig.suptitle("Two hosts (hostnet), gloo, 1 rank x 1 thread each:\nstep time (median, IQR) vs floors", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
