"""Serving a small Llama from a paged KV cache that cupy-rope fills in one launch per layer.

A randomly initialised LlamaForCausalLM (from a config: 2 layers, hidden 256,
4 q heads and 2 kv heads; nothing is downloaded) runs a prefill of two
prompts and a few greedy decode steps with its attention rebuilt around a
paged cache. Per layer, q, k and v come from the model's own projections;
``cupy_rope.torch.rope_and_cache`` (prefill) or ``qkv_rope_and_cache`` (decode,
on the projection packed as one matrix) rotates q and k and writes k and v
into the cache pages, at slots built from a page table by
``cupy_rope.kv_cache.slot_mapping_from_page_table``; attention reads the pages back
(torch SDPA on the gathered pages). The logits must match the model's own
forward, and the greedy tokens its ``generate``, in float32 (an NHD cache)
and bfloat16 (an HND cache). A decode step captured in a CUDA graph, with
the batch padded to a fixed size by padding tokens (slot -1: nothing
written), replayed with new inputs copied in, must leave the cache exactly
as the eager step does. Exits 1 on a mismatch. Needs a CUDA GPU and
``transformers``.

``--model qwen3`` runs the same on a randomly initialised Qwen3ForCausalLM
(its q_norm / k_norm weights drawn at random too), whose attention
normalizes each q and k head before the rotation: there the per-layer call
also takes the layer's q_norm and k_norm weights (rounding "before_weight",
eps from the config), so that one launch normalizes, rotates and caches.
"""

import argparse
import copy
import sys

import numpy as np
import torch
import transformers

if not torch.cuda.is_available():
    print("paged_decode.py needs a CUDA GPU (the fused RoPE + KV-cache kernel runs on it): "
          "nothing to run")
    sys.exit(0)

import cupy_rope.torch as crt  # registers torch.ops.cupy_rope.*
from cupy_rope.kv_cache import slot_mapping_from_page_table

DEV = "cuda"
PROMPTS = (11, 29)        # prompt lengths of the two sequences
DECODE_STEPS = 6
GRAPH_BATCH = 4           # the captured decode step's fixed batch: 2 sequences + 2 padding
#: max |ours - stock| / max |stock| of the logits accepted, per dtype.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


