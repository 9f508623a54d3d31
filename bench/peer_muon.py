"""PyTorch peer for `bench/optimizer_bench --optimizer muon`: the same work over the Qwen3-0.6B
parameter list with fp32 gradients, on the same GPU:
    clip_grad_norm_(foreach=True); Muon(hidden matrices).step(); AdamW(fused=True, the rest).step();
    foreach copy into a bf16 model; zero_grad(set_to_none=False)
torch.optim.Muon as shipped (Newton-Schulz in bf16, one matrix at a time). Timed with CUDA events,
median after warm-up, fresh gradients written (untimed) before each step. Prints one JSON object.

--compile: Muon's update of each matrix (momentum, torch's own Newton-Schulz function, decay and
step; torch.optim.Muon's _single_tensor_muon body) runs as one torch.compile'd function, compiled
once per matrix shape (five for Qwen3-0.6B), so Inductor fuses the elementwise work around the
products. AdamW is already one fused kernel and the clipping and copy are foreach calls, so they
stay as they are. The compilation happens in an untimed first step (its time is reported as
peer_compile_s), before the usual warm-up.
"""
import inspect
import json
import time

import torch
import torch.optim._muon as torch_muon

from peer_adamw import qwen3_0_6b_tensors, time_steps, timing_args

# torch versions differ in the Newton-Schulz function's trailing arguments: pass what this one takes.
NEWTON_SCHULZ_ARGS = len(inspect.signature(torch_muon._zeropower_via_newtonschulz).parameters) - 1


def matrix_update(param, grad, buf, lr, weight_decay, momentum, nesterov, ns_args, adjusted_lr):
    """torch.optim.Muon's update of one matrix (its _single_tensor_muon loop body)."""
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if nesterov else buf
    update = torch_muon._zeropower_via_newtonschulz(update, *ns_args)
    param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-adjusted_lr)


class CompiledMuon:
    """The step of a torch.optim.Muon (its parameter groups and state) with matrix_update compiled."""

    def __init__(self, muon, mode):
        self.muon = muon
        # No fullgraph: a graph break in a later torch version still runs, in pieces.
        self.update = torch.compile(matrix_update, mode=mode, dynamic=False)

    @torch.no_grad()
    def step(self):
        for group in self.muon.param_groups:
            ns_args = (group["ns_coefficients"], group["ns_steps"], group["eps"],
                       group.get("use_addmm", False))[:NEWTON_SCHULZ_ARGS]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.muon.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                adjusted_lr = torch_muon._adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape)
                self.update(p, p.grad, state["momentum_buffer"], group["lr"], group["weight_decay"],
                            group["momentum"], group["nesterov"], ns_args, adjusted_lr)

    def zero_grad(self, set_to_none=True):
        self.muon.zero_grad(set_to_none=set_to_none)


def add_arguments(ap):
    ap.add_argument("--compile", action="store_true", help="each matrix's Muon update under torch.compile")
    ap.add_argument("--compile-mode", default="default",
                    help="torch.compile mode (default, max-autotune-no-cudagraphs, ...)")


def main():
    args = timing_args(add_arguments)
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
    peer = f"torch {torch.__version__}: clip_grad_norm_(foreach) + Muon + AdamW(fused) + foreach_copy_ bf16 + zero_grad"
    result = {}
    if args.compile:
        # Every matrix shape compiles once; allow more recompilations than the shapes need.
        limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
        muon = CompiledMuon(muon, args.compile_mode)
        for p, g in zip(params, grads):
            p.grad = g
            p.grad.normal_(0.0, 1e-3)
        torch.cuda.synchronize()
        start = time.perf_counter()
        muon.step()  # compiles
        torch.cuda.synchronize()
        result["peer_compile_s"] = time.perf_counter() - start
        peer = peer.replace("Muon", f"Muon (each matrix's update torch.compile'd, mode {args.compile_mode})", 1)
    peer_ms = time_steps(params, grads, model_bf16, [muon, adamw], False, args.warmup, args.reps)
    print(json.dumps({
        "peer": peer,
        "device": torch.cuda.get_device_name(),
        "peer_ms": peer_ms,
        "elements": elements,
        **result,
    }))


if __name__ == "__main__":
    main()
