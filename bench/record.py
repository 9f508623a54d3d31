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
ap.add_argument("--per-token", action="store_true",
                help="speedup from tokens/s (tok_s / peer_tok_s), for runs at different batch sizes")
a = ap.parse_args()
ours = json.load(open(a.ours))
peer = json.load(open(a.peer))
# The peer reports the figure to compare against as "peer_ms" (the faster variant where it
# times several); its other "peer_*" figures are kept in the record.
peer_ms = peer["peer_ms"]
record = {
    "bench": ours["bench"],
    "device": ours["device"],
    "ours_ms": round(ours["ours_ms"], 4),
    "peer": peer["peer"],
    "peer_ms": round(peer_ms, 4),
    "speedup": round(ours["tok_s"] / peer["peer_tok_s"] if a.per_token else peer_ms / ours["ours_ms"], 3),
    "date": datetime.date.today().isoformat(),
    "commit": a.commit,
}
for k, v in ours.items():
    if k not in record and k != "sweep":
        record[k] = round(v, 4) if isinstance(v, float) else v
for k, v in peer.items():
    if k.startswith("peer_") and k not in record:
        record[k] = round(v, 4) if isinstance(v, float) else v
if "peer_ms_zero_grads" in peer:
    record["speedup_vs_same_work"] = round(peer["peer_ms_zero_grads"] / ours["ours_ms"], 3)
with open(a.out, "a") as f:
    f.write(json.dumps(record) + "\n")
print(json.dumps(record))
