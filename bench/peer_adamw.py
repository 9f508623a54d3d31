"""PyTorch peer for bench/optimizer_bench: the usual optimizer step over the Qwen3-0.6B
parameter list with fp32 gradients, on the same GPU:
    clip_grad_norm_(foreach=True); AdamW(fused=True).step(); foreach copy into a bf16 model;
    zero_grad()
Timed with CUDA events, median after warm-up, fresh gradients written (untimed) before each step.
zero_grad is timed both ways: set_to_none=False does the same work as ours (zeroes the
gradients); set_to_none=True (PyTorch's default) skips it. Prints one JSON object.
"""
import argparse
import json
import statistics

import torch


def qwen3_0_6b_shapes():
    hidden, layers, heads, kv, hd, ffn, vocab = 1024, 28, 16, 8, 128, 3072, 151936
    shapes = [((vocab, hidden), True)]
    for _ in range(layers):
        shapes += [((hidden,), False), ((heads * hd, hidden), True), ((kv * hd, hidden), True),
                   ((kv * hd, hidden), True), ((hidden, heads * hd), True), ((hd,), False), ((hd,), False),
                   ((hidden,), False), ((ffn, hidden), True), ((ffn, hidden), True), ((hidden, ffn), True)]
    shapes.append(((hidden,), False))
    return shapes


def median_ms(step, warmup, reps):
    """Median of `reps` CUDA-event timings of step() after `warmup` untimed calls."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(warmup + reps):
        start.record()
        step()
        stop.record()
        stop.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop))
    return statistics.median(times)


def qwen3_0_6b_tensors(dev):
    """The parameters (normal, std 0.02), their bf16 model copy and gradient buffers, per shape."""
    shapes = qwen3_0_6b_shapes()
    params = [torch.nn.Parameter(torch.randn(s, device=dev) * 0.02) for s, _ in shapes]
    model_bf16 = [p.detach().to(torch.bfloat16) for p in params]
    grads = [torch.empty_like(p) for p in params]
    return shapes, params, model_bf16, grads


def time_steps(params, grads, model_bf16, optimizers, set_to_none, warmup, reps):
    """Median ms of clip_grad_norm_ + every optimizer's step + the bf16 copy + zero_grad, with fresh
    gradients written (untimed) before each step."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(warmup + reps):
        for p, g in zip(params, grads):
            if p.grad is None:
                p.grad = g
            p.grad.normal_(0.0, 1e-3)
        start.record()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        for opt in optimizers:
            opt.step()
        torch._foreach_copy_(model_bf16, [p.detach() for p in params])
        for opt in optimizers:
            opt.zero_grad(set_to_none=set_to_none)
        stop.record()
        stop.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop))
    return statistics.median(times)


def timing_args(add_arguments=None):
    """--warmup (untimed steps) and --reps (timed steps, median reported), and what
    add_arguments(parser) adds."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    if add_arguments is not None:
        add_arguments(ap)
    return ap.parse_args()


def main():
    args = timing_args()
    shapes, params, model_bf16, grads = qwen3_0_6b_tensors(torch.device("cuda"))
    decay = [p for p, (_, d) in zip(params, shapes) if d]
    no_decay = [p for p, (_, d) in zip(params, shapes) if not d]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    elements = sum(p.numel() for p in params)
    assert len(params) == 310 and elements == 596049920, (len(params), elements)

    def run(set_to_none):
        return time_steps(params, grads, model_bf16, [opt], set_to_none, args.warmup, args.reps)

    same_work_ms = run(False)
    default_ms = run(True)

    # fused AdamW alone, for reference
    for p, g in zip(params, grads):
        p.grad = g
    fused_only_ms = median_ms(opt.step, args.warmup, args.reps)
    print(json.dumps({
        "peer": f"torch {torch.__version__}: clip_grad_norm_(foreach) + AdamW(fused) + foreach_copy_ bf16 + zero_grad",
        "device": torch.cuda.get_device_name(),
        "peer_ms": min(same_work_ms, default_ms),  # compared against: the faster variant
        "peer_ms_zero_grads": same_work_ms,
        "peer_ms_set_to_none": default_ms,
        "peer_fused_adamw_only_ms": fused_only_ms,
        "elements": elements,
    }))


if __name__ == "__main__":
    main()
