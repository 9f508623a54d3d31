"""PyTorch peer for `bench/optimizer_bench --optimizer muon`: the same work over the Qwen3-0.6B
parameter list with fp32 gradients, on the same GPU:
    clip_grad_norm_(foreach=True); Muon(hidden matrices).step(); AdamW(fused=True, the rest).step();
    foreach copy into a bf16 model; zero_grad(set_to_none=False)
torch.optim.Muon as shipped (Newton-Schulz in bf16, one matrix at a time). Timed with CUDA events,
median after warm-up, fresh gradients written (untimed) before each step. Prints one JSON object.
"""
import json
import torch

from peer_adamw import qwen3_0_6b_tensors, time_steps, timing_args


def main():
    args = timing_args()
    shapes, params, model_bf16, grads = qwen3_0_6b_tensors(torch.device("cuda"))
    hidden = [p for p in params[1:] if p.ndim == 2]  # params[0]: the (tied) embedding
    hidden_ids = {id(p) for p in hidden}
    rest = [(p, d) for p, (_, d) in zip(params, shapes) if id(p) not in hidden_ids]
    muon = torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5)
    adamw = torch.optim.AdamW([{"params": [p for p, d in rest if d], "weight_decay": 0.1},
                               {"params": [p for p, d in rest if not d], "weight_decay": 0.0}],
                              lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    elements = sum(p.numel() for p in params)
    assert len(hidden) == 7 * 28 and elements == 596049920, (len(hidden), elements)
    peer_ms = time_steps(params, grads, model_bf16, [muon, adamw], False, args.warmup, args.reps)
    print(json.dumps({
        "peer": f"torch {torch.__version__}: clip_grad_norm_(foreach) + Muon + AdamW(fused) + foreach_copy_ bf16 + "
                "zero_grad",
        "device": torch.cuda.get_device_name(),
        "peer_ms": peer_ms,
        "elements": elements,
    }))


if __name__ == "__main__":
    main()