class PagedKV:
    """Per-layer k and v caches of ``num_blocks`` pages, and each sequence's pages.

    Pages are handed out in a shuffled order, so a sequence's pages are not
    contiguous in memory (as in a serving engine after some churn).
    """

    def __init__(self, config, dtype, layout, block_size, num_blocks=64):
        hk, d = config.num_key_value_heads, head_dim(config)
        page = (block_size, hk, d) if layout == "NHD" else (hk, block_size, d)
        self.k = [torch.zeros(num_blocks, *page, device=DEV, dtype=dtype)
                  for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros_like(c) for c in self.k]
        self.layout, self.block_size = layout, block_size
        self.free = list(np.random.default_rng(0).permutation(num_blocks))
        self.pages, self.lengths = [], []

    def add_sequence(self) -> int:
        self.pages.append([])
        self.lengths.append(0)
        return len(self.pages) - 1

    def grow(self, seq: int, n: int) -> None:
        """Make room for ``n`` more tokens of ``seq`` (new pages as needed)."""
        self.lengths[seq] += n
        while len(self.pages[seq]) * self.block_size < self.lengths[seq]:
            self.pages[seq].append(int(self.free.pop()))

    def slots(self, seqs, new_tokens) -> torch.Tensor:
        """int64 cache slots of the last ``new_tokens[i]`` tokens of each sequence,
        from the page table as paged-attention kernels take it."""
        indptr = np.cumsum([0] + [len(self.pages[s]) for s in seqs]).astype(np.int32)
        indices = np.array([p for s in seqs for p in self.pages[s]], dtype=np.int32)
        last = np.array([self.lengths[s] - (len(self.pages[s]) - 1) * self.block_size
                         for s in seqs], dtype=np.int32)
        slots = slot_mapping_from_page_table(
            indptr, indices, last, self.block_size,
            new_tokens=np.asarray(new_tokens, dtype=np.int32))
        return torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(DEV)

    def gather(self, cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """The pages' tokens as [..., n_pages * block_size, hk, d]."""
        g = cache[pages]  # [..., n_pages, page...]
        if self.layout == "HND":
            g = g.transpose(-3, -2)
        return g.flatten(-4, -3)

    def block_table(self, seqs, width) -> torch.Tensor:
        """int64 [len(seqs), width] pages of each sequence, padded with page 0."""
        rows = [self.pages[s] + [0] * (width - len(self.pages[s])) for s in seqs]
        return torch.tensor(rows, dtype=torch.int64, device=DEV)


class DecodeInputs:
    """A decode step's device inputs, one row per batch entry (static shapes,
    so that a captured CUDA graph can be replayed with new values copied in)."""

    def __init__(self, tokens, positions, slots, block_table, seq_lens):
        self.tokens, self.positions, self.slots = tokens, positions, slots
        self.block_table, self.seq_lens = block_table, seq_lens

    def tensors(self):
        return (self.tokens, self.positions, self.slots, self.block_table, self.seq_lens)

    def copy_(self, other: "DecodeInputs") -> None:
        for dst, src in zip(self.tensors(), other.tensors()):
            dst.copy_(src)


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def norm_kwargs(layer) -> dict:
    """The per-head q/k RMSNorm arguments of a Qwen3 layer (its q_norm and
    k_norm: x_hat rounded to the dtype, then times the weight); none for Llama."""
    attn = layer.self_attn
    if not hasattr(attn, "q_norm"):
        return {}
    return dict(q_weight=attn.q_norm.weight, k_weight=attn.k_norm.weight,
                eps=attn.q_norm.variance_epsilon, rounding="before_weight")


def mlp_and_residual(layer, h, attn_out):
    h = h + layer.self_attn.o_proj(attn_out)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def prefill(model, kv: PagedKV, prompts, inv_freq) -> list:
    """Logits [len, vocab] of every prompt, writing the prompts' k and v into the cache."""
    cfg = model.config
    hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
    seqs = [kv.add_sequence() for _ in prompts]
    for s, p in zip(seqs, prompts):
        kv.grow(s, len(p))
    slots = kv.slots(seqs, [len(p) for p in prompts])
    ids = torch.cat(prompts)                                  # thd: the prompts packed
    positions = torch.cat([torch.arange(len(p), device=DEV) for p in prompts])
    bounds = np.cumsum([0] + [len(p) for p in prompts])
    h = model.model.embed_tokens(ids)
    for i, layer in enumerate(model.model.layers):
        attn, x = layer.self_attn, layer.input_layernorm(h)
        q = attn.q_proj(x).view(-1, hq, d)
        k, v = attn.k_proj(x).view(-1, hk, d), attn.v_proj(x).view(-1, hk, d)
        q = crt.rope_and_cache(q, k, v, kv.k[i], kv.v[i], slots, inv_freq=inv_freq,
                               positions=positions, layout="thd", cache_layout=kv.layout,
                               **norm_kwargs(layer))
        outs = []
        for j, s in enumerate(seqs):  # attention of each prompt on its own cached pages
            pages = torch.tensor(kv.pages[s], device=DEV)
            n = kv.lengths[s]
            kc, vc = (kv.gather(c[i], pages)[:n].transpose(0, 1) for c in (kv.k, kv.v))
            qs = q[bounds[j]:bounds[j + 1]].transpose(0, 1)
            o = torch.nn.functional.scaled_dot_product_attention(qs, kc, vc, is_causal=True,
                                                                 enable_gqa=True)
            outs.append(o.transpose(0, 1).reshape(n, hq * d))
        h = mlp_and_residual(layer, h, torch.cat(outs))
    logits = model.lm_head(model.model.norm(h))
    return [logits[bounds[j]:bounds[j + 1]] for j in range(len(prompts))]


def decode_step(model, kv: PagedKV, inp: DecodeInputs, qkv_weights, inv_freq) -> torch.Tensor:
    """Logits [batch, vocab] of one new token per batch row; no host sync, static
    shapes (CUDA-graph capturable). Rows with slot -1 are padding: they write nothing."""
    cfg = model.config
    hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
    h = model.model.embed_tokens(inp.tokens)
    width = inp.block_table.shape[1] * kv.block_size
    visible = torch.arange(width, device=DEV) < inp.seq_lens[:, None]  # [batch, width]
    for i, layer in enumerate(model.model.layers):
        qkv = torch.nn.functional.linear(layer.input_layernorm(h), qkv_weights[i])
        q = crt.qkv_rope_and_cache(qkv, kv.k[i], kv.v[i], inp.slots, inv_freq=inv_freq,
                                   positions=inp.positions, num_q_heads=hq, num_kv_heads=hk,
                                   head_dim=d, layout="thd", cache_layout=kv.layout,
                                   **norm_kwargs(layer))
        kc, vc = (kv.gather(c[i], inp.block_table).transpose(1, 2) for c in (kv.k, kv.v))
        o = torch.nn.functional.scaled_dot_product_attention(
            q.reshape(-1, hq, 1, d), kc, vc, attn_mask=visible[:, None, None, :],
            enable_gqa=True)
        h = mlp_and_residual(layer, h, o.reshape(-1, hq * d))
    return model.lm_head(model.model.norm(h))


def decode_inputs(kv: PagedKV, seqs, tokens, width, batch) -> DecodeInputs:
    """The next step's inputs for ``seqs`` (their last ``tokens``), padded to
    ``batch`` rows by padding tokens (slot -1, attending to one zero slot)."""
    for s in seqs:
        kv.grow(s, 1)
    pad = batch - len(seqs)
    pos = [kv.lengths[s] - 1 for s in seqs] + [0] * pad
    slots = torch.cat([kv.slots(seqs, [1] * len(seqs)),
                       torch.full((pad,), -1, dtype=torch.int64, device=DEV)])
    table = torch.cat([kv.block_table(seqs, width),
                       torch.zeros(pad, width, dtype=torch.int64, device=DEV)])
    return DecodeInputs(torch.cat([tokens, tokens.new_zeros(pad)]),
                        torch.tensor(pos, device=DEV), slots, table,
                        torch.tensor([kv.lengths[s] for s in seqs] + [1] * pad, device=DEV))


def rel_diff(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def generate_paged(model, kv, prompts, qkv_weights, inv_freq, width):
    """Greedy decoding of both prompts through the paged cache: (prefill
    logits, the decode steps' logits [steps, 2, vocab], tokens [2, steps])."""
    first = prefill(model, kv, prompts, inv_freq)
    tokens = torch.stack([lg[-1].argmax() for lg in first])
    seqs, steps, generated = [0, 1], [], [tokens]
    for _ in range(DECODE_STEPS - 1):
        inp = decode_inputs(kv, seqs, tokens, width, len(seqs))
        steps.append(decode_step(model, kv, inp, qkv_weights, inv_freq))
        tokens = steps[-1].argmax(-1)
        generated.append(tokens)
    return first, torch.stack(steps), torch.stack(generated, dim=1)


def compare_with_stock(model, prompts, first, steps, tokens) -> list:
    """(what, detail, ok) for the prefill logits, the decode logits and the
    greedy tokens, against the model's own forward and generate."""
    tol = TOLERANCE[model.dtype]
    pre, dec, same = [], [], []
    for j, p in enumerate(prompts):
        fed = torch.cat([p, tokens[j, :-1]])           # the prompt, then the tokens decoded
        want = model(input_ids=fed[None]).logits[0]
        pre.append(rel_diff(first[j], want[:len(p)]))
        dec.append(rel_diff(steps[:, j], want[len(p):]))
        gen = model.generate(p[None], max_new_tokens=DECODE_STEPS, do_sample=False,
                             pad_token_id=0)[0, len(p):]
        same.append(torch.equal(gen, tokens[j]))
    # bfloat16 greedy decoding may flip at a near tie; its logits are checked
    # above on the tokens it chose, so only float32 must pick the same tokens.
    need_same = model.dtype == torch.float32
    return [("prefill logits", f"max rel diff {max(pre):.2e} (tolerance {tol:g})",
             max(pre) <= tol),
            ("decode logits", f"max rel diff {max(dec):.2e} (tolerance {tol:g})",
             max(dec) <= tol),
            ("greedy tokens", ("identical to" if all(same) else "differ from")
             + " model.generate" + ("" if need_same else " (informative in bfloat16)"),
             all(same) or not need_same)]


def per_slot(kv: PagedKV, cache: torch.Tensor) -> torch.Tensor:
    """The cache as [slots, hk * d], slot = page * block_size + offset."""
    if kv.layout == "HND":
        cache = cache.transpose(1, 2)
    return cache.reshape(cache.shape[0] * kv.block_size, -1)


def graph_check(model, kv, qkv_weights, inv_freq, tokens, width) -> tuple:
    """Capture a decode step of GRAPH_BATCH rows, then run the next step
    eagerly and by replay (new inputs copied in) from the same cache: the
    caches must be bit-identical, and only the real tokens' slots written."""
    zeros = torch.zeros(GRAPH_BATCH, dtype=torch.int64, device=DEV)
    static = DecodeInputs(zeros.clone(), zeros.clone(), zeros - 1,
                          torch.zeros(GRAPH_BATCH, width, dtype=torch.int64, device=DEV),
                          zeros + 1)                # all padding: the warm-up writes nothing
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                   # compile the kernels before capturing
        for _ in range(2):
            decode_step(model, kv, static, qkv_weights, inv_freq)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode_step(model, kv, static, qkv_weights, inv_freq)
    inp = decode_inputs(kv, [0, 1], tokens, width, GRAPH_BATCH)
    caches = kv.k + kv.v
    before = [c.clone() for c in caches]
    eager_logits = decode_step(model, kv, inp, qkv_weights, inv_freq)
    eager = [c.clone() for c in caches]
    for c, b in zip(caches, before):
        c.copy_(b)
    static.copy_(inp)
    graph.replay()
    identical = all(torch.equal(c, e) for c, e in zip(caches, eager))
    written = set()
    for c, b in zip(caches, before):
        changed = (per_slot(kv, c) != per_slot(kv, b)).any(dim=1)
        written |= set(changed.nonzero().flatten().tolist())
    real = set(inp.slots[:2].tolist())
    logits_ok = rel_diff(captured[:2], eager_logits[:2]) <= TOLERANCE[model.dtype]
    ok = identical and written == real and logits_ok
    detail = (f"cache {'bit-identical to' if identical else 'DIFFERS from'} the eager step; "
              f"slots written {sorted(written)} (the 2 real tokens': {sorted(real)}; "
              f"{GRAPH_BATCH - 2} padding rows wrote nothing); logits "
              f"{'match' if logits_ok else 'DIFFER'}")
    return ("CUDA graph step", detail, ok)


def run(stock, dtype, layout, block_size) -> bool:
    model = copy.deepcopy(stock).to(dtype)
    cfg = model.config
    inv_freq = model.model.rotary_emb.inv_freq.float()  # what the model's rotary uses
    qkv_weights = [torch.cat([l.self_attn.q_proj.weight, l.self_attn.k_proj.weight,
                              l.self_attn.v_proj.weight]) for l in model.model.layers]
    kv = PagedKV(cfg, dtype, layout, block_size)
    gen = torch.Generator(device=DEV).manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), device=DEV, generator=gen)
               for n in PROMPTS]
    width = -(-(max(PROMPTS) + DECODE_STEPS + 1) // block_size)  # pages a sequence may need
    first, steps, tokens = generate_paged(model, kv, prompts, qkv_weights, inv_freq, width)
    checks = compare_with_stock(model, prompts, first, steps, tokens)
    checks.append(graph_check(model, kv, qkv_weights, inv_freq, tokens[:, -1], width))
    print(f"{str(dtype).removeprefix('torch.')}, {layout} cache of {block_size}-token pages, "
          f"prompts of {PROMPTS[0]} and {PROMPTS[1]} tokens, {DECODE_STEPS} tokens generated:")
    for what, detail, ok in checks:
        print(f"  {what:16s} {detail}  {'ok' if ok else 'MISMATCH'}")
    return all(ok for *_, ok in checks)


def stock_model(name: str):
    """A small randomly initialised Llama or Qwen3 (from a config: no download)."""
    sizes = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)).to(DEV).eval()
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=64, **sizes))
    with torch.no_grad():  # RMSNorm weights start at 1: draw them, so that they matter
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + 0.3 * torch.randn_like(norm.weight))
    return model.to(DEV).eval()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--model", choices=("llama", "qwen3"), default="llama")
    stock = stock_model(parser.parse_args().model)
    with torch.no_grad():
        ok = [run(stock, torch.float32, "NHD", 16), run(stock, torch.bfloat16, "HND", 8)]
    print("all checks passed" if all(ok) else "MISMATCH: see above")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
