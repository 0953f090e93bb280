"""NVRTC compiles every shipped q/k norm + rope specialization for sm_90,
with no warnings, and the launcher packs the parameter block the kernel
declares (CPU, no GPU needed)."""

import os
import re
from concurrent.futures import ProcessPoolExecutor

import pytest

from cupy_rope import launch, norm_launch, specialize
from cupy_rope.validate import NormOptions, check_call

CHUNK = 60  # name expressions per NVRTC program


def _compile_chunk(args):
    specs, arch = args
    return specialize.compile_for_arch(specs, arch)


def test_every_shipped_norm_specialization_compiles_for_sm90():
    specs = norm_launch.shipped_specs()
    kernels = [s for s in specs if isinstance(s, norm_launch.NormSpec)]
    assert len(kernels) > 1000  # the whole grid, not a sample
    # the grid reaches every scope, weight mode, direction and position rule
    assert {s.scope for s in kernels} == set(norm_launch.SCOPES)
    assert {s.weight_mode for s in kernels} == set(norm_launch.WEIGHT_MODES)
    assert {(s.backward, s.weight_grad) for s in kernels} == {
        (False, False), (True, False), (True, True)}
    assert {s.pos_mode for s in kernels} == set(specialize.POS_MODES)
    assert {s.round_before for s in kernels if not s.backward} == {False, True}
    assert {s.items for s in kernels} == {1, 2}  # a lane holds one or two items
    flat = [s for s in specs if isinstance(s, norm_launch.NormFlatSpec)]
    # per-head forward calls on dense rows: both styles, every weight mode and rounding
    assert {(s.interleaved, s.weight_mode, s.round_before) for s in flat} >= {
        (i, m, r) for i in (False, True) for m, r in (("w", True), ("1+w", False), ("none", True))}
    assert {s.head_dim for s in flat} == {64, 128, 256}  # d80: rows of 10 packets stay on rows
    assert {s.scope for s in flat} == {"head", "token"} and {s.rows for s in flat} >= {1, 2, 4}
    assert {s.gapped for s in flat} == {False, True}  # in place on a packed projection too
    assert {(s.scope, s.backward, s.rows) for s in flat} >= {
        ("head", False, 4), ("head", True, 2), ("token", False, 1), ("token", True, 1)}
    assert any(s.weight_dtype == "float32" and s.dtype != "float32" and s.weight_mode != "none"
               for s in flat)
    assert {(s.scope, s.backward, s.weight_grad) for s in flat} >= {
        (scope, True, wgrad) for scope in ("head", "token") for wgrad in (False, True)}
    chunks = [(specs[i:i + CHUNK], "sm_90") for i in range(0, len(specs), CHUNK)]
    workers = min(len(chunks), os.cpu_count() or 1)
    lowered = {}
    with ProcessPoolExecutor(workers) as pool:
        for result in pool.map(_compile_chunk, chunks):
            lowered.update(result)
    assert set(lowered) == {s.name_expression() for s in specs}
    kernel = re.compile(r"_ZN4rope\d+(norm_rope|norm_flat(_token)?(_backward)?)_kernel|"
                        r"_ZN4rope18weight_grad_reduce")
    assert all(kernel.match(n) for n in lowered.values())


