"""What `zerotron plan` prints and draws: the ranked table, the rejected layouts and why, and the
memory breakdown of the top candidates as a PNG."""

from __future__ import annotations

from collections import Counter

from .hardware import GIB, Hardware
from .search import Candidate

PARTS = ("params", "grads", "master_weights", "optimizer", "activations", "buffers")


def table(candidates: list[Candidate], hw: Hardware, top: int = 10, rejected: int = 5) -> str:
    fitting = [c for c in candidates if c.rejected is None]
    out = [c for c in candidates if c.rejected is not None]
    worst = sorted(out, key=lambda c: -c.tokens_per_s)[:rejected]
    w = max([58] + [len(c.layout.describe()) for c in fitting[:top] + worst])  # long layouts widen the column
    lines = [
        f"{len(candidates)} layouts costed, {len(fitting)} fit in {hw.memory_gib:g} GiB per GPU ({hw.name})",
        "",
        f"{'#':>3}  {'layout':<{w}} {'GiB/GPU':>8} {'host GiB':>8} {'tokens/s':>11} {'MFU':>6} {'step s':>8}",
    ]
    for i, c in enumerate(fitting[:top], 1):
        lines.append(
            f"{i:>3}  {c.layout.describe():<{w}} {c.memory['total'] / GIB:>8.1f} {c.memory['host'] / GIB:>8.1f}"
            f" {c.tokens_per_s:>11,.0f} {c.speed['mfu']:>6.1%} {c.speed['step_s']:>8.3f}"
        )
    if fitting:
        best = fitting[0]
        t = best.speed["time"]
        lines += [
            "",
            "best step, by part (s): " + ", ".join(f"{k} {v:.3f}" for k, v in t.items() if k != "total" and v),
            "best memory, by part (GiB): " + ", ".join(f"{k} {best.memory[k] / GIB:.2f}" for k in PARTS),
        ]
    if out:
        lines += ["", f"{len(out)} do not fit; the fastest of them:"]
        for c in worst:
            lines.append(f"     {c.layout.describe():<{w}} {c.rejected}")
        kinds = Counter("host memory" if "host" in c.rejected else "GPU memory" for c in out)
        lines.append("     (" + ", ".join(f"{n} short of {k}" for k, n in kinds.items()) + ")")
    return "\n".join(lines)


def pyplot():
    """matplotlib.pyplot drawing to files, or a RuntimeError with the fix (call it before the work)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            "--plot draws with matplotlib, which is not installed: pip install 'zerotron[plot]' "
            "(or matplotlib), or leave --plot out"
        ) from None
    return plt


def plot(candidates: list[Candidate], path: str, hw: Hardware, top: int = 6, title: str = "") -> None:
    """Stacked bars: each top candidate's memory per GPU by part, with the usable limit."""
    plt = pyplot()
    chosen = [c for c in candidates if c.rejected is None][:top] or candidates[:top]
    fig, ax = plt.subplots(figsize=(11, 5))
    labels = [
        f"#{i}\n" + "\n".join(c.layout.describe().split()) + f"\n{c.tokens_per_s:,.0f} tok/s\nMFU {c.speed['mfu']:.0%}"
        for i, c in enumerate(chosen, 1)
    ]
    bottom = [0.0] * len(chosen)
    for part in PARTS:
        values = [c.memory[part] / GIB for c in chosen]
        ax.bar(range(len(chosen)), values, bottom=bottom, label=part.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(
        hw.memory_gib - hw.reserve_gib,
        color="black",
        linestyle="--",
        linewidth=1,
        label=f"usable ({hw.memory_gib - hw.reserve_gib:g} GiB)",
    )
    ax.set_xticks(range(len(chosen)), labels, fontsize=7)
    ax.set_ylabel("GiB per GPU")
    ax.set_title(title or f"memory per GPU of the top layouts ({hw.name})", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
