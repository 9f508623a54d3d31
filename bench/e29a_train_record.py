#!/usr/bin/env python3
"""Summarises training runs into a results file (default: the E29a upstream configs' runs into
bench/results/e29a_train.jsonl; one line per run: final and lowest validation loss, the largest
logged gradient norm over the run's median, the median logged tokens/s and the last logged
elapsed time) and draws their validation curves into one PNG.

usage: e29a_train_record.py --device NAME --commit SHA --png OUT.png CONFIG=METRICS.jsonl ...
       [--bench NAME --output RESULTS.jsonl --title TITLE]   (bench/muon_quality.sh uses these)
       [--params CONFIG=COUNT ... --setup CONFIG=TEXT ...]   (bench/e29a_quality.sh: each run's
       parameter count and how it was launched)
(matplotlib is needed for --png only.)"""
import argparse
import datetime
import json
import statistics


def summarise(config, path):
    grad_norms, val, rates = [], [], []
    last_step, elapsed = 0, None
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            step = record.get("step", 0)
            if "grad_norm" in record and record["grad_norm"] is not None:
                grad_norms.append(record["grad_norm"])
                last_step = max(last_step, step)
            if record.get("tokens_per_s") is not None:
                rates.append(record["tokens_per_s"])
            if record.get("elapsed_s") is not None:
                elapsed = record["elapsed_s"]
            if record.get("val_loss") is not None:
                val.append((step, record["val_loss"]))
    median = statistics.median(grad_norms)
    return {
        "config": config,
        "steps": last_step,
        "final_val_loss": val[-1][1],
        "min_val_loss": min(v for _, v in val),
        "max_grad_norm_over_median": max(grad_norms) / median,
        "median_grad_norm": median,
        "max_grad_norm": max(grad_norms),
        "tokens_per_s": statistics.median(rates) if rates else None,
        "elapsed_s": elapsed,
    }, val


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", required=True)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--png")
    parser.add_argument("--output", default="bench/results/e29a_train.jsonl")
    parser.add_argument("--bench", default="e29a_train")
    parser.add_argument("--title", default="E29a upstream configs")
    parser.add_argument("--params", action="append", default=[], help="CONFIG=COUNT: the run's parameter count")
    parser.add_argument("--setup", action="append", default=[], help="CONFIG=TEXT: how the run was launched")
    parser.add_argument("runs", nargs="+", help="CONFIG=METRICS.jsonl")
    args = parser.parse_args()
    params = dict(item.split("=", 1) for item in args.params)
    setups = dict(item.split("=", 1) for item in args.setup)
    curves = []
    with open(args.output, "a") as out:
        for run in args.runs:
            config, path = run.split("=", 1)
            summary, val = summarise(config, path)
            if config in params:
                summary["parameters"] = int(params[config])
            if config in setups:
                summary["setup"] = setups[config]
            summary.update({"bench": args.bench, "device": args.device, "commit": args.commit,
                            "date": datetime.date.today().isoformat()})
            out.write(json.dumps(summary) + "\n")
            print(json.dumps(summary))
            curves.append((config, val))
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for config, val in curves:
            ax.plot([s for s, _ in val], [v for _, v in val], marker=".", label=config)
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats per byte)")
        ax.set_title(f"{args.title}, {args.device}, commit {args.commit}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png)


if __name__ == "__main__":
    main()
