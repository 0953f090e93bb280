"""RoPE frequencies and attention factors (CPU), checked against Hugging Face transformers.

The comparison tests build model configs with transformers' own config classes
from the parameters below (nothing is downloaded) and compare our ``inv_freq``
and attention factor with what the model's rotary embedding computes.
"""

import copy
import importlib
import math
import pathlib
import sys
import types

import numpy as np
import pytest

from cupy_rope import frequencies as fq
from cupy_rope import reference
from cupy_rope.frequencies import cos_sin_cache, from_config, rope_frequencies

REL = 1e-6  # relative tolerance against transformers (which computes in float32)

# Phi-3-mini-128k has head_dim 96: 48 short and 48 long factors. These lists
# have the shape of the real ones (short near 1, long growing to tens).
PHI3_SHORT = [float(v) for v in 1.0 + 0.1 * np.linspace(0.0, 1.0, 48) ** 2]
PHI3_LONG = [float(v) for v in np.geomspace(1.0, 60.0, 48)]

LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
DSV2_SCALING = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}

# id -> (transformers model module, config class, rotary embedding class,
#        config kwargs, our direct rope_frequencies kwargs, rope_type, seq_lens)
# seq_lens: None checks the rotary embedding built from the config; an int
# calls transformers' init function for that rope_type with seq_len.
HF_CASES = {
    "llama-3.1-8b": (
        "llama", "LlamaConfig", "LlamaRotaryEmbedding",
        dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
             max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=LLAMA31_SCALING),
        dict(head_dim=128, rope_theta=500000.0, rope_scaling=LLAMA31_SCALING,
             max_position_embeddings=131072),
        "llama3", [None]),
    "qwen2-7b": (
        "qwen2", "Qwen2Config", "Qwen2RotaryEmbedding",
        dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
             max_position_embeddings=32768, rope_theta=1000000.0),
        dict(head_dim=128, rope_theta=1000000.0, max_position_embeddings=32768),
        "default", [None]),
    "phi-3-mini-128k": (
        "phi3", "Phi3Config", "Phi3RotaryEmbedding",
        dict(hidden_size=3072, num_attention_heads=32, max_position_embeddings=131072,
             original_max_position_embeddings=4096, rope_theta=10000.0,
             rope_scaling={"type": "longrope", "short_factor": PHI3_SHORT,
                           "long_factor": PHI3_LONG}),
        dict(head_dim=96, rope_theta=10000.0, max_position_embeddings=131072,
             rope_scaling={"type": "longrope", "short_factor": PHI3_SHORT,
                           "long_factor": PHI3_LONG, "original_max_position_embeddings": 4096}),
        "longrope", [None, 1, 4096, 4097, 131072]),
    "deepseek-v2": (
        "deepseek_v2", "DeepseekV2Config", "DeepseekV2RotaryEmbedding",
        dict(hidden_size=5120, num_attention_heads=128, qk_rope_head_dim=64, qk_nope_head_dim=128,
             v_head_dim=128, kv_lora_rank=512, q_lora_rank=1536, max_position_embeddings=163840,
             rope_theta=10000.0, rope_scaling=DSV2_SCALING),
        dict(head_dim=64, rope_theta=10000.0, rope_scaling=DSV2_SCALING,
             max_position_embeddings=163840),
        "yarn", [None]),
    "yarn-mscale-differ": (  # mscale != mscale_all_dim: an attention factor != 1
        "deepseek_v2", "DeepseekV2Config", "DeepseekV2RotaryEmbedding",
        dict(hidden_size=2048, num_attention_heads=16, qk_rope_head_dim=64, qk_nope_head_dim=128,
             v_head_dim=128, kv_lora_rank=512, q_lora_rank=None, max_position_embeddings=163840,
             rope_theta=10000.0, rope_scaling=dict(DSV2_SCALING, mscale=1.0)),
        dict(head_dim=64, rope_theta=10000.0, rope_scaling=dict(DSV2_SCALING, mscale=1.0),
             max_position_embeddings=163840),
        "yarn", [None]),
    "qwen2.5-yarn": (  # no mscale: attention factor 0.1 ln(factor) + 1
        "qwen2", "Qwen2Config", "Qwen2RotaryEmbedding",
        dict(hidden_size=5120, num_attention_heads=40, max_position_embeddings=131072,
             rope_theta=1000000.0,
             rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
        dict(head_dim=128, rope_theta=1000000.0, max_position_embeddings=131072,
             rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
        "yarn", [None]),
    "gpt-oss-yarn-untruncated": (
        "llama", "LlamaConfig", "LlamaRotaryEmbedding",
        dict(hidden_size=2880, num_attention_heads=64, head_dim=64, max_position_embeddings=131072,
             rope_theta=150000.0,
             rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                           "truncate": False, "original_max_position_embeddings": 4096}),
        dict(head_dim=64, rope_theta=150000.0, max_position_embeddings=131072,
             rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                           "truncate": False, "original_max_position_embeddings": 4096}),
        "yarn", [None]),
    "linear": (
        "llama", "LlamaConfig", "LlamaRotaryEmbedding",
        dict(hidden_size=5120, num_attention_heads=40, max_position_embeddings=16384,
             rope_scaling={"type": "linear", "factor": 4.0}),
        dict(head_dim=128, rope_scaling={"type": "linear", "factor": 4.0},
             max_position_embeddings=16384),
        "linear", [None]),
    "dynamic-ntk": (
        "llama", "LlamaConfig", "LlamaRotaryEmbedding",
        dict(hidden_size=4096, num_attention_heads=32, max_position_embeddings=4096,
             rope_scaling={"type": "dynamic", "factor": 2.0}),
        dict(head_dim=128, rope_scaling={"type": "dynamic", "factor": 2.0},
             max_position_embeddings=4096),
        "dynamic", [None, 2048, 4096, 4097, 10000, 65536]),
    "partial-0.5": (
        "phi", "PhiConfig", "PhiRotaryEmbedding",
        dict(hidden_size=2560, num_attention_heads=32, partial_rotary_factor=0.5,
             max_position_embeddings=2048),
        dict(head_dim=80, partial_rotary_factor=0.5, max_position_embeddings=2048),
        "default", [None]),
    "partial-0.5-dynamic": (
        "phi", "PhiConfig", "PhiRotaryEmbedding",
        dict(hidden_size=2560, num_attention_heads=32, partial_rotary_factor=0.5,
             max_position_embeddings=2048, rope_scaling={"type": "dynamic", "factor": 2.0}),
        dict(head_dim=80, partial_rotary_factor=0.5, max_position_embeddings=2048,
             rope_scaling={"type": "dynamic", "factor": 2.0}),
        "dynamic", [None, 5000]),
}


