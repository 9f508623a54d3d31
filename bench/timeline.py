"""Draws the step timelines the trainer writes with logging.timeline_step (timeline_rank<R>.json,
one per rank): per rank a compute lane (the model's phases, the trainer's optimizer, and in grey
the compute stream's waits for the gradient and weight synchronisation) and a communication lane
(each collective or group from when it can start to its end), and prints each rank's summary from
the lanes as the trainer computes it (busy time is a lane's union; waits are not compute;
communication under compute is the overlap, the rest is exposed).

usage: timeline.py RUN_DIR [RUN_DIR...] --out PNG [--ranks 0,3]   (lanes per rank and run)
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
ap.add_argument("--ranks", help="comma-separated ranks to draw (default: all)")
a = ap.parse_args()
wanted = None if a.ranks is None else {int(r) for r in a.ranks.split(",")}



def union(spans):
    out = []
    for s, e in sorted(x for x in spans if x[1] > x[0]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


rows = []
for run in a.runs:
    for path in sorted(glob.glob(os.path.join(run, "timeline_rank*.json"))):
        t = json.load(open(path))
        if wanted is not None and t["rank"] not in wanted:
            continue
        label = f"ZeRO-{t['zero_stage']} rank {t['rank']}/{t['world']}"
        busy = union([(s, e) for n, s, e in t["compute"] if not n.startswith("wait")])
        talk = union([(s, e) for _, s, e in t["comm"]])
        under = sum(max(0.0, min(b1, t1) - max(b0, t0)) for b0, b1 in busy for t0, t1 in talk)
        comm_ms = sum(e - s for s, e in talk)
        print(f"{label}: step {t['step']} {t['step_ms']:.1f} ms, compute busy {sum(e - s for s, e in busy):.1f} ms, "
              f"communication {comm_ms:.1f} ms, under compute {under:.1f} ms, exposed {comm_ms - under:.1f} ms")
        rows.append((label, t))

colors = {"forward": "#4c72b0", "backward": "#55a868", "trainer": "#c44e52", "comm": "#8172b2", "gather": "#dd8452"}


def color(name, lane):
    if lane == "comm":
        return colors["gather"] if "gather" in name else colors["comm"]
    if name.startswith("wait"):
        return "#bbbbbb"
    if name == "optimizer":
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
ax.set_title("One training step per rank: compute (blue forward, green backward, red optimizer, grey waits for "
             "synchronisation) and communication (orange weight gathers, purple reductions)", fontsize=9)
fig.tight_layout()
fig.savefig(a.out, dpi=110)
print("wrote", a.out)