def test_norm_params_struct_matches_the_header():
    """rope::NormSlab lists the fields norm_launch packs, in order, and both
    norm kernels' parameters end with one per slab, then eps."""
    text, items, flat = (re.sub(r"//[^\n]*", "", (specialize.KERNEL_DIR / f).read_text())
                         for f in ("norm_rope.cu", "norm_items.cuh", "norm_flat.cu"))
    body = re.search(r"struct NormSlab \{(.*?)\};", items, re.S).group(1)
    names = re.findall(r"\b(\w+);", body)
    assert names == ["weight", "weight_partial", "input_data", "input", "blocks", "units",
                     "weight_len"]
    # 3 pointers, a View of 5 strides, 3 counts
    assert norm_launch._NORM_SLAB == "QQQ" + "q" * 5 + "qqq"
    assert re.search(r"struct NormParams : Params \{\s*NormSlab norm\[MAX_SLABS\];\s*"
                     r"float eps;\s*float pad2_;\s*\};", text)
    assert re.search(r"struct NormFlatParams : FlatParams \{\s*NormSlab norm\[MAX_SLABS\];\s*"
                     r"float eps;\s*float pad2_;\s*FlatGap gap\[MAX_SLABS\];\s*\};", flat)
    gap = re.search(r"struct FlatGap \{(.*?)\};", flat, re.S).group(1)
    assert re.findall(r"\bi64 (\w+);", gap) == ["elems", "heads_mul", "heads_shift"]
    consts = dict(re.findall(r"constexpr int (\w+) = (\d+);", text))
    assert int(consts["NORM_THREADS"]) == norm_launch.NORM_THREADS
    assert int(consts["REDUCE_COLS"]) == norm_launch.REDUCE_COLS
    assert int(consts["REDUCE_ROWS"]) == norm_launch.REDUCE_ROWS


def test_param_blocks_are_the_size_the_launcher_packs():
    """The .param block NVRTC lays out for each kernel is exactly the bytes
    norm_launch packs (NormParams; NormFlatParams; ReduceParams)."""
    specs = norm_launch.shipped_specs()
    kernel = next(s for s in specs if isinstance(s, norm_launch.NormSpec))
    flat = next(s for s in specs if isinstance(s, norm_launch.NormFlatSpec))
    reduce = next(s for s in specs if isinstance(s, norm_launch.ReduceSpec))
    for spec, size in ((kernel, norm_launch.NORM_PARAMS_SIZE),
                       (flat, norm_launch.NORM_FLAT_PARAMS_SIZE),
                       (reduce, norm_launch._REDUCE.size)):
        ptx = specialize.ptx_for_arch([spec])
        assert re.findall(r"\.param \.align \d+ \.b8 \w+\[(\d+)\]", ptx) == [str(size)]


