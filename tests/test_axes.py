"""Per-axis positions (M-RoPE, axial RoPE): the NumPy reference against
transformers' Qwen2-VL / Qwen3-VL rotary embeddings and an independent axial
formulation, and the argument checks (CPU)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import cupy_rope
from cupy_rope import reference


def rotate_half_rope(x, theta):
    """x [b, s, h, d] rotated NeoX-style by theta [b, s, d/2] (float64)."""
    half = x.shape[-1] // 2
    c, s = np.cos(theta)[:, :, None], np.sin(theta)[:, :, None]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def hf_rope(module_name, config_name, rng, sections, b=2, s=9, h=4, d=64):
    """q rotated by transformers' multimodal rotary embedding (float32) and our
    reference on the same inputs."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import importlib

    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    config_mod = importlib.import_module(
        f"transformers.models.{module_name}.configuration_{module_name}")
    cfg = getattr(config_mod, config_name)(
        hidden_size=h * d, num_attention_heads=h, num_key_value_heads=h, head_dim=d,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": sections})
    rotary = getattr(modeling, config_name.replace("Config", "RotaryEmbedding")
                     .replace("Qwen2VLTextRotaryEmbedding", "Qwen2VLRotaryEmbedding"))(cfg)
    pos = torch.as_tensor(rng.integers(0, 300, (3, b, s)))
    q = torch.as_tensor(rng.standard_normal((b, h, s, d)), dtype=torch.float32)
    cos, sin = rotary(q, pos)
    q_hf, _ = modeling.apply_rotary_pos_emb(q, q, cos, sin)
    inv_freq = rotary.inv_freq.numpy().astype(np.float64)
    ours = cupy_rope.apply_rope(q.numpy().astype(np.float64).transpose(0, 2, 1, 3),
                                inv_freq=inv_freq, positions=pos.numpy(), sections=sections,
                                sections_interleaved=module_name == "qwen3_vl")
    return q_hf.numpy().transpose(0, 2, 1, 3), ours, transformers.__version__


def test_mrope_matches_transformers_qwen2_vl(rng):
    hf, ours, version = hf_rope("qwen2_vl", "Qwen2VLTextConfig", rng, [8, 12, 12])
    err = np.abs(hf - ours).max() / np.abs(ours).max()
    print(f"transformers {version}: max error {err:.2e}")
    assert err < 1e-5


def test_interleaved_mrope_matches_transformers_qwen3_vl(rng):
    hf, ours, version = hf_rope("qwen3_vl", "Qwen3VLTextConfig", rng, [12, 10, 10])
    err = np.abs(hf - ours).max() / np.abs(ours).max()
    print(f"transformers {version}: max error {err:.2e}")
    assert err < 1e-5


@pytest.mark.parametrize("axes_dim", [(16, 24, 24), (32, 32), (8, 28, 28)])
def test_axial_matches_per_axis_rotation(rng, axes_dim):
    """Axial RoPE as Flux builds it: each axis rotates its own channel block
    (interleaved pairs) with its own frequencies; == one call with sections."""
    b, s, h = 2, 6, 3
    d = sum(axes_dim)
    x = rng.standard_normal((b, s, h, d))
    pos = rng.integers(0, 64, (len(axes_dim), b, s))
    theta = 10000.0
    blocks, inv = [], []
    start = 0
    for a, n in enumerate(axes_dim):
        f = 1.0 / theta ** (np.arange(0, n, 2) / n)
        inv.append(f)
        ang = pos[a][..., None] * f
        xa = x[..., start:start + n]
        c, sn = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
        y = xa.copy()
        y[..., 0::2] = xa[..., 0::2] * c - xa[..., 1::2] * sn
        y[..., 1::2] = xa[..., 1::2] * c + xa[..., 0::2] * sn
        blocks.append(y)
        start += n
    want = np.concatenate(blocks, axis=-1)
    got = cupy_rope.apply_rope(x, inv_freq=np.concatenate(inv), positions=pos,
                               sections=[n // 2 for n in axes_dim], interleaved=True)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_one_axis_equals_plain_positions(rng):
    x = rng.standard_normal((2, 5, 3, 16))
    inv = rng.uniform(0.01, 1, 8)
    pos = rng.integers(0, 50, (2, 5))
    np.testing.assert_array_equal(
        cupy_rope.apply_rope(x, inv_freq=inv, positions=pos[None], sections=[8]),
        cupy_rope.apply_rope(x, inv_freq=inv, positions=pos))


def test_axis_of_frequency():
    np.testing.assert_array_equal(reference.axis_of_frequency((2, 1, 3), False),
                                  [0, 0, 1, 2, 2, 2])
    # Qwen3-VL: T H W T H W ... while H/W sections last, then T
    np.testing.assert_array_equal(reference.axis_of_frequency((4, 2, 2), True),
                                  [0, 1, 2, 0, 1, 2, 0, 0])


X = np.zeros((2, 4, 3, 16))
INV = np.linspace(0.1, 1, 8)
POS3 = np.zeros((3, 2, 4), np.int64)
BAD = [
    ("sections sum", dict(inv_freq=INV, positions=POS3, sections=[2, 2, 2]),
     ValueError, "sections: must sum to rotary_dim / 2 = 8 (frequencies, not channels)"),
    ("sections in channels", dict(inv_freq=INV, positions=POS3, sections=[4, 6, 6]),
     ValueError, "sections: must sum to rotary_dim / 2 = 8"),
    ("too many sections", dict(inv_freq=INV, positions=np.zeros((4, 2, 4), np.int64),
                               sections=[2, 2, 2, 2]),
     ValueError, "sections: expected 1 to 3 non-negative frequency counts"),
    ("sections type", dict(inv_freq=INV, positions=POS3, sections=[2.5, 2.5, 3]),
     TypeError, "sections: expected a sequence of ints"),
    ("positions leading axis", dict(inv_freq=INV, positions=np.zeros((2, 2, 4), np.int64),
                                    sections=[2, 3, 3]),
     ValueError, "positions: expected shape [3, 4], [3, 1, 4] or [3, 2, 4] ([axes, s], [axes, 1, s] or [axes, b, s]; one row per axis"),
    ("positions missing", dict(inv_freq=INV, sections=[2, 3, 3]),
     ValueError, "positions: sections need explicit positions"),
    ("interleaved two axes", dict(inv_freq=INV, positions=POS3[:2], sections=[4, 4],
                                  sections_interleaved=True),
     ValueError, "sections_interleaved: the interleaved assignment (Qwen3-VL) needs 3"),
    ("interleaved without sections", dict(inv_freq=INV, sections_interleaved=True),
     ValueError, "sections_interleaved: needs sections"),
    ("sections with cp", dict(inv_freq=INV, positions=POS3, sections=[2, 3, 3], cp_size=2),
     ValueError, "sections: per-axis positions are explicit"),
]


@pytest.mark.parametrize("kw,exc,text", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_sections(kw, exc, text):
    with pytest.raises(exc, match=re.escape(text)):
        cupy_rope.apply_rope(X, **kw)
