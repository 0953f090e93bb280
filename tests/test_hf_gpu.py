"""cupy_rope.hf: tiny random Llama / Qwen2 models give the stock logits and gradients (GPU).

Models are built from a config (random weights, nothing downloaded).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import cupy_rope.hf as crhf  # noqa: E402
import cupy_rope.torch as crt  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
SMALL = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def build(kind, rope_parameters=None):
    torch.manual_seed(0)
    kw = dict(SMALL)
    if rope_parameters is not None:
        kw["rope_parameters"] = rope_parameters
    if kind == "llama":
        cfg = transformers.LlamaConfig(**kw)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**kw)
        model = transformers.Qwen2ForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    return model.to(DEV)


@pytest.fixture
def count_kernel_calls(monkeypatch):
    """Counts the cupy-rope launches made through cupy_rope.torch."""
    calls = []
    for name in ("rope_qk", "rope"):
        orig = getattr(crt, name)

        def spy(*a, _orig=orig, **k):
            calls.append(1)
            return _orig(*a, **k)

        monkeypatch.setattr(crt, name, spy)
    return calls


def run(model, ids, position_ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, position_ids=position_ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().float().cpu().numpy() for n, p in model.named_parameters()}
    return out.logits.detach().float().cpu().numpy(), grads


def inputs(batch=2, seq=24, shifts=(0, 5)):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (batch, seq), generator=g).to(DEV)
    position_ids = (torch.arange(seq)[None, :] + torch.tensor(shifts)[:batch, None]).to(DEV)
    return ids, position_ids


def rel(a, b):
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 2])
def test_fp32_logits_and_gradients_match_stock(kind, batch, count_kernel_calls):
    model = build(kind)
    patched = crhf.patch(copy.deepcopy(model))
    ids, position_ids = inputs(batch)
    ref_logits, ref_grads = run(model, ids, position_ids)
    n0 = len(count_kernel_calls)
    assert n0 == 0  # the stock model never calls the kernel
    logits, grads = run(patched, ids, position_ids)
    assert len(count_kernel_calls) == SMALL["num_hidden_layers"]  # one rope_qk per layer
    assert rel(logits, ref_logits) < 1e-5
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert rel(grads[name], ref_grads[name]) < 1e-4, name


def test_scaled_rope_type_keeps_the_attention_factor():
    """YaRN multiplies cos/sin by an attention factor: the tables carry it over."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "rope_theta": 10000.0}
    model = build("llama", rope)
    assert model.model.rotary_emb.attention_scaling != 1.0
    patched = crhf.patch(copy.deepcopy(model))
    ids, position_ids = inputs(2, 40, (0, 100))
    ref_logits, ref_grads = run(model, ids, position_ids)
    logits, grads = run(patched, ids, position_ids)
    assert rel(logits, ref_logits) < 1e-5
    for name in grads:
        assert rel(grads[name], ref_grads[name]) < 1e-4, name


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bf16_as_close_to_fp32_as_stock(kind):
    """In bf16 the kernel (fp32 math, one rounding) is at least about as accurate as stock."""
    model32 = build(kind)
    ids, position_ids = inputs(2)
    ref_logits, ref_grads = run(model32, ids, position_ids)
    stock = copy.deepcopy(model32).to(torch.bfloat16)
    patched = crhf.patch(copy.deepcopy(model32).to(torch.bfloat16))
    s_logits, s_grads = run(stock, ids, position_ids)
    p_logits, p_grads = run(patched, ids, position_ids)
    assert rel(p_logits, ref_logits) <= 1.5 * rel(s_logits, ref_logits) + 2e-3
    assert rel(p_logits, s_logits) < 5e-2
    for name in ref_grads:
        assert rel(p_grads[name], ref_grads[name]) <= \
            1.5 * rel(s_grads[name], ref_grads[name]) + 5e-3, name


def test_patch_is_per_model_idempotent_and_undone(count_kernel_calls):
    model = build("llama")
    other = copy.deepcopy(model)
    assert crhf.patch(model) is model
    crhf.patch(model)  # idempotent
    ids, position_ids = inputs(1)
    with torch.no_grad():
        other(input_ids=ids, position_ids=position_ids)
        assert len(count_kernel_calls) == 0  # another instance of the class is untouched
        model(input_ids=ids, position_ids=position_ids)
        n = SMALL["num_hidden_layers"]
        assert len(count_kernel_calls) == n
        crhf.unpatch(model)
        model(input_ids=ids, position_ids=position_ids)
        assert len(count_kernel_calls) == n
    with pytest.raises(ValueError, match="found no attention layer"):
        crhf.patch(torch.nn.Linear(2, 2))


def test_decode_with_kv_cache():
    """Prefill, then one token at a time through the KV cache (s = 1, shifted positions)."""
    model = build("qwen2").eval()
    patched = crhf.patch(copy.deepcopy(model))
    ids, _ = inputs(2, 12)
    with torch.no_grad():
        outs = []
        for m in (model, patched):
            out = m(input_ids=ids[:, :8], use_cache=True)
            logits, cache = [out.logits], out.past_key_values
            for i in range(8, 12):
                out = m(input_ids=ids[:, i:i + 1], past_key_values=cache, use_cache=True)
                logits.append(out.logits)
                cache = out.past_key_values
            outs.append(torch.cat(logits, dim=1).float().cpu().numpy())
    assert rel(outs[1], outs[0]) < 1e-5


def test_drop_in_function_falls_back_off_the_gpu():
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    stock = transformers.models.llama.modeling_llama.apply_rotary_pos_emb
    for a, b in zip(crhf.apply_rotary_pos_emb(q, k, cos, sin), stock(q, k, cos, sin)):
        assert torch.equal(a, b)
