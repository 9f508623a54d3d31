"""Turns bench/scaling.sh's raw lines into bench/results/scaling.jsonl records: per preset and
optimizer, each multi-GPU case against the 1-GPU case of the same run (the peer), with tokens/s
per GPU, scaling efficiency, exposed communication per step (step time at N GPUs minus at 1, the
per-GPU work being equal) and the memory per GPU of the slab and optimizer against the ZeRO formula.
With --plan-out, one record per case (and per refused case of --failed) of `trainer --plan`'s total
against the per-GPU peak nvidia-smi saw during the run.

usage: record_scaling.py RAW.jsonl OUT.jsonl --device NAME --commit HASH [--plan-out PLAN.jsonl [--failed F.jsonl]]
"""
import argparse
import datetime
import json

ap = argparse.ArgumentParser()
ap.add_argument("raw")
ap.add_argument("out")
ap.add_argument("--device", required=True)
ap.add_argument("--commit", default="unknown")
ap.add_argument("--plan-out")
ap.add_argument("--failed")
a = ap.parse_args()
rows = [json.loads(l) for l in open(a.raw)]
TOKENS_PER_GPU = 8 * 2048
GIB = 1024.0 ** 3
# Bytes per parameter of the optimizer state (AdamW: two fp32 moments).
STATE_BYTES = {"adamw": 8.0, "adamw8bit": 2.0 + 8.0 / 256}

with open(a.out, "a") as out:
    for r in rows:
        if r["gpus"] == 1:
            continue
        base = next((b for b in rows if b["gpus"] == 1 and b["preset"] == r["preset"]
                     and b["optimizer"] == r["optimizer"]), None)
        if base is None:
            continue
        n, stage = r["gpus"], r["zero_stage"]
        per_gpu = r["tok_s"] / n
        step_ms = TOKENS_PER_GPU * n / r["tok_s"] * 1e3
        base_ms = TOKENS_PER_GPU / base["tok_s"] * 1e3
        # Slab elements from the 1-GPU weights term: mirror 2 B + master 4 B per element.
        elements = base["weights_gib"] * GIB / 6.0
        formula = {"weights": 2 * elements + 4 * elements / (n if stage >= 1 else 1),
                   "grads": 4 * elements / (n if stage >= 2 else 1)}
        measured = (r["weights_gib"] + r["grads_gib"] + r["state_gib"]) * GIB
        record = {
            "bench": f"{r['preset']} data-parallel scaling, ZeRO-{stage}, {r['optimizer']}",
            "device": a.device,
            "ours_ms": round(step_ms, 3),
            "peer": "the same trainer on 1 GPU (same per-GPU batch)",
            "peer_ms": round(base_ms, 3),
            "speedup": round(r["tok_s"] / base["tok_s"], 3),
            "date": datetime.date.today().isoformat(),
            "commit": a.commit,
            "gpus": n,
            "zero_stage": stage,
            "tok_s": round(r["tok_s"], 1),
            "tok_s_per_gpu": round(per_gpu, 1),
            "tok_s_1gpu": round(base["tok_s"], 1),
            "scaling_efficiency": round(per_gpu / base["tok_s"], 4),
            "exposed_comm_ms": round(step_ms - base_ms, 3),
            "mfu": round(r["mfu"], 4),
            "memory_gib_per_gpu": round(r["memory_gib"], 2),
            "slab_state_gib_per_gpu": round(measured / GIB, 3),
        }
        if "peak_gib" in r:
            record["peak_gib_per_gpu"] = r["peak_gib"]
            record["plan_gib_per_gpu"] = r["plan_gib"]
        if r["optimizer"] in STATE_BYTES:
            formula["state"] = STATE_BYTES[r["optimizer"]] * elements / (n if stage >= 1 else 1)
            total = sum(formula.values())
            record["formula_gib_per_gpu"] = round(total / GIB, 3)
            record["vs_formula"] = round(measured / total - 1, 4)
        out.write(json.dumps(record) + "\n")
        print(json.dumps(record))

if a.plan_out:
    failed = [json.loads(l) for l in open(a.failed)] if a.failed else []
    with open(a.plan_out, "a") as out:
        for r in [r for r in rows if "peak_gib" in r] + failed:
            ran = "exit" not in r
            record = {
                "bench": f"{r['preset']} memory plan vs measured peak, {r['gpus']} GPU(s), ZeRO-{r['zero_stage']}",
                "device": a.device,
                "date": datetime.date.today().isoformat(),
                "commit": a.commit,
                "preset": r["preset"], "gpus": r["gpus"], "zero_stage": r["zero_stage"],
                "optimizer": r["optimizer"], "overrides": r.get("extra", ""),
                "plan_gib": r["plan_gib"], "peak_gib": r["peak_gib"],
                "ran": ran, "exit": r.get("exit", 0),
            }
            if ran and r["peak_gib"] > 0 and r["plan_gib"] == r["plan_gib"]:
                record["plan_vs_peak"] = round(r["plan_gib"] / r["peak_gib"] - 1, 4)
            out.write(json.dumps(record) + "\n")
            print(json.dumps(record))