def _hf():
    pytest.importorskip("torch")
    return pytest.importorskip("transformers")


def _hf_reference(case, seq_len):
    """(inv_freq float64, attention factor, config) as transformers computes them."""
    transformers = _hf()
    module, config_name, rotary_name, config_kwargs, _, rope_type, _ = case
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    config_cls = getattr(transformers, config_name, None)
    rotary_cls = getattr(modeling, rotary_name, None)
    if config_cls is None or rotary_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}/{rotary_name}")
    config = config_cls(**copy.deepcopy(config_kwargs))
    if seq_len is None:
        emb = rotary_cls(config=config)
        inv_freq, factor = emb.inv_freq, emb.attention_scaling
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)
    return inv_freq.double().numpy(), float(factor), config


def _check(ours, ref):
    inv_freq, factor = ours
    assert isinstance(inv_freq, np.ndarray) and inv_freq.dtype == np.float32
    assert inv_freq.shape == ref[0].shape
    assert isinstance(factor, float)
    np.testing.assert_allclose(inv_freq.astype(np.float64), ref[0], rtol=REL, atol=0)
    assert factor == pytest.approx(ref[1], rel=REL)


@pytest.mark.parametrize("case_id,seq_len",
                         [(k, s) for k, case in HF_CASES.items() for s in case[-1]])
def test_matches_transformers(case_id, seq_len):
    case = HF_CASES[case_id]
    ref_inv, ref_factor, config = _hf_reference(case, seq_len)
    ref = (ref_inv, ref_factor)
    # the explicit entry point, from the same numbers
    _check(rope_frequencies(**copy.deepcopy(case[4]), seq_len=seq_len), ref)
    # the config object, and its dict (config.json) form
    _check(from_config(config, seq_len=seq_len), ref)
    _check(from_config(config.to_dict(), seq_len=seq_len), ref)


