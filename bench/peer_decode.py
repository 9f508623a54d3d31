"""PyTorch peer for the batch-1 decode benchmark (bench/decode_bench.cpp), Qwen3-0.6B shape with
random bf16 weights on one GPU.

The peer is what a careful user would run: a static KV cache (preallocated for the requested
length, as transformers' StaticCache) and one decode step (embedding, 28 layers with SDPA over
the cache, final norm, lm_head, argmax) captured once into a CUDA graph and replayed per token;
the position and the token live on the device, so nothing crosses to the host between tokens.
The model is written out here in plain torch, following transformers' modeling_qwen3 (RMSNorm in
fp32, q/k norms, rotate-half RoPE, GQA); --self-check compares its logits with
transformers' Qwen3ForCausalLM on the same weights (CPU is enough).

Figures: the median time of one replayed step at context 64 and 4096 (CUDA events around each
replay, after warm-up), and tokens/s of 256 greedy tokens after a 32-token prompt (the prompt fed
through the same graph; 255 timed replays give tokens 2..256, the first comes from the prompt's
last step). With --transformers, also transformers' own generate() (dynamic cache, eager) and,
with --transformers-static, generate() with the static cache and torch.compile(mode=
"reduce-overhead") as transformers documents it; each is skipped with a note if it fails.

usage: peer_decode.py [--prompt-tokens 32] [--new-tokens 256] [--transformers] [--transformers-static]
       peer_decode.py --self-check
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

QWEN3_0_6B = dict(vocab=151936, hidden=1024, inter=3072, layers=28, heads=16, kv_heads=8, head_dim=128,
                  theta=1e6, eps=1e-6)


class Weights:
    """Random weights (uniform, small) of a Qwen3 shape, bf16, tied embedding."""

    def __init__(self, c, device, seed=0):
        g = torch.Generator(device=device).manual_seed(seed)

        def w(*shape, scale=0.04, centre=0.0):
            return ((torch.rand(*shape, generator=g, device=device) * 2 - 1) * scale + centre).to(torch.bfloat16)

        d, f, hd = c["hidden"], c["inter"], c["head_dim"]
        self.embed = w(c["vocab"], d)
        self.layers = []
        for _ in range(c["layers"]):
            self.layers.append(dict(
                in_norm=w(d, scale=0.1, centre=1.0),
                qkv=w((c["heads"] + 2 * c["kv_heads"]) * hd, d),
                q_norm=w(hd, scale=0.1, centre=1.0), k_norm=w(hd, scale=0.1, centre=1.0),
                o=w(d, c["heads"] * hd),
                post_norm=w(d, scale=0.1, centre=1.0),
                gate_up=w(2 * f, d), down=w(d, f)))
        self.final_norm = w(d, scale=0.1, centre=1.0)


def rms_norm(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class StaticDecoder:
    """Static KV cache of max_len positions and a one-token step that reads the device-resident
    token and position, writes the argmax token back and advances the position."""

    def __init__(self, c, weights, max_len, device):
        self.c, self.w, self.max_len = c, weights, max_len
        hd, kv = c["head_dim"], c["kv_heads"]
        self.k = [torch.zeros(1, kv, max_len, hd, dtype=torch.bfloat16, device=device) for _ in range(c["layers"])]
        self.v = [torch.zeros_like(k) for k in self.k]
        inv_freq = 1.0 / (c["theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / hd))
        freqs = torch.outer(torch.arange(max_len, device=device, dtype=torch.float), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
        self.positions = torch.arange(max_len, device=device)
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.logits = None

    def step(self):
        c, w = self.c, self.w
        h_, kv, hd, f, eps = c["heads"], c["kv_heads"], c["head_dim"], c["inter"], c["eps"]
        x = w.embed.index_select(0, self.token)  # [1, D]
        cos = self.cos.index_select(0, self.pos).view(1, 1, hd)
        sin = self.sin.index_select(0, self.pos).view(1, 1, hd)
        mask = (self.positions <= self.pos).view(1, 1, 1, self.max_len)
        for layer, k_cache, v_cache in zip(w.layers, self.k, self.v):
            qkv = rms_norm(x, layer["in_norm"], eps) @ layer["qkv"].t()
            q, k, v = qkv.split([h_ * hd, kv * hd, kv * hd], dim=-1)
            q = rms_norm(q.view(1, h_, hd), layer["q_norm"], eps)
            k = rms_norm(k.view(1, kv, hd), layer["k_norm"], eps)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k_cache.index_copy_(2, self.pos, k.view(1, kv, 1, hd))
            v_cache.index_copy_(2, self.pos, v.view(1, kv, 1, hd))
            att = F.scaled_dot_product_attention(q.view(1, h_, 1, hd), k_cache, v_cache, attn_mask=mask,
                                                 enable_gqa=True)
            x = x + att.reshape(1, h_ * hd) @ layer["o"].t()
            g, u = (rms_norm(x, layer["post_norm"], eps) @ layer["gate_up"].t()).split([f, f], dim=-1)
            x = x + (F.silu(g) * u) @ layer["down"].t()
        self.logits = (rms_norm(x, w.final_norm, eps) @ w.embed.t()).float()
        self.token.copy_(self.logits.argmax(dim=-1))
        self.pos.add_(1)


def capture(decoder):
    """Warms the step up on a side stream, captures it, and resets the position."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            decoder.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.step()
    decoder.pos.zero_()
    return graph


def step_ms(c, weights, context, warmup, steps):
    decoder = StaticDecoder(c, weights, context + warmup + steps + 1, "cuda")
    graph = capture(decoder)
    decoder.pos.fill_(context)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(warmup + steps):
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop))
    return statistics.median(times)


