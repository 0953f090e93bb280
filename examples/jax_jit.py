"""cupy-rope inside ``jax.jit`` with ``jax.grad``: a causal attention layer.

The rotation runs as an XLA custom call (``jax.experimental.buffer_callback``)
that launches the NVRTC kernel on XLA's own CUDA stream, with no host round
trip; ``jax.grad`` runs the same kernel rotating by -theta. Needs a CUDA GPU.
"""

import sys

import numpy as np

try:
    import jax
    import jax.numpy as jnp
except ModuleNotFoundError:
    sys.exit("this example needs JAX with CUDA: pip install -e \".[cuda12,jax]\" from the checkout")

if jax.default_backend() != "gpu":
    print("no GPU backend for JAX: nothing to run")
    sys.exit(0)

import cupy_rope.jax as crj

b, s, hq, hk, d, dim = 2, 128, 8, 2, 64, 256
inv_freq = jnp.asarray(1.0 / 10000 ** (np.arange(0, d, 2) / d), jnp.float32)
keys = jax.random.split(jax.random.PRNGKey(0), 3)
params = {"wqkv": jax.random.normal(keys[0], (dim, (hq + 2 * hk) * d)) / dim ** 0.5,
          "wo": jax.random.normal(keys[1], (hq * d, dim)) / (hq * d) ** 0.5}
x = jax.random.normal(keys[2], (b, s, dim))


def rotate_half_reference(t):
    theta = jnp.arange(s)[:, None] * inv_freq
    c, sn = jnp.cos(theta)[:, None, :], jnp.sin(theta)[:, None, :]
    a, bb = t[..., :d // 2], t[..., d // 2:]
    return jnp.concatenate([a * c - bb * sn, bb * c + a * sn], axis=-1)


def layer(params, x, use_kernel=True):
    q, k, v = jnp.split(x @ params["wqkv"], [hq * d, (hq + hk) * d], axis=-1)
    q, k, v = q.reshape(b, s, hq, d), k.reshape(b, s, hk, d), v.reshape(b, s, hk, d)
    if use_kernel:
        q, k = crj.rope_qk(q, k, inv_freq=inv_freq)
    else:
        q, k = rotate_half_reference(q), rotate_half_reference(k)
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return o.reshape(b, s, hq * d) @ params["wo"]


def loss(params, x, use_kernel=True):
    return jnp.mean(layer(params, x, use_kernel) ** 2)


grad_fn = jax.jit(jax.value_and_grad(loss), static_argnums=2)
value, grads = grad_fn(params, x, True)
ref_value, ref_grads = grad_fn(params, x, False)
print(f"loss {float(value):.6f} (pure JAX: {float(ref_value):.6f})")
for name in grads:
    err = float(jnp.abs(grads[name] - ref_grads[name]).max() / jnp.abs(ref_grads[name]).max())
    print(f"grad {name}: max relative difference {err:.2e}")
print("custom call in the program:",
      "xla_buffer_python_gpu_callback" in jax.jit(layer).lower(params, x).as_text())
