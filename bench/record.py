"""Joins a benchmark's JSON (ours) with its peer's JSON into one record line of
bench/results/<file>.jsonl (DESIGN.md section 8 fields plus the bench's own figures).

usage: record.py OURS.json PEER.json OUT.jsonl --commit HASH
"""
import argparse
import datetime
import json

ap = argparse.ArgumentParser()
ap.add_argument("ours")
ap.add_argument("peer")
ap.add_argument("out")
ap.add_argument("--commit", default="unknown")
a = ap.parse_args()
ours = json.load(open(a.ours))
peer = json.load(open(a.peer))
# Compare against the faster PyTorch variant (zero_grad(set_to_none=True) skips zeroing).
peer_ms = min(peer["peer_ms_zero_grads"], peer["peer_ms_set_to_none"])
record = {
    "bench": ours["bench"],
    "device": ours["device"],
    "ours_ms": round(ours["ours_ms"], 4),
    "peer": peer["peer"],
    "peer_ms": round(peer_ms, 4),
    "speedup": round(peer_ms / ours["ours_ms"], 3),
    "date": datetime.date.today().isoformat(),
    "commit": a.commit,
}
for k, v in ours.items():
    if k not in record and k != "sweep":
        record[k] = round(v, 4) if isinstance(v, float) else v
for k in ("peer_ms_zero_grads", "peer_ms_set_to_none", "peer_fused_adamw_only_ms"):
    record[k] = round(peer[k], 4)
record["speedup_vs_same_work"] = round(peer["peer_ms_zero_grads"] / ours["ours_ms"], 3)
with open(a.out, "a") as f:
    f.write(json.dumps(record) + "\n")
print(json.dumps(record))
