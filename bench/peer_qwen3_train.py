"""PyTorch peer for the Qwen3 training-step benchmark: transformers Qwen3ForCausalLM (random init
from the Qwen3-0.6B config) with fp32 master weights, bf16 autocast, SDPA attention, fused
AdamW and gradient clipping, on random tokens. With --compile the model (forward and loss) runs
under torch.compile (the strongest setup a user of transformers would run; the compile is
warm-up, not timed). Prints one JSON object with tokens/s, MFU (6N + 6*L*H*hd*T FLOPs per token
against 989 TFLOP/s dense bf16), peak memory and, compiled, the compile time.

usage: peer_qwen3_train.py [--batch 8] [--seq 2048] [--steps 10] [--warmup 3] [--compile]
"""
import argparse
import json
import statistics
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

PEAK_FLOPS = 989e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="run the model under torch.compile")
    a = ap.parse_args()
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=40960)
    config._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(config).cuda().float()
    n_params = sum(p.numel() for p in model.parameters())
    step_model = torch.compile(model) if a.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    ids = torch.randint(0, config.vocab_size, (a.batch, a.seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    first_step_s = None
    for i in range(a.warmup + a.steps):
        wall = time.time()
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stop.record()
        stop.synchronize()
        if i == 0:
            first_step_s = time.time() - wall
        if i >= a.warmup:
            times.append(start.elapsed_time(stop))
    ms = statistics.median(times)
    tokens = a.batch * a.seq
    flops_per_token = 6 * n_params + 6 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * a.seq
    tok_s = tokens / (ms / 1e3)
    print(json.dumps({
        "peer": f"transformers Qwen3ForCausalLM, torch {torch.__version__}: fp32 master, bf16 autocast, SDPA, "
                f"AdamW(fused), clip" + (", torch.compile(model)" if a.compile else ""),
        "first_step_s": first_step_s,
        "device": torch.cuda.get_device_name(),
        "peer_ms": ms, "peer_tok_s": tok_s, "peer_mfu": tok_s * flops_per_token / PEAK_FLOPS,
        "peer_peak_gib": torch.cuda.max_memory_allocated() / 2**30, "batch": a.batch, "seq": a.seq,
        "params": n_params,
    }))


if __name__ == "__main__":
    main()