def test_regimes_differ():
    """The seq_len cases above really exercise two regimes (guards the test itself)."""
    dyn = HF_CASES["dynamic-ntk"][4]
    assert np.array_equal(rope_frequencies(**dyn, seq_len=4096)[0], rope_frequencies(**dyn)[0])
    assert not np.allclose(rope_frequencies(**dyn, seq_len=10000)[0], rope_frequencies(**dyn)[0])
    phi3 = HF_CASES["phi-3-mini-128k"][4]
    short, long = rope_frequencies(**phi3, seq_len=4096)[0], rope_frequencies(**phi3, seq_len=4097)[0]
    np.testing.assert_allclose(short / long, np.array(PHI3_LONG) / PHI3_SHORT, rtol=1e-6)


# ---------------------------------------------------------------------------
# formulas and config formats, without transformers


def test_default_hand_computed():
    inv, factor = rope_frequencies(4, rope_theta=100.0)
    np.testing.assert_allclose(inv, [1.0, 0.1], rtol=1e-7)
    assert factor == 1.0
    inv8, _ = rope_frequencies(8)
    np.testing.assert_allclose(inv8, 10000.0 ** -(np.arange(0, 8, 2) / 8), rtol=1e-7)
    lin, _ = rope_frequencies(8, rope_scaling={"type": "linear", "factor": 4})
    np.testing.assert_allclose(lin, inv8 / 4, rtol=1e-7)
    half, _ = rope_frequencies(16, partial_rotary_factor=0.5)
    np.testing.assert_array_equal(half, inv8)


def test_llama3_bands():
    """High frequencies kept, low ones divided by factor, a smooth band between."""
    inv, _ = rope_frequencies(128, rope_theta=500000.0, rope_scaling=LLAMA31_SCALING)
    base, _ = rope_frequencies(128, rope_theta=500000.0)
    wavelen = 2 * np.pi / base.astype(np.float64)
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    assert high.any() and low.any() and (~high & ~low).any()
    np.testing.assert_array_equal(inv[high], base[high])
    np.testing.assert_allclose(inv[low], base[low] / 8, rtol=1e-7)
    mid = ~high & ~low
    assert np.all(inv[mid] < base[mid]) and np.all(inv[mid] > base[mid] / 8)


def test_yarn_attention_factor_formulas():
    common = {"rope_type": "yarn", "original_max_position_embeddings": 4096}
    assert rope_frequencies(64, rope_scaling=dict(common, factor=40))[1] == pytest.approx(
        0.1 * math.log(40) + 1)
    # DeepSeek-V2: equal mscales cancel
    assert rope_frequencies(64, rope_scaling=DSV2_SCALING)[1] == pytest.approx(1.0)
    got = rope_frequencies(64, rope_scaling=dict(common, factor=40, mscale=1.0, mscale_all_dim=0.5))[1]
    assert got == pytest.approx((0.1 * math.log(40) + 1) / (0.05 * math.log(40) + 1))
    assert rope_frequencies(64, rope_scaling=dict(common, factor=40, attention_factor=0.5))[1] == 0.5
    # factor None: the ratio of the context lengths (DeepSeek-V3 style)
    a = rope_frequencies(64, rope_scaling=dict(common, factor=None), max_position_embeddings=4096 * 40)
    b = rope_frequencies(64, rope_scaling=dict(common, factor=40))
    np.testing.assert_array_equal(a[0], b[0])
    assert a[1] == b[1]


def test_longrope_attention_factor_formula():
    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
               "original_max_position_embeddings": 4096}
    _, factor = rope_frequencies(8, rope_scaling=scaling, max_position_embeddings=131072)
    assert factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert rope_frequencies(8, rope_scaling=dict(scaling, factor=1.0),
                            max_position_embeddings=131072)[1] == 1.0
    long, _ = rope_frequencies(8, rope_scaling=scaling, max_position_embeddings=131072, seq_len=5000)
    np.testing.assert_allclose(long, rope_frequencies(8)[0] / 2, rtol=1e-7)


LLAMA31_V4_DICT = {  # transformers 4.x / config.json layout
    "hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 131072,
    "rope_theta": 500000.0, "rope_scaling": dict(LLAMA31_SCALING),
}
LLAMA31_V5_DICT = {  # transformers 5.x layout: rope_theta inside rope_parameters
    "head_dim": 128, "max_position_embeddings": 131072,
    "rope_parameters": dict(LLAMA31_SCALING, rope_theta=500000.0),
}


