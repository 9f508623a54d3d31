"""Joins an optimizer_bench JSON (ours, e.g. --optimizer adamw8bit) with optimizer_bench's fp32
AdamW JSON from the same run into one record line of bench/results/<file>.jsonl: the peer is our
own fp32 AdamW step (DESIGN.md section 8 fields plus the bench's own figures).

usage: record_vs_adamw.py OURS.json ADAMW.json OUT.jsonl --commit HASH
"""
import argparse
import datetime
import json

ap = argparse.ArgumentParser()
ap.add_argument("ours")
ap.add_argument("adamw")
ap.add_argument("out")
ap.add_argument("--commit", default="unknown")
a = ap.parse_args()
ours = json.load(open(a.ours))
adamw = json.load(open(a.adamw))
if adamw["bench"] != "adamw_step" or adamw["device"] != ours["device"]:
    raise SystemExit(f"record_vs_adamw: {a.adamw} is not an adamw_step run on {ours['device']}")
record = {
    "bench": ours["bench"],
    "device": ours["device"],
    "ours_ms": round(ours["ours_ms"], 4),
    "peer": "ours adamw (fp32 state)",
    "peer_ms": round(adamw["ours_ms"], 4),
    "speedup": round(adamw["ours_ms"] / ours["ours_ms"], 3),
    "date": datetime.date.today().isoformat(),
    "commit": a.commit,
    "gbps": round(ours["gbps"], 1),
    "state_bytes_per_param": round(ours["state_bytes_per_param"], 4),
    "peer_gbps": round(adamw["gbps"], 1),
    "peer_state_bytes_per_param": round(adamw["state_bytes_per_param"], 4),
}
for k, v in ours.items():
    if k not in record and k != "sweep":
        record[k] = round(v, 4) if isinstance(v, float) else v
with open(a.out, "a") as f:
    f.write(json.dumps(record) + "\n")
print(json.dumps(record))
