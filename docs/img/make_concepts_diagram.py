"""Draw docs/img/concepts.png: one round of one fragment, on a time line.

    python docs/img/make_concepts_diagram.py

Schematic, not measured: four learners (one on slower hardware, one that fails and
rejoins) send fragment p to the synchronizer, which waits for the quorum K = 2, keeps a
grace window open, merges what arrived and sends version v+1 back.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

OUT = Path(__file__).with_name("concepts.png")

SYNC_Y = 5.2
ROWS = {"learner 0": 3.5, "learner 1": 2.6, "learner 2 (slower)": 1.7, "learner 3": 0.8}
STEP_H = 0.42
UP, DOWN, GRACE, MERGE, FAIL = "#1f77b4", "#2ca02c", "#ffbf47", "#9467bd", "#d62728"
STEP, INFLIGHT = "#dde6f0", "#cfe8c9"


def steps(ax, y, start, end, width, *, shade=None):
    """Step boxes from ``start`` to ``end``; ``shade`` = (x0, x1): boxes starting in it are green."""
    x = start
    while x + width <= end + 1e-9:
        inflight = shade is not None and shade[0] - 1e-9 <= x < shade[1]
        ax.add_patch(Rectangle((x, y - STEP_H / 2), width, STEP_H, facecolor=INFLIGHT if inflight else STEP,
                               edgecolor="#8da2b8", lw=0.8, zorder=1))
        x += width


def arrow(ax, x0, y0, x1, y1, color, *, lw=1.8, ls="-"):
    ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=14, color=color,
                                 lw=lw, linestyle=ls, shrinkA=0, shrinkB=0, zorder=3))


def main() -> None:
    fig, ax = plt.subplots(figsize=(13, 6.8))
    ax.set_xlim(-2.6, 15.4)
    ax.set_ylim(-0.45, 6.6)
    ax.axis("off")
    top = SYNC_Y - 0.3

    # Synchronizer: fragment p's round on a time line.
    ax.add_patch(Rectangle((0, top), 14.8, 0.6, facecolor="#f3f0f8", edgecolor="#7f6f9f", lw=1))
    ax.text(-2.5, SYNC_Y, "synchronizer\nfragment p", va="center", fontsize=11, fontweight="bold")
    ax.text(0.15, SYNC_Y, "version v: collecting contributions", va="center", fontsize=10)
    ax.add_patch(Rectangle((5.75, top), 1.0, 0.6, facecolor=GRACE, edgecolor="none", alpha=0.9))
    ax.text(6.25, SYNC_Y, "grace\nwindow", va="center", ha="center", fontsize=8.5)
    ax.add_patch(Rectangle((6.75, top), 0.2, 0.6, facecolor=MERGE, edgecolor="none"))
    ax.text(7.1, SYNC_Y, "version v+1", va="center", fontsize=10)
    ax.annotate("Δ₀, Δ₁ arrived: quorum K = 2 reached,\nthe grace window opens; Δ₂ arrives\n"
                "inside it and is admitted", xy=(5.75, SYNC_Y + 0.3), xytext=(3.2, 6.05),
                fontsize=9.5, ha="center", va="center", arrowprops=dict(arrowstyle="-", color="0.3"))
    ax.annotate("the window ends: merge (token-weighted RDA\nof Δ₀, Δ₁, Δ₂), outer Nesterov step,\n"
                "version v+1 to every live learner", xy=(6.85, SYNC_Y + 0.3), xytext=(10.2, 6.05),
                fontsize=9.5, ha="center", va="center", arrowprops=dict(arrowstyle="-", color="0.3"))

    for name, y in ROWS.items():
        ax.text(-2.5, y, name, va="center", fontsize=10.5)

    # Learners 0 and 1 take 1 s steps; learner 2 is 18% slower. Green: steps taken while the
    # learner's fragment p is in flight.
    steps(ax, ROWS["learner 0"], 0, 14, 1.0, shade=(5.0, 7.25))
    steps(ax, ROWS["learner 1"], 0.45, 14, 1.0, shade=(5.45, 7.65))
    steps(ax, ROWS["learner 2 (slower)"], 0.35, 14, 1.15, shade=(6.1, 8.05))
    # Learner 3 trains, fails, is down, rejoins.
    y3 = ROWS["learner 3"]
    steps(ax, y3, 0.4, 4.4, 1.0)
    ax.plot([4.55], [y3], marker="x", color=FAIL, markersize=13, mew=3, zorder=4)
    ax.plot([4.75, 11.85], [y3, y3], color=FAIL, lw=1.5, ls=":")
    ax.text(4.75, y3 + 0.33, "fails: work not yet sent is lost; rounds close without it",
            fontsize=9, color=FAIL)
    steps(ax, y3, 12.8, 14.8, 1.0)

    # Contributions of fragment p going up, the new version going down.
    for name, (sent, arrived) in {"learner 0": (5.0, 5.3), "learner 1": (5.45, 5.75),
                                  "learner 2 (slower)": (6.1, 6.4)}.items():
        arrow(ax, sent, ROWS[name] + STEP_H / 2, arrived, top, UP)
    ax.text(4.85, 4.25, "Δ = anchor − θ of fragment p\n(int4, with tokens and steps)",
            fontsize=9, color=UP, ha="right", va="center")
    for (name, y), end in zip(list(ROWS.items())[:3], (7.25, 7.65, 8.05)):
        arrow(ax, 6.95, top, end, y + STEP_H / 2, DOWN)
    ax.text(7.7, 4.25, "update to version v+1 (int4); the learner\nmixes it in: θ ← α·θ + (1−α)·Θ",
            fontsize=9, color=DOWN, ha="left", va="center")

    # Rejoin: Join up, the full state down.
    arrow(ax, 12.0, y3 + STEP_H / 2, 12.3, top, UP, ls="--", lw=1.4)
    arrow(ax, 12.45, top, 12.75, y3 + STEP_H / 2, DOWN, ls="--", lw=1.4)
    ax.text(12.9, y3 + 0.3, "restarted: Join,\nreceives the full state", fontsize=9, va="bottom")

    # Legend.
    ax.add_patch(Rectangle((0.0, -0.05), 0.5, 0.26, facecolor=STEP, edgecolor="#8da2b8", lw=0.8))
    ax.text(0.62, 0.08, "inner AdamW step on the learner's own data", va="center", fontsize=9)
    ax.add_patch(Rectangle((5.9, -0.05), 0.5, 0.26, facecolor=INFLIGHT, edgecolor="#8da2b8", lw=0.8))
    ax.text(6.52, 0.08, "step taken while its fragment p is in flight (about τ): nobody waits",
            va="center", fontsize=9)
    ax.text(0.0, -0.33, "One fragment shown. Each learner sends fragment p every H steps; the P fragments are "
            "staggered over the period, so about P/H fragments leave per step.", va="center", fontsize=9,
            color="0.3")

    fig.tight_layout()
    fig.savefig(OUT, dpi=100)
    plt.close(fig)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