@pytest.mark.parametrize("config", [
    LLAMA31_V4_DICT,
    LLAMA31_V5_DICT,
    types.SimpleNamespace(**LLAMA31_V5_DICT),
    types.SimpleNamespace(**LLAMA31_V4_DICT, rope_parameters=None),
    dict(LLAMA31_V4_DICT, rope_scaling={("type" if k == "rope_type" else k): v
                                        for k, v in LLAMA31_SCALING.items()}),
], ids=["v4-dict", "v5-dict", "v5-object", "v4-object", "legacy-type-key"])
def test_from_config_layouts(config):
    expected = rope_frequencies(128, 500000.0, LLAMA31_SCALING, max_position_embeddings=131072)
    got = from_config(config)
    np.testing.assert_array_equal(got[0], expected[0])
    assert got[1] == expected[1]


def test_from_config_details():
    # MLA: qk_rope_head_dim is the rotary part of a head
    inv, factor = from_config({"hidden_size": 5120, "num_attention_heads": 128, "qk_rope_head_dim": 64,
                               "max_position_embeddings": 163840, "rope_theta": 10000,
                               "rope_scaling": dict(DSV2_SCALING)})
    assert inv.shape == (32,) and factor == pytest.approx(1.0)
    # Phi-3: a top-level original_max_position_embeddings wins over the dict's
    phi3 = {"hidden_size": 3072, "num_attention_heads": 32, "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "longrope", "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG,
                             "original_max_position_embeddings": 8192}}
    long = rope_frequencies(96, rope_scaling=dict(phi3["rope_scaling"]), seq_len=9000,
                            max_position_embeddings=131072)[0]
    np.testing.assert_array_equal(from_config(phi3, seq_len=5000)[0], long)
    # no scaling at all, defaults everywhere
    np.testing.assert_array_equal(from_config({"head_dim": 8})[0], rope_frequencies(8)[0])
    # per-layer-type parameters (Gemma-3 style in transformers 5.x)
    nested = {"head_dim": 16, "max_position_embeddings": 8192, "layer_types": ["sliding_attention"],
              "rope_parameters": {
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                  "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}
    np.testing.assert_array_equal(from_config(nested, layer_type="full_attention")[0],
                                  rope_frequencies(16, 1e6, {"type": "linear", "factor": 8.0})[0])
    np.testing.assert_array_equal(from_config(nested, layer_type="sliding_attention")[0],
                                  rope_frequencies(16)[0])
    # partial rotary factor from GPT-NeoX's older key
    assert from_config({"hidden_size": 512, "num_attention_heads": 8, "rotary_pct": 0.25})[0].shape == (8,)


def _module_buffers(module, rotary_name, config, layer_type):
    """(inv_freq float64, attention factor) held by transformers' rotary module."""
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    emb = getattr(modeling, rotary_name)(config=config)
    if layer_type is None:
        return emb.inv_freq.double().numpy(), float(emb.attention_scaling)
    return (getattr(emb, f"{layer_type}_inv_freq").double().numpy(),
            float(getattr(emb, f"{layer_type}_attention_scaling", 1.0)))


# Configs read from their own classes' defaults (or the kwargs given), checked
# against the module the model builds. id -> (module, config class, rotary
# class, config kwargs, layer types, text config?)
HF_MODULE_CASES = {
    # MLA with partial_rotary_factor = qk_rope_head_dim / head_dim: not applied twice
    "mistral4": ("mistral4", "Mistral4Config", "Mistral4RotaryEmbedding", {}, [None], False),
    "deepseek-v4": ("deepseek_v4", "DeepseekV4Config", "DeepseekV4RotaryEmbedding", {},
                    ["main", "compress"], False),
    # proportional rope (full attention, head_dim 512 per layer) and default (sliding)
    "gemma4-text": ("gemma4", "Gemma4TextConfig", "Gemma4TextRotaryEmbedding", {},
                    ["full_attention", "sliding_attention"], False),
    "gemma4": ("gemma4", "Gemma4Config", "Gemma4TextRotaryEmbedding", {},
               ["full_attention", "sliding_attention"], True),
    "qwen2-vl": ("qwen2_vl", "Qwen2VLConfig", "Qwen2VLRotaryEmbedding", {}, [None], True),
    "qwen2.5-vl": ("qwen2_5_vl", "Qwen2_5_VLConfig", "Qwen2_5_VLRotaryEmbedding", {}, [None], True),
    # an explicit None turns truncation off in transformers (.get("truncate", True))
    "yarn-truncate-none": (
        "llama", "LlamaConfig", "LlamaRotaryEmbedding",
        dict(hidden_size=2880, num_attention_heads=64, head_dim=128, max_position_embeddings=131072,
             rope_theta=150000.0,
             rope_scaling={"rope_type": "yarn", "factor": 32.0, "truncate": None,
                           "original_max_position_embeddings": 4096}), [None], False),
    # legacy Phi-3 configs naming "yarn" mean LongRoPE
    "phi3-legacy-yarn": (
        "phi3", "Phi3Config", "Phi3RotaryEmbedding",
        dict(hidden_size=3072, num_attention_heads=32, max_position_embeddings=131072,
             original_max_position_embeddings=4096, rope_theta=10000.0,
             rope_scaling={"type": "yarn", "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG}),
        [None], False),
}


@pytest.mark.parametrize("case_id,layer_type",
                         [(k, t) for k, case in HF_MODULE_CASES.items() for t in case[4]])
def test_matches_transformers_modules(case_id, layer_type):
    transformers = _hf()
    module, config_name, rotary_name, kwargs, _, composite = HF_MODULE_CASES[case_id]
    config_cls = getattr(transformers, config_name, None)
    try:
        importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    except ImportError:
        config_cls = None
    if config_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    config = config_cls(**copy.deepcopy(kwargs))
    text = config.get_text_config() if composite else config
    ref = _module_buffers(module, rotary_name, text, layer_type)
    legacy = dict(config.to_dict())
    if case_id == "phi3-legacy-yarn":  # config.json as written: the class has rewritten it
        legacy.update(copy.deepcopy(kwargs), model_type="phi3", rope_parameters=None)
    for form in (config, config.to_dict(), legacy):
        _check(from_config(form, layer_type=layer_type), ref)


def test_proportional_hand_computed():
    inv, factor = rope_frequencies(16, 100.0, {"rope_type": "proportional"}, partial_rotary_factor=0.5)
    np.testing.assert_allclose(inv, [100.0 ** (-2 * f / 16) for f in range(4)] + [0] * 4, rtol=1e-7)
    assert inv.shape == (8,) and factor == 1.0
    full, _ = rope_frequencies(16, 100.0, {"rope_type": "proportional", "factor": 2.0})
    np.testing.assert_allclose(full, rope_frequencies(16, 100.0)[0] / 2, rtol=1e-7)
    # pairs counted by int(head_dim * factor // 2), an odd rotated width allowed
    assert np.count_nonzero(rope_frequencies(42, rope_scaling={"rope_type": "proportional"},
                                             partial_rotary_factor=0.5)[0]) == 10


def test_from_config_readings():
    yarn = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}
    untruncated = rope_frequencies(128, 150000.0, dict(yarn, truncate=False))[0]
    np.testing.assert_array_equal(rope_frequencies(128, 150000.0, dict(yarn, truncate=None))[0], untruncated)
    assert not np.array_equal(rope_frequencies(128, 150000.0, yarn)[0], untruncated)
    # whole-number floats for context lengths, as config files store them
    a = rope_frequencies(64, rope_scaling=dict(yarn, original_max_position_embeddings=4096.0),
                         max_position_embeddings=131072.0)
    b = rope_frequencies(64, rope_scaling=yarn, max_position_embeddings=131072)
    np.testing.assert_array_equal(a[0], b[0])
    assert a[1] == b[1]
    with pytest.raises(TypeError, match="max_position_embeddings"):
        rope_frequencies(64, rope_scaling={"type": "dynamic", "factor": 2.0}, max_position_embeddings=4096.5)
    # MLA: a factor that maps head_dim onto qk_rope_head_dim is applied once; one that does not
    # shrinks qk_rope_head_dim as before
    mla = {"head_dim": 128, "qk_rope_head_dim": 64, "rope_parameters": {"partial_rotary_factor": 0.5}}
    np.testing.assert_array_equal(from_config(mla)[0], rope_frequencies(64)[0])
    mla["rope_parameters"]["partial_rotary_factor"] = 0.25
    np.testing.assert_array_equal(from_config(mla)[0], rope_frequencies(16)[0])
    # composite configs: the text config; per-layer head_dim overrides by layer index
    text = {"head_dim": 32, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}
    np.testing.assert_array_equal(from_config({"text_config": text, "vision_config": {}})[0],
                                  from_config(text)[0])
    gemma = {"head_dim": 16, "layer_types": ["sliding_attention", "full_attention"],
             "per_layer_config": {"01": {"head_dim": 32}},
             "rope_parameters": {"sliding_attention": {"rope_type": "default"},
                                 "full_attention": {"rope_type": "proportional",
                                                    "partial_rotary_factor": 0.25}}}
    full = from_config(gemma, layer_type="full_attention")[0]
    assert full.shape == (16,) and np.count_nonzero(full) == 4
    assert from_config(gemma, layer_type="sliding_attention")[0].shape == (8,)


# ---------------------------------------------------------------------------
# bad input


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4,
            "original_max_position_embeddings": 4096}

BAD = [
    # (id, call, exception type, regex that must match)
    ("unknown type", lambda: rope_frequencies(64, rope_scaling={"rope_type": "ntk-by-parts"}),
     ValueError, r"rope_type.*'ntk-by-parts'.*default, linear, dynamic, yarn, llama3, longrope"),
    ("missing key", lambda: rope_frequencies(
        64, rope_scaling={k: v for k, v in LLAMA31_SCALING.items() if k != "low_freq_factor"}),
     ValueError, r"'llama3'.*'low_freq_factor'"),
    ("missing factor", lambda: rope_frequencies(64, rope_scaling={"type": "linear"}),
     ValueError, r"'linear'.*'factor'"),
    ("missing long_factor", lambda: rope_frequencies(
        8, rope_scaling={k: v for k, v in LONGROPE.items() if k != "long_factor"}),
     ValueError, r"'longrope'.*'long_factor'"),
    ("missing original", lambda: rope_frequencies(64, rope_scaling={"type": "yarn", "factor": 4.0}),
     ValueError, r"original_max_position_embeddings"),
    ("factor zero", lambda: rope_frequencies(64, rope_scaling={"type": "linear", "factor": 0}),
     ValueError, r"factor.*> 0"),
    ("factor negative", lambda: rope_frequencies(
        64, rope_scaling=dict(LLAMA31_SCALING, factor=-8.0)), ValueError, r"factor.*> 0"),
    ("factor not a number", lambda: rope_frequencies(
        64, rope_scaling={"type": "dynamic", "factor": "2"}, max_position_embeddings=8),
     TypeError, r"factor.*number"),
    ("factor nan", lambda: rope_frequencies(64, rope_scaling={"type": "linear", "factor": float("nan")}),
     ValueError, r"factor.*finite"),
    ("odd head_dim", lambda: rope_frequencies(63), ValueError, r"head_dim.*even"),
    ("head_dim zero", lambda: rope_frequencies(0), ValueError, r"head_dim.*positive"),
    ("head_dim float", lambda: rope_frequencies(64.0), TypeError, r"head_dim.*int"),
    ("partial zero", lambda: rope_frequencies(64, partial_rotary_factor=0.0),
     ValueError, r"partial_rotary_factor.*\(0, 1\]"),
    ("partial > 1", lambda: rope_frequencies(64, partial_rotary_factor=1.5),
     ValueError, r"partial_rotary_factor.*\(0, 1\]"),
    ("partial odd rotary_dim", lambda: rope_frequencies(10, partial_rotary_factor=0.5),
     ValueError, r"partial_rotary_factor.*rotary_dim 5"),
    ("theta zero", lambda: rope_frequencies(64, rope_theta=0.0), ValueError, r"rope_theta"),
    ("theta conflict", lambda: rope_frequencies(64, rope_theta=1e4, rope_scaling={"rope_theta": 1e6}),
     ValueError, r"rope_theta.*once"),
    ("scaling not a dict", lambda: rope_frequencies(64, rope_scaling="linear"),
     TypeError, r"rope_scaling.*dict"),
    ("dynamic without max", lambda: rope_frequencies(64, rope_scaling={"type": "dynamic", "factor": 2}),
     ValueError, r"max_position_embeddings"),
    ("llama3 high <= low", lambda: rope_frequencies(
        64, rope_scaling=dict(LLAMA31_SCALING, high_freq_factor=1.0)),
     ValueError, r"high_freq_factor.*low_freq_factor"),
    ("longrope short length", lambda: rope_frequencies(8, rope_scaling=dict(LONGROPE, short_factor=[1.0] * 3)),
     ValueError, r"short_factor.*4 numbers"),
    ("longrope bad value", lambda: rope_frequencies(8, rope_scaling=dict(LONGROPE, long_factor=[1, 1, 0, 1])),
     ValueError, r"long_factor.*> 0"),
    ("yarn attention_factor", lambda: rope_frequencies(
        64, rope_scaling=dict(DSV2_SCALING, attention_factor=-1.0)), ValueError, r"attention_factor"),
    ("negative seq_len", lambda: rope_frequencies(64, seq_len=-1), ValueError, r"seq_len"),
    ("float seq_len", lambda: rope_frequencies(64, seq_len=10.5), TypeError, r"seq_len"),
    ("max_position_embeddings zero", lambda: rope_frequencies(64, max_position_embeddings=0),
     ValueError, r"max_position_embeddings"),
    ("config without head_dim", lambda: from_config({"rope_theta": 1e4}), ValueError, r"head_dim"),
    # a model name reads as an object without attributes: say what is taken instead
    ("config model name", lambda: from_config("meta-llama/Llama-3-8B"),
     TypeError, r"config: .*config object or a dict.*downloads nothing.*'meta-llama/Llama-3-8B'"),
    ("config path", lambda: from_config(pathlib.Path("config.json")),
     TypeError, r"config: .*config object or a dict.*downloads nothing"),
    ("config None", lambda: from_config(None), TypeError, r"config: expected a config object or a dict"),
    ("config list", lambda: from_config([("head_dim", 64)]),
     TypeError, r"config: expected a config object or a dict, got list"),
    ("nested without layer_type", lambda: from_config(
        {"head_dim": 8, "rope_parameters": {"full_attention": {"rope_type": "default"},
                                            "sliding_attention": {"rope_type": "default"}}}),
     ValueError, r"layer_type.*full_attention"),
    ("nested unknown layer_type", lambda: from_config(
        {"head_dim": 8, "rope_parameters": {"full_attention": {"rope_type": "default"}}},
        layer_type="local"), ValueError, r"layer_type.*full_attention.*'local'"),
    ("table rows", lambda: cos_sin_cache(np.ones(4, np.float32), 0), ValueError, r"max_position"),
    ("table inv_freq 2-D", lambda: cos_sin_cache(np.ones((2, 4), np.float32), 8),
     ValueError, r"inv_freq.*1-D"),
    ("table inv_freq inf", lambda: cos_sin_cache(np.array([1.0, np.inf]), 8),
     ValueError, r"inv_freq.*finite"),
    ("table attention_factor", lambda: cos_sin_cache(np.ones(4, np.float32), 8, attention_factor=-1.0),
     ValueError, r"attention_factor"),
]


@pytest.mark.parametrize("call,exc,pattern", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


# ---------------------------------------------------------------------------
# cos / sin tables


@pytest.mark.parametrize("scaling,factor_expected", [
    (None, 1.0), (LLAMA31_SCALING, 1.0), (dict(DSV2_SCALING, mscale=1.0), None)])
def test_cos_sin_cache_against_float64(scaling, factor_expected):
    inv, factor = rope_frequencies(128, 500000.0, scaling, max_position_embeddings=163840)
    if factor_expected is not None:
        assert factor == factor_expected
    rows = 131072
    cos, sin = cos_sin_cache(inv, rows, attention_factor=factor)
    for t in (cos, sin):
        assert isinstance(t, np.ndarray) and t.dtype == np.float32
        assert t.shape == (rows, 64) and t.flags.c_contiguous
    angle = np.arange(rows, dtype=np.float64)[:, None] * inv.astype(np.float64)[None, :]
    for got, ref in ((cos, factor * np.cos(angle)), (sin, factor * np.sin(angle))):
        # one float32 rounding of the float64 value
        err = np.abs(got.astype(np.float64) - ref)
        assert np.all(err <= 2.0 ** -24 * np.abs(ref) + 1e-45), err.max()
    np.testing.assert_array_equal(cos[0], np.float32(factor))
    np.testing.assert_array_equal(sin[0], 0.0)


def test_cos_sin_cache_conventions():
    inv64 = 1.0 / 10000 ** (np.arange(0, 16, 2) / 16)
    # inputs are rounded to float32 first: the angles of the kernel's inv_freq path
    a = cos_sin_cache(inv64, 64)
    b = cos_sin_cache(inv64.astype(np.float32), 64)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    c = cos_sin_cache(inv64, 64, device_array_module=np)
    np.testing.assert_array_equal(c[0], a[0])
    # the attention factor scales both tables
    s = cos_sin_cache(inv64, 64, attention_factor=1.25)
    np.testing.assert_allclose(s[0], 1.25 * a[0].astype(np.float64), rtol=1e-7, atol=1e-7)
    np.testing.assert_allclose(s[1], 1.25 * a[1].astype(np.float64), rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("module", [fq, reference], ids=["frequencies", "reference"])
def test_docstring_examples(module):
    """The Examples of the public functions run as written."""
    import doctest

    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted and not result.failed


def _fake_cupy(device_count):
    """A stand-in CuPy whose runtime reports ``device_count`` devices, or
    raises as CuPy does on a machine without a CUDA driver."""
    def get_device_count():
        if device_count is None:
            raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient "
                               "for CUDA runtime version")
        return device_count
    runtime = types.SimpleNamespace(getDeviceCount=get_device_count)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))


@pytest.mark.parametrize("cupy_module", [None, _fake_cupy(None), _fake_cupy(0)],
                         ids=["cupy missing", "no driver", "zero devices"])
def test_cos_sin_cache_gpu_without_device(monkeypatch, cupy_module):
    monkeypatch.setitem(sys.modules, "cupy", cupy_module)  # None: import cupy fails
    with pytest.raises(RuntimeError, match=r"cos_sin_cache_gpu: no CUDA device was found.*"
                                           r"NumPy reference path still works"):
        fq.cos_sin_cache_gpu(np.ones(4, np.float32), 8)


def test_cos_sin_cache_gpu_on_this_machine():
    """Where there is no GPU, the real CuPy error comes out as the one clear error."""
    from helpers import gpu_available

    if gpu_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="cos_sin_cache_gpu: no CUDA device was found"):
        fq.cos_sin_cache_gpu(np.ones(4, np.float32), 8)


