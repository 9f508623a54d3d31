"""PyTorch peer for bench/attention_bench: torch.nn.functional.scaled_dot_product_attention with
is_causal=True and enable_gqa=True, restricted to the flash backend (it raises rather than fall back
to another one), bf16, on the same GPU and shapes. q, k, v are [B, T, H, hd] tensors viewed as
[B, H, T, hd], as a Hugging Face Qwen3 layer passes them. Times the forward and the forward +
backward through autograd (gradients reset, untimed, before each run) with CUDA events, median
after warm-up, and writes attention_forward_hd<D>.peer.json and
attention_forward_backward_hd<D>.peer.json into --out-dir. TFLOP/s use the same count as ours:
4 B Hq T^2 hd / 2 for the causal forward, 2.5 times that for the backward.
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def median_ms(work, warmup, reps, before=None):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(warmup + reps):
        if before is not None:
            before()
        start.record()
        work()
        stop.record()
        stop.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--q-heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out-dir", default=".")
    a = ap.parse_args()
    dev = torch.device("cuda")
    B, T, Hq, Hkv, D = a.batch, a.seq, a.q_heads, a.kv_heads, a.head_dim
    gen = torch.Generator(device=dev).manual_seed(0)

    def leaf(heads):
        x = torch.randn(B, T, heads, D, device=dev, dtype=torch.bfloat16, generator=gen)
        return x.requires_grad_(True)

    q_raw, k_raw, v_raw = leaf(Hq), leaf(Hkv), leaf(Hkv)
    dout = torch.randn(B, Hq, T, D, device=dev, dtype=torch.bfloat16, generator=gen)

    def attention():
        return F.scaled_dot_product_attention(q_raw.transpose(1, 2), k_raw.transpose(1, 2), v_raw.transpose(1, 2),
                                              is_causal=True, enable_gqa=True)

    def reset_grads():
        q_raw.grad = k_raw.grad = v_raw.grad = None

    def forward_backward():
        attention().backward(dout)

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        forward_ms = median_ms(attention, a.warmup, a.reps)
        both_ms = median_ms(forward_backward, a.warmup, a.reps, before=reset_grads)

    forward_flop = 4.0 * B * Hq * T * T * D / 2.0
    both_flop = 3.5 * forward_flop
    peer = f"torch {torch.__version__} SDPA flash backend (is_causal, enable_gqa)"
    device = torch.cuda.get_device_name()
    suffix = f"_hd{D}"
    for name, ms, flop in (("attention_forward", forward_ms, forward_flop),
                           ("attention_forward_backward", both_ms, both_flop)):
        record = {"bench": name + suffix, "device": device, "peer": peer, "peer_ms": ms,
                  "peer_tflops": flop / (ms * 1e-3) / 1e12}
        with open(f"{a.out_dir}/{name}{suffix}.peer.json", "w") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record))


if __name__ == "__main__":
    main()
