"""cupy_rope.hf on the CPU: which models ``patch`` takes, and that a patched
model computes what the stock one does (tiny random models from configs,
nothing downloaded). The kernel path runs through the NumPy reference by
letting ``_fits`` accept CPU tensors (``cpu_kernel_path``); the GPU tests
(test_hf_gpu.py) run it on the device."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import cupy_rope.hf as crhf  # noqa: E402
import cupy_rope.torch as crt  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)

# model type -> (config class, model class, extra config); the Llama formula or not
LLAMA_FORMULA = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "phi3-partial": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.75,
                                                       "pad_token_id": 0}),
}
OTHER_FORMULA = {  # interleaved pairs, rotation the other way, other argument orders
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {"head_dim": 16}),
    "nanochat": ("NanoChatConfig", "NanoChatForCausalLM", {}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {"n_embd": 64, "n_head": 4, "n_layer": 1,
                                               "rotary_dim": 8, "n_positions": 128}),
}


def build(case):
    config_name, model_name, extra = case
    config_cls = getattr(transformers, config_name, None)
    model_cls = getattr(transformers, model_name, None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    torch.manual_seed(0)
    kw = {**SMALL, **extra} if config_name != "GPTJConfig" else {"vocab_size": 64, **extra}
    model = model_cls(config_cls(**kw))
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.fixture
def cpu_kernel_path(monkeypatch):
    """The drop-in takes CPU tensors to the kernel path (the NumPy reference
    behind cupy_rope.torch), counting its calls."""
    monkeypatch.setattr(crhf, "_DEVICES", ("cuda", "cpu"))
    calls = []
    for name in ("rope_qk", "qk_norm_rope"):  # rotation alone; fused q/k norms + rotation
        orig = getattr(crt, name)

        def spy(*a, _orig=orig, **k):
            calls.append(k.get("rotary_dim"))
            return _orig(*a, **k)

        monkeypatch.setattr(crt, name, spy)
    return calls


def logits(model):
    ids = torch.arange(12).reshape(2, 6) % SMALL["vocab_size"]
    position_ids = torch.arange(6)[None, :] + torch.tensor([[0], [3]])
    with torch.no_grad():
        return model(input_ids=ids, position_ids=position_ids).logits.numpy()


@pytest.mark.parametrize("name", LLAMA_FORMULA)
def test_llama_formula_models_are_patched_and_unchanged(name, cpu_kernel_path):
    model = build(LLAMA_FORMULA[name])
    stock = logits(model)
    crhf.patch(model)
    got = logits(model)
    assert cpu_kernel_path, "the kernel path was not taken"
    if name == "phi3-partial":  # cos narrower than the head: rotary_dim = its width
        assert set(cpu_kernel_path) == {12}
    np.testing.assert_allclose(got, stock, rtol=1e-5, atol=1e-5)
    crhf.unpatch(model)
    np.testing.assert_array_equal(logits(model), stock)


@pytest.mark.parametrize("name", OTHER_FORMULA)
def test_other_formulas_are_refused_not_rotated_wrongly(name, cpu_kernel_path):
    model = build(OTHER_FORMULA[name])
    stock = logits(model)
    with pytest.raises(ValueError, match="is not the Llama formula"):
        crhf.patch(model)
    assert not cpu_kernel_path
    np.testing.assert_array_equal(logits(model), stock)


def test_fallback_is_the_models_own_function():
    """Off the kernel path (CPU tensors), a patched partial-rotary model runs
    its own function: the same logits, where Llama's formula would fail."""
    model = build(LLAMA_FORMULA["phi3-partial"])
    stock = logits(model)
    crhf.patch(model)
    np.testing.assert_array_equal(logits(model), stock)


def test_formula_probe():
    from transformers.models.cohere import modeling_cohere
    from transformers.models.llama import modeling_llama
    from transformers.models.phi3 import modeling_phi3

    assert crhf._formula(modeling_llama.apply_rotary_pos_emb) == (True, False)
    assert crhf._formula(modeling_phi3.apply_rotary_pos_emb) == (True, True)
    assert crhf._formula(modeling_cohere.apply_rotary_pos_emb) == (False, False)
    assert crhf._formula(lambda tensor, sin, cos: tensor) == (False, False)


def test_formula_probe_takes_fp32_and_in_place_functions():
    """Functions that compute in fp32 (ModernBERT) or rotate their inputs in
    place are the formula too; the probe does not follow a default device."""
    from transformers.models.llama import modeling_llama

    def fp32(q, k, cos, sin, unsqueeze_dim=1):
        qf, kf = modeling_llama.apply_rotary_pos_emb(q.float(), k.float(), cos, sin, unsqueeze_dim)
        return qf.to(q.dtype), kf.to(k.dtype)

    def in_place(q, k, cos, sin, unsqueeze_dim=1):
        qo, ko = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
        q.copy_(qo)
        k.copy_(ko)
        return q, k

    def other_direction(q, k, cos, sin, unsqueeze_dim=1):
        return modeling_llama.apply_rotary_pos_emb(q, k, cos, -sin, unsqueeze_dim)

    assert crhf._formula(fp32) == (True, False)
    assert crhf._formula(in_place) == (True, False)
    assert crhf._formula(other_direction) == (False, False)
    modeling = pytest.importorskip("transformers.models.modernbert.modeling_modernbert")
    assert crhf._formula(modeling.apply_rotary_pos_emb)[0]
    with torch.device("meta"):
        crhf._FORMULAS.pop(modeling_llama.apply_rotary_pos_emb, None)
        assert crhf._formula(modeling_llama.apply_rotary_pos_emb) == (True, False)


def test_patching_a_cpu_model_says_the_kernels_need_cuda():
    """hf.patch on a model whose parameters are all on the CPU warns that the
    patched layers run the model's own formula there (no silent no-op)."""
    model = build(LLAMA_FORMULA[next(iter(LLAMA_FORMULA))])
    with pytest.warns(UserWarning, match="CUDA device"):
        crhf.patch(model)
