"""cupy-rope quickstart: rotate q and k of an attention layer.

Runs on a CUDA GPU with CuPy (and torch, if installed); without a GPU it runs
the same call on NumPy arrays through the float64 reference.
"""

import numpy as np

import cupy_rope

batch, seqlen, heads, head_dim = 2, 16, 8, 128
inv_freq = (1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
theta = np.arange(4096)[:, None] * inv_freq
cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
q = np.random.default_rng(0).standard_normal((batch, seqlen, heads, head_dim)).astype(np.float32)

# NumPy in, NumPy out: the float64 reference (no GPU needed).
q_ref = cupy_rope.apply_rope(q, cos, sin)
print("numpy reference:", q_ref.shape, q_ref.dtype)

try:
    import cupy

    gpu = cupy.cuda.is_available()
except ImportError:
    gpu = False

if gpu:
    # CuPy in, CuPy out, on CuPy's current stream.
    q_gpu = cupy.asarray(q)
    out = cupy_rope.apply_rope(q_gpu, cupy.asarray(cos), cupy.asarray(sin))
    print("cupy max |diff| vs reference:", float(abs(out.get() - q_ref).max()))

    # In place, angles computed in the kernel from inv_freq, decode offsets.
    k_gpu = cupy.asarray(q)
    cupy_rope.apply_rope(k_gpu, inv_freq=cupy.asarray(inv_freq), inplace=True,
                         offsets=cupy.asarray([100, 7], dtype=cupy.int32))

    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        # torch in, torch out (bfloat16, a transposed [b, h, s, d] view, no copy).
        qt = torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
        cos_t, sin_t = torch.from_numpy(cos).cuda(), torch.from_numpy(sin).cuda()
        rotated = cupy_rope.apply_rope(qt.transpose(1, 2), cos_t, sin_t)
        grad = cupy_rope.apply_rope_backward(rotated, cos_t, sin_t)  # rotation by -theta
        print("torch:", type(rotated).__name__, rotated.dtype,
              "round trip max |diff|:", (grad - qt.transpose(1, 2)).abs().max().item())
else:
    print("no CUDA device: ran the NumPy reference only")