@pytest.mark.gpu
def test_cos_sin_cache_gpu_matches_cpu():
    import cupy

    for scaling, rows in ((None, 4096), (LLAMA31_SCALING, 131072), (dict(DSV2_SCALING, mscale=1.0), 5000)):
        inv, factor = rope_frequencies(128, 500000.0, scaling, max_position_embeddings=163840)
        ref_cos, ref_sin = cos_sin_cache(inv, rows, attention_factor=factor)
        for source in (inv, cupy.asarray(inv)):
            cos, sin = fq.cos_sin_cache_gpu(source, rows, attention_factor=factor)
            for got, ref in ((cos, ref_cos), (sin, ref_sin)):
                assert isinstance(got, cupy.ndarray) and got.dtype == cupy.float32
                assert got.shape == ref.shape and got.flags.c_contiguous
                # each side is one rounding of a float64 value: at most one float32 ulp apart
                err = np.abs(cupy.asnumpy(got).astype(np.float64) - ref.astype(np.float64))
                assert np.all(err <= 2.0 ** -23 * np.abs(ref.astype(np.float64)) + 1e-45), err.max()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("source", ["inv_freq", "table"])
def test_proportional_through_kernels(rng, source, dtype):
    """Gemma 4's proportional frequencies rotate the whole head: the pairs of
    frequency 0 come out bit for bit as they went in, the others as the reference."""
    from helpers import assert_close, np_dtype, oracle
    from gpu_util import bits, to_device, to_host

    import cupy_rope

    head_dim = 128
    inv, _ = rope_frequencies(head_dim, 1e6, {"rope_type": "proportional"}, partial_rotary_factor=0.25)
    x = rng.standard_normal((2, 96, 4, head_dim)).astype(np_dtype(dtype))
    if source == "inv_freq":
        kw = dict(inv_freq=inv)
        dev = dict(inv_freq=to_device(inv))
    else:
        cos, sin = cos_sin_cache(inv, 96)
        kw = dict(cos=cos, sin=sin)
        dev = dict(cos=to_device(cos), sin=to_device(sin))
    out = to_host(cupy_rope.apply_rope(to_device(x), **dev))
    assert_close(out, oracle(x, **kw), dtype)
    still = np.zeros(head_dim, dtype=bool)
    still[16:64] = still[64 + 16:] = True  # NeoX pairs (f, f + 64) with f >= 16 have frequency 0
    np.testing.assert_array_equal(bits(out[..., still]), bits(x[..., still]))
    assert not np.array_equal(bits(out[:, 1:, :, ~still]), bits(x[:, 1:, :, ~still]))
