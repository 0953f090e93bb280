"""cupy_rope.hf: layers that normalize q and k before the rotation run the
fused q/k RMSNorm + RoPE op (tiny random models from configs, nothing
downloaded).

CPU: which layers and norms the probes take, that a patched model computes
what the stock one does off the kernel path (the model's own norms and
rotation, bit for bit) and on it (the ops' NumPy reference, made reachable
for CPU tensors by ``cpu_kernel_path``), ``torch.compile``, ``deepcopy`` and
``unpatch``. GPU (marked ``gpu``): logits and every parameter gradient
against the stock model in float32 and bfloat16, and KV-cache generation.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import cupy_rope.hf as crhf  # noqa: E402
import cupy_rope.torch as crt  # noqa: E402

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             head_dim=16)

# name: (config class, model class, the norms the probe must find, eps aside)
MODELS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", crhf._Norms("head", "w", "before_weight", 0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", crhf._Norms("token", "w", "after_weight", 0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               crhf._Norms("head", "1+w", "after_weight", 0)),
}


def build(name, device="cpu", dtype=torch.float32, **extra):
    """A tiny random model; its q/k norm weights randomized too (the
    initial ones, all equal, would hide a wrong weight mode or scope)."""
    config_name, model_name, _ = MODELS[name]
    config_cls = getattr(transformers, config_name, None)
    model_cls = getattr(transformers, model_name, None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    torch.manual_seed(0)
    kw = {**SMALL, **extra}
    if name == "olmo2":
        kw.update(eos_token_id=0, pad_token_id=1)
    model = model_cls(config_cls(**kw))
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(torch.randn(p.shape) * 0.3 + (0.0 if name == "gemma3" else 1.0))
    return model.to(device, dtype).eval()


def attention_layers(model):
    return [m for m in model.modules() if hasattr(m, "q_norm") and hasattr(m, "k_norm")]


def inputs(device="cpu", batch=2, seq=12, shifts=(0, 5)):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (batch, seq), generator=g)
    position_ids = torch.arange(seq)[None, :] + torch.tensor(shifts)[:batch, None]
    return ids.to(device), position_ids.to(device)


def logits(model, device="cpu"):
    ids, position_ids = inputs(device)
    with torch.no_grad():
        return model(input_ids=ids, position_ids=position_ids).logits.float().cpu().numpy()


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the fused and the rotation-only launches made through cupy_rope.torch."""
    calls = []
    for name in ("qk_norm_rope", "rope_qk"):
        orig = getattr(crt, name)

        def spy(*a, _orig=orig, _name=name, **k):
            calls.append(_name)
            return _orig(*a, **k)

        monkeypatch.setattr(crt, name, spy)
    return calls


@pytest.fixture
def cpu_kernel_path(monkeypatch, fused_calls):
    """The drop-ins take CPU tensors to the ops (the NumPy reference behind
    cupy_rope.torch), counting the calls."""
    monkeypatch.setattr(crhf, "_DEVICES", ("cuda", "cpu"))
    return fused_calls


# ----------------------------------------------------------------- CPU ----
@pytest.mark.parametrize("name", MODELS)
def test_layers_are_fused_with_the_norms_they_use(name):
    model = build(name)
    crhf.patch(model)
    layers = attention_layers(model)
    assert len(layers) == SMALL["num_hidden_layers"]
    for layer in layers:
        forward = layer.__dict__["forward"]
        assert isinstance(forward, crhf._FusedForward)
        assert forward.norms == MODELS[name][2]._replace(eps=model.config.rms_norm_eps)
        assert layer.q_norm.forward is crhf._deferred_norm
        assert layer.k_norm.forward is crhf._deferred_norm
    crhf.unpatch(model)
    for layer in layers:
        assert "forward" not in layer.__dict__
        assert "forward" not in layer.q_norm.__dict__ and "forward" not in layer.k_norm.__dict__


