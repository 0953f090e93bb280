"""Per-axis positions on the GPU: M-RoPE (Qwen2-VL contiguous sections,
Qwen3-VL interleaved) and axial 2-D / 3-D RoPE, q and k in one launch,
forward and backward, against the float64 reference (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import cupy_rope
from helpers import assert_close, np_dtype, oracle
from gpu_util import bits, full_nan, to_device, to_host

pytestmark = pytest.mark.gpu

DTYPES = ["float32", "float16", "bfloat16"]


def axis_tables(inv_freq, rows):
    theta = (np.arange(rows)[:, None] * inv_freq.astype(np.float64)).astype(np.float32)
    return np.cos(theta), np.sin(theta)


@pytest.mark.parametrize("scheme", ["mrope", "mrope_interleaved", "axial2d", "axial3d"])
@pytest.mark.parametrize("source", ["inv_freq", "table"])
@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_axes_qk_one_launch(rng, scheme, source, layout, dtype):
    d, hq, hk = 128, 8, 2
    sections, interleaved, sec_inter = {
        "mrope": ((16, 24, 24), False, False),
        "mrope_interleaved": ((24, 20, 20), False, True),
        "axial2d": ((32, 32), True, False),
        "axial3d": ((8, 28, 28), True, False),
    }[scheme]
    tok = (2, 11) if layout == "bshd" else (29,)
    q = rng.standard_normal(tok + (hq, d)).astype(np_dtype(dtype))
    k = rng.standard_normal(tok + (hk, d)).astype(np_dtype(dtype))
    n_axes = len(sections)
    pos = rng.integers(0, 500, (n_axes,) + tok).astype(np.int64)
    inv_freq = np.concatenate([1.0 / 10000 ** (np.arange(n) / n) for n in sections]).astype(
        np.float32)
    host_kw = ({"inv_freq": inv_freq} if source == "inv_freq" else
               dict(zip(("cos", "sin"), axis_tables(inv_freq, 512))))
    common = dict(positions=pos, sections=sections, sections_interleaved=sec_inter,
                  interleaved=interleaved, layout=layout)
    for backward in (False, True):
        if layout == "thd":
            want_q = oracle(q[None], **host_kw, **{**common, "layout": "bshd",
                                                   "positions": pos[:, None]},
                            backward=backward)[0]
            want_k = oracle(k[None], **host_kw, **{**common, "layout": "bshd",
                                                   "positions": pos[:, None]},
                            backward=backward)[0]
        else:
            want_q = oracle(q, **host_kw, **common, backward=backward)
            want_k = oracle(k, **host_kw, **common, backward=backward)
        dev_kw = {n: to_device(v) for n, v in host_kw.items()}
        oq, ok = full_nan(q.shape, dtype), full_nan(k.shape, dtype)
        qd, kd = to_device(q), to_device(k)
        cupy_rope.apply_rope_qk(qd, kd, **dev_kw, **{**common, "positions": to_device(pos)},
                                backward=backward, out_q=oq, out_k=ok)
        what = f"{scheme} {source} {layout} bwd={backward}"
        assert_close(to_host(oq), want_q, dtype, "q " + what)
        assert_close(to_host(ok), want_k, dtype, "k " + what)
        assert np.array_equal(bits(to_host(qd)), bits(q))
        # in place gives the same bits
        cupy_rope.apply_rope_qk(qd, kd, **dev_kw, **{**common, "positions": to_device(pos)},
                                backward=backward, inplace=True)
        assert np.array_equal(bits(to_host(qd)), bits(to_host(oq)))
        assert np.array_equal(bits(to_host(kd)), bits(to_host(ok)))


def test_mrope_matches_transformers_on_gpu(rng):
    """Qwen2-VL's own rotary embedding and application, on the GPU, fp32 and bf16."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl import modeling_qwen2_vl as m
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig

    b, s, hq, hk, d = 2, 33, 8, 2, 128
    cfg = Qwen2VLTextConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hk,
                            head_dim=d, rope_parameters={"rope_type": "default",
                                                         "rope_theta": 1e6,
                                                         "mrope_section": [16, 24, 24]})
    rotary = m.Qwen2VLRotaryEmbedding(cfg).cuda()
    pos = torch.as_tensor(rng.integers(0, 4000, (3, b, s)), device="cuda")
    # transformers forms the angle position * inv_freq in fp32: at positions up
    # to 4000 its own angles are off by up to ~4000 * 2^-24 rad, so fp32 agrees
    # to a few 1e-4 (our angles are checked against float64 elsewhere).
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 2e-2)):
        q = torch.randn(b, hq, s, d, device="cuda", dtype=dtype)
        k = torch.randn(b, hk, s, d, device="cuda", dtype=dtype)
        cos, sin = rotary(q, pos)
        q_hf, k_hf = m.apply_rotary_pos_emb(q, k, cos, sin)
        q2, k2 = cupy_rope.apply_rope_qk(q.transpose(1, 2), k.transpose(1, 2),
                                         inv_freq=rotary.inv_freq.float(), positions=pos,
                                         sections=[16, 24, 24])
        for ours, theirs in ((q2.transpose(1, 2), q_hf), (k2.transpose(1, 2), k_hf)):
            err = ((ours.float() - theirs.float()).abs().max() /
                   theirs.float().abs().max()).item()
            print(f"{dtype}: max error vs transformers {err:.2e}")
            assert err < tol
