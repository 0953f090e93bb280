"""A few training steps of a small GQA attention model using cupy-rope from PyTorch.

q and k come out of one packed projection; ``cupy_rope.torch.rope_qkv`` splits
it and rotates q and k in one launch, with autograd (its backward packs the
gradient back), under ``torch.compile(fullgraph=True)``. Needs a CUDA GPU.
"""

import sys

import torch

if not torch.cuda.is_available():
    print("no CUDA device: nothing to run")
    sys.exit(0)

import cupy_rope.torch as crt  # registers torch.ops.cupy_rope.*

torch.manual_seed(0)
dim, hq, hk, d, seqlen, batch = 512, 8, 2, 64, 256, 4


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim)
        self.qkv = torch.nn.Linear(dim, (hq + 2 * hk) * d, bias=False)
        self.out = torch.nn.Linear(hq * d, dim, bias=False)
        # [max_position, d/2] tables; they follow the model's dtype (bf16 below),
        # which the kernels accept (tables may be float32 or x's dtype).
        inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        theta = torch.arange(4096, dtype=torch.float64)[:, None] * inv_freq
        self.register_buffer("cos", theta.cos().float(), persistent=False)
        self.register_buffer("sin", theta.sin().float(), persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = crt.rope_qkv(self.qkv(self.norm(x)), self.cos, self.sin,
                               num_q_heads=hq, num_kv_heads=hk)   # [b, s, h, d] each
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=True)
        return x + self.out(o.transpose(1, 2).reshape(b, s, hq * d))


model = torch.nn.Sequential(Block(), Block()).cuda().to(torch.bfloat16)
step_model = torch.compile(model, fullgraph=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(batch, seqlen, dim, device="cuda", dtype=torch.bfloat16)
target = torch.randn_like(x)

for step in range(5):
    loss = torch.nn.functional.mse_loss(step_model(x).float(), target.float())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    print(f"step {step}: loss {loss.item():.4f}")

# The compiled model and the eager one agree (same kernels).
with torch.no_grad():
    diff = (step_model(x).float() - model(x).float()).abs().max().item()
print(f"compiled vs eager max |diff|: {diff:.3g}")