def generation_tok_s(c, weights, prompt, new_tokens, repeats):
    decoder = StaticDecoder(c, weights, len(prompt) + new_tokens, "cuda")
    graph = capture(decoder)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rates, outputs = [], None
    for r in range(repeats + 1):
        decoder.pos.zero_()
        for t in prompt:  # the prompt through the same graph, teacher-forced
            decoder.token.fill_(t)
            graph.replay()
        out = torch.empty(new_tokens, dtype=torch.long, device="cuda")
        out[0:1].copy_(decoder.token)
        start.record()
        for i in range(1, new_tokens):
            graph.replay()
            out[i:i + 1].copy_(decoder.token)
        stop.record()
        stop.synchronize()
        if r > 0:
            rates.append(new_tokens / (start.elapsed_time(stop) / 1e3))
        outputs = out
    return statistics.median(rates), outputs


def transformers_model(c, weights, device, dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["inter"],
                         num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                         num_key_value_heads=c["kv_heads"], head_dim=c["head_dim"], rope_theta=c["theta"],
                         rms_norm_eps=c["eps"], tie_word_embeddings=True, max_position_embeddings=40960)
    config._attn_implementation = "sdpa"
    with torch.device(device):  # initialised where it runs (the random init is overwritten below)
        model = Qwen3ForCausalLM(config).to(dtype=dtype).eval()
    hd, h_, kv = c["head_dim"], c["heads"], c["kv_heads"]
    with torch.no_grad():
        m = model.model
        m.embed_tokens.weight.copy_(weights.embed)
        m.norm.weight.copy_(weights.final_norm)
        for layer, w in zip(m.layers, weights.layers):
            q, k, v = w["qkv"].split([h_ * hd, kv * hd, kv * hd])
            layer.self_attn.q_proj.weight.copy_(q)
            layer.self_attn.k_proj.weight.copy_(k)
            layer.self_attn.v_proj.weight.copy_(v)
            layer.self_attn.o_proj.weight.copy_(w["o"])
            layer.self_attn.q_norm.weight.copy_(w["q_norm"])
            layer.self_attn.k_norm.weight.copy_(w["k_norm"])
            layer.input_layernorm.weight.copy_(w["in_norm"])
            layer.post_attention_layernorm.weight.copy_(w["post_norm"])
            g, u = w["gate_up"].split([c["inter"], c["inter"]])
            layer.mlp.gate_proj.weight.copy_(g)
            layer.mlp.up_proj.weight.copy_(u)
            layer.mlp.down_proj.weight.copy_(w["down"])
    model.tie_weights()
    return model


def transformers_tok_s(model, prompt, new_tokens, repeats, **generate_args):
    ids = torch.tensor([prompt], device="cuda")
    rates = []
    for r in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                             **generate_args)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        assert out.shape[1] == len(prompt) + new_tokens
        if r > 0:
            rates.append(new_tokens / seconds)
    return statistics.median(rates), out[0, len(prompt):]


def self_check():
    """The plain-torch step against transformers' forward on a small shape (CPU, fp32 compute)."""
    c = dict(vocab=300, hidden=64, inter=96, layers=2, heads=4, kv_heads=2, head_dim=16, theta=500.0, eps=1e-6)
    weights = Weights(c, "cpu", seed=3)
    model = transformers_model(c, weights, "cpu", torch.bfloat16)
    prompt = [5, 17, 250, 3, 99, 42, 7]
    decoder = StaticDecoder(c, weights, len(prompt), "cpu")
    ours = []
    for t in prompt:
        decoder.token.fill_(t)
        decoder.step()
        ours.append(decoder.logits[0])
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].float()
    ours = torch.stack(ours)
    err = ((ours - ref).norm() / ref.norm()).item()
    print(json.dumps({"self_check_normwise_error": err}))
    assert err < 2e-2, err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--short-context", type=int, default=64)
    ap.add_argument("--long-context", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--transformers", action="store_true", help="also time transformers' generate (dynamic cache)")
    ap.add_argument("--transformers-static", action="store_true",
                    help="also time generate with the static cache and torch.compile(mode='reduce-overhead')")
    ap.add_argument("--self-check", action="store_true")
    a = ap.parse_args()
    if a.self_check:
        self_check()
        return
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    c = QWEN3_0_6B
    with torch.no_grad():
        weights = Weights(c, "cuda")
        prompt = [(i * 7919 + 13) % c["vocab"] for i in range(a.prompt_tokens)]
        short = step_ms(c, weights, a.short_context, a.warmup, a.steps)
        long = step_ms(c, weights, a.long_context, a.warmup, a.steps)
        tok_s, ids = generation_tok_s(c, weights, prompt, a.new_tokens, a.repeats)
    result = {
        "peer": f"torch {torch.__version__}: static KV cache, one decode step (SDPA, argmax on device) "
                f"captured in a CUDA graph",
        "device": torch.cuda.get_device_name(),
        "peer_ms": 1e3 / tok_s, "peer_tok_s": tok_s,
        f"peer_step_ms_ctx{a.short_context}": short, f"peer_step_ms_ctx{a.long_context}": long,
        "peer_long_over_short": long / short,
    }
    if a.transformers or a.transformers_static:
        try:
            model = transformers_model(c, weights, "cuda", torch.bfloat16)
            if a.transformers:
                rate, hf_ids = transformers_tok_s(model, prompt, a.new_tokens, 1)
                result["peer_transformers_eager_tok_s"] = rate
                result["peer_transformers_agrees_tokens"] = int((hf_ids == ids).long().cumprod(0).sum().item())
            if a.transformers_static:
                model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
                rate, _ = transformers_tok_s(model, prompt, a.new_tokens, 1, cache_implementation="static")
                result["peer_transformers_static_compiled_tok_s"] = rate
        except Exception as e:  # the figure is optional; say why it is missing
            result["peer_transformers_error"] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
