"""PyTorch peer for bench/e29a_bench: one E29a layer forward + backward by autograd, in bf16 (weights,
input and every activation), at the same shape on the same GPU. The equations are those of
models/e29a/layer.h, written step by step in plain torch:

  [x_t; z_t] = W_xz u_t                 (one product over all steps)
  a_r = softmax(scale * H h_{t-1});  r_t = a_r^T H
  h_t = tanh(x_t + W_h h_{t-1} + r_t + b_h)
  w_t = W_write h_t
  a_w = softmax(scale * H w_t);      H = (1 - a_w) * H + a_w w_t^T
  y_t = h_t * silu(z_t + r_t + h_t)

Variants: eager (the step loop in Python), and with --compile the step function under
torch.compile (the loop stays in Python: compiling 512 unrolled steps takes far longer than the
run). With --graph each variant is also captured in CUDA graphs
(torch.cuda.make_graphed_callables: one graph for the layer's forward, one for its backward), which
removes the host's launch cost of the 512-step loop: what a user who knows the recurrence is
launch-bound would run. A variant that fails (or a compile over --compile-budget seconds) is
reported with a note, not timed. Timed with CUDA events around the forward and the backward of
each iteration, median after warm-up. Prints one JSON object whose "peer_ms" is the fastest
variant.

usage: peer_e29a.py [--batch 64] [--slots 8] [--steps 512] [--dim 1024] [--compile] [--graph] > peer.json
       peer_e29a.py --self-check      (fp64 on the CPU against tests/fixtures/e29a/layer.json)
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def step(h, H, x_t, z_t, W_h, b_h, W_write, scale):
    a_r = torch.softmax(scale * torch.einsum("bnd,bd->bn", H, h), dim=-1)
    r = torch.einsum("bn,bnd->bd", a_r, H)
    h = torch.tanh(x_t + h @ W_h.T + r + b_h)
    w = h @ W_write.T
    a_w = torch.softmax(scale * torch.einsum("bnd,bd->bn", H, w), dim=-1)
    H = (1 - a_w).unsqueeze(-1) * H + a_w.unsqueeze(-1) * w.unsqueeze(1)
    y = h * F.silu(z_t + r + h)
    return h, H, y


def layer(u, W_xz, W_h, b_h, W_write, H_0, step_fn=step):
    batch, steps, dim = u.shape
    scale = 1.0 / math.sqrt(dim)
    xz = u @ W_xz.T
    x, z = xz[..., :dim], xz[..., dim:]
    h = torch.zeros(batch, dim, dtype=u.dtype, device=u.device)
    H = H_0.unsqueeze(0).expand(batch, -1, -1)
    ys = []
    for t in range(steps):
        h, H, y = step_fn(h, H, x[:, t], z[:, t], W_h, b_h, W_write, scale)
        ys.append(y)
    return torch.stack(ys, dim=1)


def make_inputs(batch, steps, dim, slots, device, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)

    def uniform(*shape, bound):
        return ((torch.rand(*shape, generator=g, device=device) * 2 - 1) * bound).to(dtype)

    inv = 1.0 / math.sqrt(dim)
    params = {
        "W_xz": uniform(2 * dim, dim, bound=math.sqrt(2.0) * inv),
        "W_h": uniform(dim, dim, bound=0.45 * math.sqrt(3.0) * inv),
        "b_h": uniform(dim, bound=0.1),
        "W_write": uniform(dim, dim, bound=math.sqrt(3.0) * inv),
        "H_0": uniform(slots, dim, bound=1.0),
    }
    u = uniform(batch, steps, dim, bound=1.0).requires_grad_(True)
    dy = uniform(batch, steps, dim, bound=1.0)
    for p in params.values():
        p.requires_grad_(True)
    return u, params, dy


ORDER = ("W_xz", "W_h", "b_h", "W_write", "H_0")


def layer_fn(step_fn):
    return lambda u, *weights: layer(u, *weights, step_fn)


def graphed(fn, u, params):
    """fn captured in two CUDA graphs (forward, backward) by torch.cuda.make_graphed_callables."""
    return torch.cuda.make_graphed_callables(fn, (u, *(params[k] for k in ORDER)))


def time_variant(fn, u, params, dy, warmup, iterations):
    start, mid, stop = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    fwd, bwd = [], []
    for i in range(warmup + iterations):
        for p in list(params.values()) + [u]:
            p.grad = None
        start.record()
        y = fn(u, *(params[k] for k in ORDER))
        mid.record()
        y.backward(dy)
        stop.record()
        stop.synchronize()
        if i >= warmup:
            fwd.append(start.elapsed_time(mid))
            bwd.append(mid.elapsed_time(stop))
    total = [f + b for f, b in zip(fwd, bwd)]
    return statistics.median(total), statistics.median(fwd), statistics.median(bwd)


def self_check():
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "tests", "fixtures", "e29a", "layer.json")
    with open(path) as f:
        fixture = json.load(f)
    cases = fixture["cases"] if isinstance(fixture, dict) and "cases" in fixture else fixture
    worst = 0.0
    for case in cases:
        b, t, d, n = case["batch"], case["steps"], case["dim"], case["slots"]
        shapes = {"u": (b, t, d), "W_xz": (2 * d, d), "W_h": (d, d), "b_h": (d,), "W_write": (d, d), "H_0": (n, d)}
        leaves = {k: torch.tensor(case[k], dtype=torch.float64).reshape(s).requires_grad_(True)
                  for k, s in shapes.items()}
        dy = torch.tensor(case["dy"], dtype=torch.float64).reshape(b, t, d)
        y = layer(leaves["u"], leaves["W_xz"], leaves["W_h"], leaves["b_h"], leaves["W_write"], leaves["H_0"])
        y.backward(dy)
        pairs = [(y, case["y"])] + [(leaves[k].grad, case["grad_" + k]) for k in shapes]
        for got, want in pairs:
            want = torch.tensor(want, dtype=torch.float64).reshape(got.shape)
            worst = max(worst, float((got.detach() - want).norm() / max(float(want.norm()), 1e-300)))
    print(f"self-check: {len(cases)} fixture cases, worst normwise relative error {worst:.3e}")
    return 0 if worst < 1e-10 else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="also time the step under torch.compile")
    ap.add_argument("--graph", action="store_true", help="also time each variant captured in CUDA graphs")
    ap.add_argument("--compile-budget", type=float, default=150.0, help="seconds allowed for compiling")
    ap.add_argument("--self-check", action="store_true")
    a = ap.parse_args()
    if a.self_check:
        return self_check()

    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    dev = torch.device("cuda")
    u, params, dy = make_inputs(a.batch, a.steps, a.dim, a.slots, dev, torch.bfloat16)
    eager_ms, eager_fwd, eager_bwd = time_variant(layer_fn(step), u, params, dy, a.warmup, a.iterations)
    tokens = a.batch * a.steps
    out = {
        "bench": f"e29a_layer_fwd_bwd_d{a.dim}_t{a.steps}_b{a.batch}_n{a.slots}",
        "device": torch.cuda.get_device_name(),
        "peer": "torch eager bf16",
        "peer_ms": eager_ms,
        "peer_ms_eager": eager_ms,
        "peer_fwd_ms_eager": eager_fwd,
        "peer_bwd_ms_eager": eager_bwd,
        "peer_torch": torch.__version__,
    }

    def consider(name, label, fn):
        ms, f, b = time_variant(fn, u, params, dy, a.warmup, a.iterations)
        out.update({f"peer_ms_{name}": ms, f"peer_fwd_ms_{name}": f, f"peer_bwd_ms_{name}": b})
        if ms < out["peer_ms"]:
            out["peer"] = label
            out["peer_ms"] = ms

    def attempt(name, what):
        try:
            what()
        except Exception as e:  # a variant that fails is reported, not fatal
            out[f"peer_{name}_note"] = f"{type(e).__name__}: {str(e)[:200]}"

    compiled = None
    if a.compile:
        def compile_step():
            nonlocal compiled
            candidate = torch.compile(step, dynamic=False)
            began = time.time()
            # One short run compiles forward and backward; give up beyond the budget.
            y = layer(u[:, :2], *(params[k] for k in ORDER), candidate)
            y.backward(dy[:, :2])
            torch.cuda.synchronize()
            compile_s = time.time() - began
            out["peer_compile_s"] = compile_s
            if compile_s > a.compile_budget:
                raise RuntimeError(f"compiling took {compile_s:.0f} s, over the budget: not timed")
            compiled = candidate
            consider("compile", "torch.compile(step) bf16", layer_fn(compiled))

        attempt("compile", compile_step)
    if a.graph:
        attempt("graph_eager", lambda: consider("graph_eager", "torch eager bf16, CUDA graphs",
                                                graphed(layer_fn(step), u, params)))
        if compiled is not None:
            attempt("graph_compile", lambda: consider("graph_compile", "torch.compile(step) bf16, CUDA graphs",
                                                      graphed(layer_fn(compiled), u, params)))
    out["peer_tok_s"] = tokens / (out["peer_ms"] * 1e-3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
