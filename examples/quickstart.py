"""cupy-rope quickstart: rotate q and k of an attention layer.

The first part runs anywhere: NumPy arrays take the float64 reference path on
the CPU. On a machine with a CUDA GPU the same calls then run on CuPy arrays
(and torch tensors, if torch is installed) and are compared with it.
"""

import numpy as np

import cupy_rope
from cupy_rope.frequencies import cos_sin_cache, rope_frequencies

batch, seqlen, heads, kv_heads, head_dim = 2, 16, 8, 2, 128
inv_freq, factor = rope_frequencies(head_dim, rope_theta=10000.0)  # float32 [head_dim / 2]
cos, sin = cos_sin_cache(inv_freq, 4096, factor)                    # float32 [4096, head_dim / 2]
rng = np.random.default_rng(0)
q = rng.standard_normal((batch, seqlen, heads, head_dim)).astype(np.float32)
k = rng.standard_normal((batch, seqlen, kv_heads, head_dim)).astype(np.float32)

# NumPy in, NumPy out: the float64 reference (no GPU needed).
q_ref = cupy_rope.apply_rope(q, cos, sin)
print("numpy reference:", q_ref.shape, q_ref.dtype)
q_rot, k_rot = cupy_rope.apply_rope_qk(q, k, cos, sin)   # q and k (GQA) in one call
dq = cupy_rope.apply_rope_backward(q_rot, cos, sin)      # the gradient: rotation by -theta
print("backward(forward(q)) vs q:", float(np.abs(dq - q).max()))

# Partial rotary: a model with partial_rotary_factor=0.25 rotates the first
# r = 32 channels with frequencies base ** (-2f / r). Build them for r; the
# first r/2 columns of the full-head table above hold other frequencies.
inv_part, factor_part = rope_frequencies(head_dim, rope_theta=10000.0, partial_rotary_factor=0.25)
cos_part, sin_part = cos_sin_cache(inv_part, 4096, factor_part)   # [4096, r / 2]
q_part = cupy_rope.apply_rope(q, cos_part, sin_part)              # channels [r, d) unchanged
assert np.array_equal(q_part[..., 32:], q[..., 32:])
print("partial rotary: rotary_dim", 2 * inv_part.shape[0], "of", head_dim)


def cuda_device() -> bool:
    """Whether CuPy sees a CUDA device (False without CuPy, a driver or a GPU)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, or CuPy's error for a missing driver or device
        return False


if not cuda_device():
    print("no CUDA device found: ran the NumPy reference path only")
else:
    import cupy

    # CuPy in, CuPy out, on CuPy's current stream.
    out = cupy_rope.apply_rope(cupy.asarray(q), cupy.asarray(cos), cupy.asarray(sin))
    print("cupy max |diff| vs reference:", float(abs(out.get() - q_ref).max()))
    out = cupy_rope.apply_rope(cupy.asarray(q), cupy.asarray(cos_part), cupy.asarray(sin_part))
    print("cupy partial rotary max |diff|:", float(abs(out.get() - q_part).max()))

    # In place, angles computed in the kernel from inv_freq, decode offsets per sequence.
    k_gpu = cupy.asarray(k)
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
