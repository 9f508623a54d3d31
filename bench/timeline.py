"""Draws the step timelines the trainer writes with logging.timeline_step (timeline_rank<R>.json,
one per rank): per rank a compute lane (the model's phases; the trainer's gradient sync,
optimizer and weight sync) and a communication lane (each collective or group from when it can
start to its end), and prints each rank's summary (communication busy, under compute, exposed).

usage: timeline.py RUN_DIR [RUN_DIR...] --out PNG      (one row of lanes per rank and run)
"""
import argparse
import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("runs", nargs="+")
ap.add_argument("--out", required=True)
a = ap.parse_args()

rows = []
for run in a.runs:
    for path in sorted(glob.glob(os.path.join(run, "timeline_rank*.json"))):
        t = json.load(open(path))
        label = f"ZeRO-{t['zero_stage']} rank {t['rank']}/{t['world']}"
        s = t["summary"]
        print(f"{label}: step {t['step']} {t['step_ms']:.1f} ms, compute busy {s['compute_busy_ms']:.1f} ms, "
              f"communication {s['comm_busy_ms']:.1f} ms, under compute {s['comm_under_compute_ms']:.1f} ms, "
              f"exposed {s['comm_exposed_ms']:.1f} ms")
        rows.append((label, t))

colors = {"forward": "#4c72b0", "backward": "#55a868", "trainer": "#c44e52", "comm": "#8172b2", "gather": "#dd8452"}


def color(name, lane):
    if lane == "comm":
        return colors["gather"] if "gather" in name else colors["comm"]
    if name in ("gradient sync", "optimizer", "weight sync"):
        return colors["trainer"]
    return colors["backward"] if "bwd" in name else colors["forward"]


fig, ax = plt.subplots(figsize=(14, 0.9 * len(rows) + 1.2))
ticks, labels = [], []
for i, (label, t) in enumerate(rows):
    for j, lane in enumerate(("compute", "comm")):
        y = 2 * i + j
        spans = [(s, e - s) for _, s, e in t[lane]]
        ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=[color(n, lane) for n, _, _ in t[lane]], linewidth=0)
        ticks.append(y)
        labels.append(f"{label} {lane}")
ax.set_yticks(ticks)
ax.set_yticklabels(labels, fontsize=8)
ax.invert_yaxis()
ax.set_xlabel("ms from the step's start (CUDA events)")
ax.set_title("One training step per rank: compute (blue forward, green backward, red trainer) and "
             "communication (orange weight gathers, purple reductions)", fontsize=9)
fig.tight_layout()
fig.savefig(a.out, dpi=110)
print("wrote", a.out)