@pytest.mark.parametrize("name", MODELS)
def test_off_the_kernel_path_the_model_computes_as_stock(name, fused_calls):
    """CPU tensors: the layer's own norms, then its own rotation, bit for bit."""
    model = build(name)
    stock = logits(model)
    crhf.patch(model)
    np.testing.assert_array_equal(logits(model), stock)
    assert not fused_calls
    crhf.unpatch(model)
    np.testing.assert_array_equal(logits(model), stock)


@pytest.mark.parametrize("name", MODELS)
def test_kernel_path_logits_and_gradients(name, cpu_kernel_path):
    """On the fused op (NumPy reference), one launch per layer: logits and
    every parameter gradient (the norms' weights included) as stock."""
    model = build(name)
    patched = crhf.patch(copy.deepcopy(model))
    ids, position_ids = inputs()
    results = []
    for m in (model, patched):
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids, position_ids=position_ids, labels=ids)
        out.loss.backward()
        results.append((out.logits.detach().numpy(),
                        {n: p.grad.numpy() for n, p in m.named_parameters()}))
    assert cpu_kernel_path == ["qk_norm_rope"] * SMALL["num_hidden_layers"]
    (ref_logits, ref_grads), (got_logits, got_grads) = results
    np.testing.assert_allclose(got_logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == ref_grads.keys()
    for n in ref_grads:
        scale = np.abs(ref_grads[n]).max()
        np.testing.assert_allclose(got_grads[n], ref_grads[n], rtol=1e-4, atol=1e-5 * scale,
                                   err_msg=n)


@pytest.mark.parametrize("weight_dtype,path", [(torch.float32, "qk_norm_rope"),
                                               (torch.float64, "rope_qk")])
def test_weight_dtypes(weight_dtype, path, cpu_kernel_path):
    """OLMo 2 multiplies by its weight in float32 whatever the weight's dtype:
    float32 weights with bfloat16 activations go to the fused kernel; float64
    weights (which it cannot take) to the layer's own norms, then the
    rotation-only kernel. The logits are the stock model's either way."""
    model = build("olmo2", dtype=torch.bfloat16)
    for layer in attention_layers(model):
        for norm in (layer.q_norm, layer.k_norm):
            norm.weight.data = norm.weight.data.to(weight_dtype)
    stock = logits(model)
    crhf.patch(model)
    got = logits(model)
    assert set(cpu_kernel_path) == {path}
    np.testing.assert_allclose(got, stock, rtol=0, atol=0.02 * np.abs(stock).max())


def test_weights_fit():
    norms = crhf._Norms("head", "w", "before_weight", 1e-6)
    q, k = torch.empty(2, 4, 3, 16, dtype=torch.bfloat16), torch.empty(2, 2, 3, 16,
                                                                       dtype=torch.bfloat16)
    w = torch.ones(16, dtype=torch.bfloat16)
    assert crhf._weights_fit(q, k, w, w, norms)
    assert not crhf._weights_fit(q, k, w.float(), w.float(), norms)  # the product would promote
    assert crhf._weights_fit(q, k, w.float(), w.float(), norms._replace(rounding="after_weight"))
    assert not crhf._weights_fit(q, k, w, torch.ones(32, dtype=torch.bfloat16), norms)
    assert not crhf._weights_fit(q, k, w, torch.ones(32, dtype=torch.bfloat16)[::2], norms)
    token = norms._replace(scope="token")
    assert crhf._weights_fit(q, k, torch.ones(64, dtype=torch.bfloat16),
                             torch.ones(32, dtype=torch.bfloat16), token)
    assert not crhf._weights_fit(q, k, w, w, token)


def test_compile_fullgraph(monkeypatch):
    """torch.compile(fullgraph=True) traces a fused layer's forward with no
    graph break (the fused op in the graph, once per layer) and no
    recompilation from call to call."""
    from torch._dynamo.backends.debugging import aot_eager
    from torch._dynamo.utils import counters

    monkeypatch.setattr(crhf, "_DEVICES", ("cuda", "cpu"))
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    model = crhf.patch(build("olmo2"))
    want = logits(model)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for _ in range(2):
        np.testing.assert_allclose(logits(compiled), want, rtol=1e-6, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1
    assert sum("cupy_rope.qk_norm_rope" in t for t in targets) == SMALL["num_hidden_layers"]


def test_deepcopy_of_a_patched_model_uses_its_own_weights(cpu_kernel_path):
    model = crhf.patch(build("qwen3"))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for layer in attention_layers(twin):
            layer.k_norm.weight.mul_(2.0)
    got = logits(twin)
    assert cpu_kernel_path
    want = logits(crhf.unpatch(copy.deepcopy(twin)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(logits(model), want, rtol=1e-3, atol=1e-3)


def test_patch_is_idempotent():
    model = build("olmo2")
    crhf.patch(model)
    forwards = [layer.__dict__["forward"] for layer in attention_layers(model)]
    crhf.patch(model)
    assert [layer.__dict__["forward"] for layer in attention_layers(model)] == forwards


def test_norm_probe():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    assert crhf._norm_kind(Qwen3RMSNorm(16, eps=1e-5)) == ("w", "before_weight", 1e-5, 16)
    assert crhf._norm_kind(Olmo2RMSNorm(64)) == ("w", "after_weight", 1e-6, 64)
    assert crhf._norm_kind(Gemma3RMSNorm(16)) == ("1+w", "after_weight", 1e-6, 16)
    assert crhf._norm_kind(torch.nn.LayerNorm(16)) is None  # subtracts the mean

    class WrongEps(Qwen3RMSNorm):
        def forward(self, x):  # adds eps outside the square root
            xf = x.float()
            return self.weight * (xf / (xf.pow(2).mean(-1, keepdim=True).sqrt()
                                        + self.variance_epsilon)).to(x.dtype)

    assert crhf._norm_kind(WrongEps(16)) is None
    with torch.device("meta"):  # the probe runs on the CPU whatever the default device
        assert crhf._norm_kind(Qwen3RMSNorm(16)) == ("w", "before_weight", 1e-6, 16)


# A layer whose norm does not sit right before the rotation: the layer probe refuses it.
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402

apply_rotary_pos_emb = modeling_qwen3.apply_rotary_pos_emb  # the global the layers call


class NormThenScale(modeling_qwen3.Qwen3Attention):
    """q scaled between its norm and the rotation."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        q, k, v = _projections(self, hidden_states)
        q, k = self.q_norm(q) * 2.0, self.k_norm(k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *position_embeddings)
        return _attend(self, q, k, v)


class RopeThenNorm(modeling_qwen3.Qwen3Attention):
    """The norms after the rotation (as Llama 4 applies its L2 norm)."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        q, k, v = _projections(self, hidden_states)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *position_embeddings)
        q, k = self.q_norm(q), self.k_norm(k)
        return _attend(self, q, k, v)


def _projections(self, hidden_states):
    """q, k [b, s, h, d] and v [b, h, s, d]."""
    b, s, _ = hidden_states.shape
    q = self.q_proj(hidden_states).view(b, s, -1, self.head_dim)
    k = self.k_proj(hidden_states).view(b, s, -1, self.head_dim)
    return q, k, self.v_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)


def _attend(self, q, k, v):
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    b, _, s, _ = q.shape
    return self.o_proj(o.transpose(1, 2).reshape(b, s, -1)), None


@pytest.mark.parametrize("cls", [NormThenScale, RopeThenNorm])
def test_layer_probe_refuses_other_structures(cls, cpu_kernel_path):
    """Right norms, wrong place: the layer is rotated only, and computes as before."""
    model = build("qwen3")
    for layer in model.model.layers:
        layer.self_attn.__class__ = cls
    stock = logits(model)
    crhf.patch(model)
    for layer in attention_layers(model):
        assert not isinstance(layer.__dict__["forward"], crhf._FusedForward)
        assert "forward" not in layer.q_norm.__dict__
    np.testing.assert_allclose(logits(model), stock, rtol=1e-5, atol=1e-5)
    assert set(cpu_kernel_path) == {"rope_qk"}


# ----------------------------------------------------------------- GPU ----
DEV = "cuda"


def run(model, ids, position_ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, position_ids=position_ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().float().cpu().numpy() for n, p in model.named_parameters()}
    return out.logits.detach().float().cpu().numpy(), grads


def rel(a, b):
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", ["qwen3", "olmo2"])
def test_gpu_fp32_logits_and_gradients_match_stock(name, batch, fused_calls):
    model = build(name, DEV, head_dim=64)
    patched = crhf.patch(copy.deepcopy(model))
    ids, position_ids = inputs(DEV, batch, 24)
    ref_logits, ref_grads = run(model, ids, position_ids)
    assert not fused_calls
    got_logits, got_grads = run(patched, ids, position_ids)
    assert fused_calls == ["qk_norm_rope"] * SMALL["num_hidden_layers"]
    assert rel(got_logits, ref_logits) < 1e-5
    assert got_grads.keys() == ref_grads.keys()
    for n in ref_grads:
        assert rel(got_grads[n], ref_grads[n]) < 1e-4, n


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3", "olmo2"])
def test_gpu_bf16_as_close_to_fp32_as_stock(name):
    """bf16: the fused op rounds where the stock norms do, so the patched
    model is about as far from the fp32 model as the stock bf16 one."""
    model32 = build(name, DEV, head_dim=64)
    ids, position_ids = inputs(DEV, 2, 24)
    ref_logits, ref_grads = run(model32, ids, position_ids)
    stock = copy.deepcopy(model32).to(torch.bfloat16)
    patched = crhf.patch(copy.deepcopy(model32).to(torch.bfloat16))
    s_logits, s_grads = run(stock, ids, position_ids)
    p_logits, p_grads = run(patched, ids, position_ids)
    assert rel(p_logits, ref_logits) <= 1.5 * rel(s_logits, ref_logits) + 2e-3
    assert rel(p_logits, s_logits) < 5e-2
    for n in ref_grads:
        assert rel(p_grads[n], ref_grads[n]) <= 1.5 * rel(s_grads[n], ref_grads[n]) + 5e-3, n


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3", "olmo2"])
def test_gpu_generate_with_kv_cache(name, fused_calls):
    """Greedy generation through the KV cache (prefill, then one token a
    step): the same tokens, and per-step logits as stock."""
    model = build(name, DEV, head_dim=64)
    patched = crhf.patch(copy.deepcopy(model))
    ids, _ = inputs(DEV, 2, 10)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, use_cache=True,
              output_logits=True, return_dict_in_generate=True, pad_token_id=1)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        got = patched.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    steps = len(got.logits)  # prefill, then one forward a token through the cache
    assert steps == 6 and fused_calls == ["qk_norm_rope"] * steps * SMALL["num_hidden_layers"]
    for a, b in zip(got.logits, want.logits):
        assert rel(a.float().cpu().numpy(), b.float().cpu().numpy()) < 1e-5


@pytest.mark.gpu
def test_gpu_unpatch_restores_the_stock_forward(fused_calls):
    model = build("qwen3", DEV, head_dim=64)
    stock = logits(model, DEV)
    crhf.patch(model)
    patched = logits(model, DEV)
    assert fused_calls and rel(patched, stock) < 1e-5
    fused_calls.clear()
    crhf.unpatch(model)
    np.testing.assert_array_equal(logits(model, DEV), stock)
    assert not fused_calls


@pytest.mark.parametrize("name", MODELS)
def test_patching_leaves_the_global_rng_alone(name):
    """The probes build a small copy of each layer; torch's global random
    stream (the caller's) must come out of patch() where it was."""
    model = build(name)
    torch.manual_seed(7)
    want = torch.rand(4)
    torch.manual_seed(7)
    crhf.patch(model)
    assert torch.equal(torch.rand(4), want)
