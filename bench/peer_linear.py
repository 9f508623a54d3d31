"""PyTorch peer for bench/linear_bench: times the same products on the same GPU in the same run
and appends one joined record per benchmark to a JSONL file (DESIGN.md section 8 fields plus
"tflops" (ours) and "peer_tflops").

    forward:        F.linear(x, W)                      (bf16 out)
    dgrad:          dy @ W                              (bf16 out)
    wgrad:          dy.t() @ x, bf16 out, as autograd computes a bf16 weight's gradient; ours
                    also adds into an fp32 gradient. Where this torch has torch.mm(out_dtype=),
                    the fp32-output product is timed too (peer_ms_fp32_out).
    cross_entropy:  F.cross_entropy(F.linear(h, W).float(), t) forward + backward (the usual
                    unfused loss: full bf16 logits, their fp32 copy and its gradient).

Timed with CUDA events around a batch of calls, median of the batches after warm-up. bf16
reduced-precision split-K reductions are switched off, as ours never reduces in bf16.

usage: peer_linear.py OURS.json OUT.jsonl --commit HASH
"""
import argparse
import datetime
import json
import statistics

import torch
import torch.nn.functional as F


def time_ms(fn, warmup, samples, batch):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(samples):
        start.record()
        for _ in range(batch):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / batch)
    return statistics.median(times)


def linear_peer(entry, args):
    dev = torch.device("cuda")
    n, k_in, k_out = entry["tokens"], entry["in"], entry["out"]
    x = torch.rand(n, k_in, device=dev, dtype=torch.bfloat16) * 2 - 1
    dy = torch.rand(n, k_out, device=dev, dtype=torch.bfloat16) * 2 - 1
    w = (torch.rand(k_out, k_in, device=dev, dtype=torch.bfloat16) * 2 - 1) * 0.03
    extra = {}
    if entry["pass"] == "forward":
        name, fn = "torch F.linear bf16", lambda: F.linear(x, w)
    elif entry["pass"] == "dgrad":
        name, fn = "torch.matmul(dy, W) bf16", lambda: torch.matmul(dy, w)
    else:
        dyt = dy.t()
        name, fn = "torch.matmul(dy.t(), x) bf16 out", lambda: torch.matmul(dyt, x)
        try:
            torch.mm(dyt[:8, :8], x[:8, :8], out_dtype=torch.float32)
            extra["peer_ms_fp32_out"] = time_ms(lambda: torch.mm(dyt, x, out_dtype=torch.float32),
                                                args.warmup, args.samples, args.batch)
        except (TypeError, RuntimeError):
            pass
    return name, time_ms(fn, args.warmup, args.samples, args.batch), extra


def cross_entropy_peer(entry, args):
    dev = torch.device("cuda")
    n, d, v = entry["tokens"], entry["in"], entry["out"]
    h = (torch.rand(n, d, device=dev, dtype=torch.bfloat16) * 2 - 1).requires_grad_()
    w = ((torch.rand(v, d, device=dev, dtype=torch.bfloat16) * 2 - 1) * 0.05).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev)

    def step():
        loss = F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100)
        loss.backward()
        h.grad = None
        w.grad = None

    ms = time_ms(step, 3, max(5, args.samples // 3), 1)
    peak = torch.cuda.max_memory_allocated() / 2**20
    return "torch F.linear + F.cross_entropy(float) fwd+bwd", ms, {"peer_peak_mib": peak}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ours")
    ap.add_argument("out")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--batch", type=int, default=10)
    args = ap.parse_args()
    ours = json.load(open(args.ours))
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    device = torch.cuda.get_device_name()
    with open(args.out, "a") as out:
        for entry in ours["results"]:
            if entry["pass"] == "cross_entropy":
                torch.cuda.reset_peak_memory_stats()
                peer, peer_ms, extra = cross_entropy_peer(entry, args)
            else:
                peer, peer_ms, extra = linear_peer(entry, args)
            flop = entry["tflops"] * entry["ours_ms"] * 1e-3 * 1e12
            record = {
                "bench": entry["bench"],
                "device": device,
                "ours_ms": round(entry["ours_ms"], 4),
                "peer": peer + " (torch " + torch.__version__ + ")",
                "peer_ms": round(peer_ms, 4),
                "speedup": round(peer_ms / entry["ours_ms"], 3),
                "date": datetime.date.today().isoformat(),
                "commit": args.commit,
                "tflops": round(entry["tflops"], 1),
                "peer_tflops": round(flop / (peer_ms * 1e-3) / 1e12, 1),
            }
            for key in ("tokens", "in", "out", "chunk_tokens", "workspace_mib", "tokens_per_s"):
                if key in entry:
                    record[key] = round(entry[key], 1) if isinstance(entry[key], float) else entry[key]
            for key in ("sweep_ms", "chunk_breakdown_ms"):
                if key in entry:
                    record[key] = {k: round(v, 4) for k, v in entry[key].items()}
            for key, value in extra.items():
                record[key] = round(value, 4)
            if "peer_ms_fp32_out" in extra:
                record["peer_tflops_fp32_out"] = round(flop / (extra["peer_ms_fp32_out"] * 1e-3) / 1e12, 1)
            out.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