@pytest.mark.parametrize("scope", ["head", "token"])
@pytest.mark.parametrize("backward", [False, True])
def test_packed_parameters_have_the_declared_size(monkeypatch, scope, backward):
    """A planned call packs NORM_PARAMS_SIZE bytes, its slab layout covering
    every head and token: units per slab, and (backward) at most as many
    blocks as units; a second call of the signature reuses the plan."""
    monkeypatch.setattr(launch, "_sm_count", lambda device_id: 132)  # no GPU here
    monkeypatch.setattr(norm_launch, "_plans", {})
    # norm_rope_kernel's layout (a dense per-head forward runs norm_flat_kernel)
    monkeypatch.setattr(norm_launch, "POLICY", norm_launch.NormPolicy(kernels=("rows",)))
    tensor = launch._FakeArrays()
    call = norm_launch._shipped_call(tensor, "bfloat16", 128, 128, False, False, "implied",
                                     "table")
    norm = NormOptions(scope, "w", "before_weight")
    inputs = [s.x for s in call.slabs] if backward else None
    weights = [tensor((128 * (4 if scope == "token" else 1),), "bfloat16"),
               tensor((128 * (2 if scope == "token" else 1),), "bfloat16")]
    spec = norm_launch.choose_spec(call, norm, weights, backward, backward, inputs)
    assert spec.weight_vec  # aligned weights are read in packets
    shape = norm_launch.launch_shape(call, spec, sm_count=132)
    plan = norm_launch.plan(call, weights, norm, backward, backward, inputs)
    assert plan.spec == spec and plan.shape == shape
    assert norm_launch.plan(call, weights, norm, backward, backward, inputs) is plan  # cached
    params = norm_launch._params(call, plan, weights, inputs, [1 << 20, 1 << 21] if
                                 backward else None, 1e-6)
    assert len(params) == norm_launch.NORM_PARAMS_SIZE
    lanes, by, bz = shape.block
    assert lanes == spec.lanes and lanes * by * bz <= norm_launch.NORM_THREADS
    for sl, (begin, token_blocks, head_lanes, per_block), units, blocks in zip(
            call.slabs, shape.slab_blocks, shape.units, shape.blocks):
        tokens_per_block = bz * (by // head_lanes)
        assert token_blocks * tokens_per_block >= call.tokens
        assert head_lanes * spec.unroll * (-(-per_block // (head_lanes * spec.unroll))) \
            >= per_block
        if scope == "token":  # a block holds every head of its tokens in one pass
            assert head_lanes * spec.unroll >= sl.heads and units == token_blocks
        assert 0 < blocks <= units


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_dense_per_head_calls_run_the_flat_kernels(monkeypatch, interleaved):
    """A per-head forward on dense rows plans norm_flat_kernel: flat_kernel's
    grid (every head row's packets on the lanes of whole warps) and
    FlatParams' fields, then the norm's; so do the token scope (as many q as
    k heads) and the backward; the other calls keep norm_rope_kernel."""
    monkeypatch.setattr(launch, "_sm_count", lambda device_id: 132)
    monkeypatch.setattr(norm_launch, "_plans", {})
    tensor = launch._FakeArrays()
    call = norm_launch._shipped_call(tensor, "bfloat16", 128, 128, interleaved, False,
                                     "implied", "table", s=1000)
    weights = [tensor((128,), "bfloat16"), tensor((128,), "bfloat16")]
    norm = NormOptions("head", "w", "before_weight")
    plan = norm_launch.plan(call, weights, norm)
    assert plan.spec == norm_launch.NormFlatSpec("bfloat16", "float32", "bfloat16", 128,
                                                 interleaved, 2, "implied", "w", True)
    rows = [1000 * 4, 1000 * 2]  # q 4 heads, k 2; 16 packets a row, 8 rows a block
    assert plan.shape.block == (launch.FLAT_THREADS, 1, 1)
    assert plan.shape.blocks == [-(-r // 8) for r in rows] and plan.shape.units == rows
    assert plan.shape.grid == (sum(plan.shape.blocks), 1, 1)
    fields = dict(zip((n for n, _ in launch.FLAT_FIXED_FIELDS),
                      launch._FLAT_FIXED.unpack(plan.fixed)))
    assert (fields["slab[0].rows"], fields["slab[1].rows"]) == tuple(rows)
    assert fields["slab[1].block_begin"] == plan.shape.blocks[0]
    params = norm_launch._params(call, plan, norm_launch._weights(weights), None, None, 1e-6)
    assert len(params) == norm_launch.NORM_FLAT_PARAMS_SIZE
    assert norm_launch._NORM.unpack_from(params, launch.FLAT_PARAMS_SIZE)[0] == weights[0].ptr
    assert params.endswith(bytes(norm_launch._GAP.size))  # dense slabs: no gaps
    # several rows a thread where a warp's rows share a position
    wide = norm_launch._shipped_call(tensor, "bfloat16", 128, 128, interleaved, False,
                                     "implied", "table", 1000, (16, 8))
    assert norm_launch.choose_spec(wide, norm, weights).rows == 4
    # scope token with as many heads in q and k: whole tokens a block
    token = NormOptions("token")
    spec = norm_launch.choose_spec(wide._replace(slabs=(wide.slabs[1],) * 2), token,
                                   [tensor((1024,), "bfloat16")] * 2)
    assert (spec.scope, spec.heads, spec.rows) == ("token", 8, 4)
    even_inputs = [wide.slabs[1].x] * 2
    back = norm_launch.plan(wide._replace(slabs=(wide.slabs[1],) * 2),
                            [tensor((1024,), "bfloat16")] * 2, token, True, True, even_inputs)
    assert (back.spec.scope, back.spec.backward, back.spec.rows) == ("token", True, 2)
    assert back.shape.block == (8 * 16 // 2, 1, 1)  # one token's warps a block
    per_sm = norm_launch.POLICY.flat_backward_threads_per_sm // 64
    assert back.shape.blocks[0] == min(1000, per_sm * 132)
    # the backward too (scope head; its blocks walk the rows), not with other input strides
    inputs = [s.x for s in call.slabs]
    back = norm_launch.plan(call, weights, norm, True, True, inputs)
    assert back.spec.backward and back.spec.weight_grad and not back.spec.round_before
    assert 0 < back.shape.blocks[0] <= norm_launch.POLICY.flat_backward_threads_per_sm // 128 * 132
    strided = [t._replace(strides=(1024, 128, 1)) for t in inputs]
    assert isinstance(norm_launch.choose_spec(call, norm, weights, True, True, strided),
                      norm_launch.NormSpec)
    # not flat: scope token with other k heads, partial rotary, head_dim 80
    token_w = [tensor((512,), "bfloat16"), tensor((256,), "bfloat16")]
    assert isinstance(norm_launch.choose_spec(call, token, token_w), norm_launch.NormSpec)
    for d, r in ((128, 64), (80, 80)):
        other = norm_launch._shipped_call(tensor, "bfloat16", d, r, interleaved, False,
                                          "implied", "table")
        w = [tensor((d,), "bfloat16")] * 2
        assert isinstance(norm_launch.choose_spec(other, norm, w), norm_launch.NormSpec)


def test_packed_projection_in_place_runs_the_flat_kernel_with_gaps(monkeypatch):
    """q and k of a packed qkv, in place (the serving decode): the flat
    kernel walks each slab as its dense twin and adds the gap between
    tokens; out of place (new dense outputs) keeps norm_rope_kernel."""
    monkeypatch.setattr(launch, "_sm_count", lambda device_id: 132)
    monkeypatch.setattr(norm_launch, "_plans", {})
    tensor = launch._FakeArrays()
    t, hq, hk, d = 64, 32, 8, 128
    row = (hq + 2 * hk) * d
    packed = tensor((t, row), "bfloat16")
    q = packed._replace(shape=(t, hq, d), strides=(row, d, 1))
    k = packed._replace(shape=(t, hk, d), strides=(row, d, 1), ptr=packed.ptr + 2 * hq * d)
    kw = dict(layout="thd", cos=tensor((8192, 64), "float32"), sin=tensor((8192, 64), "float32"),
              positions=tensor((t,), "int32"))
    weights = [tensor((d,), "bfloat16")] * 2
    norm = NormOptions("head", "w", "before_weight")
    plan = norm_launch.plan(check_call(q, k=k, inplace=True, **kw), weights, norm)
    assert isinstance(plan.spec, norm_launch.NormFlatSpec)
    assert plan.spec.rows == 4 and plan.spec.gapped and "true>" in plan.spec.name_expression()
    assert plan.shape.units == [t * hq, t * hk]
    gaps = norm_launch._GAP.unpack(plan.tail)
    assert gaps[:3] == (row - hq * d, *launch.reciprocal(hq))
    assert gaps[3:6] == (row - hk * d, *launch.reciprocal(hk)) and gaps[6:] == (0, 0, 0)
    fields = dict(zip((n for n, _ in launch.FLAT_FIXED_FIELDS),
                      launch._FLAT_FIXED.unpack(plan.fixed)))
    assert fields["slab[0].step_mul"] == launch.reciprocal(hq)[0]  # a sequence step: hq rows
    out = dict(out=tensor((t, hq, d), "bfloat16"), out_k=tensor((t, hk, d), "bfloat16"))
    assert isinstance(norm_launch.choose_spec(check_call(q, k=k, **out, **kw), norm, weights),
                      norm_launch.NormSpec)


def test_token_scope_refuses_more_heads_than_a_block_holds():
    tensor = launch._FakeArrays()
    q = tensor((4, 4096, 64), "float32")
    call = check_call(q, k=tensor((4, 2, 64), "float32"), layout="thd",
                       cos=tensor((4, 32), "float32"), sin=tensor((4, 32), "float32"),
                       out=tensor((4, 4096, 64), "float32"),
                       out_k=tensor((4, 2, 64), "float32"))
    with pytest.raises(ValueError, match="q: 4096 heads per token; norm_scope='token'"):
        norm_launch.choose_spec(call, NormOptions("token"), None)
