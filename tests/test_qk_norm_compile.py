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
    chunks = [(specs[i:i + CHUNK], "sm_90") for i in range(0, len(specs), CHUNK)]
    workers = min(len(chunks), os.cpu_count() or 1)
    lowered = {}
    with ProcessPoolExecutor(workers) as pool:
        for result in pool.map(_compile_chunk, chunks):
            lowered.update(result)
    assert set(lowered) == {s.name_expression() for s in specs}
    assert all(n.startswith(("_ZN4rope16norm_rope_kernel", "_ZN4rope18weight_grad_reduce"))
               for n in lowered.values())


def test_norm_params_struct_matches_the_header():
    """rope::NormSlab lists the fields norm_launch packs, in order."""
    text = (specialize.KERNEL_DIR / "norm_rope.cu").read_text()
    text = re.sub(r"//[^\n]*", "", text)
    body = re.search(r"struct NormSlab \{(.*?)\};", text, re.S).group(1)
    names = re.findall(r"\b(\w+);", body)
    assert names == ["weight", "weight_partial", "input_data", "input", "blocks", "units",
                     "weight_len"]
    # 3 pointers, a View of 5 strides, 3 counts
    assert norm_launch._NORM_SLAB == "QQQ" + "q" * 5 + "qqq"
    assert re.search(r"struct NormParams : Params \{\s*NormSlab norm\[MAX_SLABS\];\s*"
                     r"float eps;\s*float pad2_;\s*\};", text)
    consts = dict(re.findall(r"constexpr int (\w+) = (\d+);", text))
    assert int(consts["NORM_THREADS"]) == norm_launch.NORM_THREADS
    assert int(consts["REDUCE_COLS"]) == norm_launch.REDUCE_COLS
    assert int(consts["REDUCE_ROWS"]) == norm_launch.REDUCE_ROWS


def test_param_blocks_are_the_size_the_launcher_packs():
    """The .param block NVRTC lays out for each kernel is exactly the bytes
    norm_launch packs (NormParams; ReduceParams)."""
    specs = norm_launch.shipped_specs()
    kernel = next(s for s in specs if isinstance(s, norm_launch.NormSpec))
    reduce = next(s for s in specs if isinstance(s, norm_launch.ReduceSpec))
    for spec, size in ((kernel, norm_launch.NORM_PARAMS_SIZE),
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


def test_token_scope_refuses_more_heads_than_a_block_holds():
    tensor = launch._FakeArrays()
    q = tensor((4, 4096, 64), "float32")
    call = check_call(q, k=tensor((4, 2, 64), "float32"), layout="thd",
                       cos=tensor((4, 32), "float32"), sin=tensor((4, 32), "float32"),
                       out=tensor((4, 4096, 64), "float32"),
                       out_k=tensor((4, 2, 64), "float32"))
    with pytest.raises(ValueError, match="q: 4096 heads per token; norm_scope='token'"):
        norm_launch.choose_spec(call, NormOptions("token"), None)
