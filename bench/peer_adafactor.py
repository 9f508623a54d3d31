"""PyTorch peer for `optimizer_bench --optimizer adafactor`: torch.optim.Adafactor(foreach=True)
.step() over the Qwen3-0.6B parameter list with fp32 gradients, on the same GPU. Timed with CUDA
events, median after warm-up. Prints one JSON object.
"""
import argparse
import json

import torch

from peer_adamw import median_ms, qwen3_0_6b_shapes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    dev = torch.device("cuda")
    shapes = qwen3_0_6b_shapes()
    params = [torch.nn.Parameter(torch.randn(s, device=dev) * 0.02) for s, _ in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    decay = [p for p, (_, d) in zip(params, shapes) if d]
    no_decay = [p for p, (_, d) in zip(params, shapes) if not d]
    opt = torch.optim.Adafactor([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=1e-2, foreach=True)
    peer_ms = median_ms(opt.step, args.warmup, args.reps)
    print(json.dumps({
        "peer": f"torch {torch.__version__}: torch.optim.Adafactor(foreach=True).step()",
        "device": torch.cuda.get_device_name(),
        "peer_ms": peer_ms,
    }))


if __name__ == "__main__":
    main()
