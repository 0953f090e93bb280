"""NVRTC compiles every shipped rope_cache_kernel specialization, and its
parameter block is the struct the launcher packs (CPU, no GPU)."""

import os
import re
from concurrent.futures import ProcessPoolExecutor

import pytest

from cupy_rope import kv_cache, launch, specialize

CHUNK = 25  # name expressions per NVRTC program


def _compile_chunk(args):
    specs, arch = args
    return specialize.compile_for_arch(specs, arch)


def test_every_shipped_specialization_compiles_for_sm90():
    specs = kv_cache.shipped_specs()
    assert len(specs) > 150  # the whole grid
    assert {s.cache_format for s in specs} == {"same", *kv_cache.FP8_FORMATS}
    assert {s.q_format for s in specs} == {"same", *kv_cache.FP8_FORMATS}
    assert {s.unroll for s in specs} == {1, 4} and {s.copy_q_tail for s in specs} == {False, True}
    assert {s.pos_mode for s in specs} == {"explicit", "varlen"}
    # the per-head q/k norm: every weight mode and rounding, one and several items a lane
    norm = [s for s in specs if s.norm]
    assert {s.weight_mode for s in norm} == {"w", "1+w", "none"}
    assert {s.round_before for s in norm} == {False, True}
    assert {s.k_items for s in norm} == {1, 2} and {s.cache_format for s in norm} == {
        "same", *kv_cache.FP8_FORMATS}
    chunks = [(specs[i:i + CHUNK], "sm_90") for i in range(0, len(specs), CHUNK)]
    lowered = {}
    with ProcessPoolExecutor(min(len(chunks), os.cpu_count() or 1)) as pool:
        for result in pool.map(_compile_chunk, chunks):
            lowered.update(result)
    assert set(lowered) == {s.name_expression() for s in specs}
    assert all(n.startswith(("_ZN4rope17rope_cache_kernel", "_ZN4rope22rope_cache_flat_kernel"))
               for n in lowered.values())


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_100"])
def test_other_architectures_compile(arch):
    # sm_80: FP8 by the software conversion; sm_89 on: cvt ... e4m3x2 / e5m2x2
    shipped = kv_cache.shipped_specs()
    specs = [s for s in shipped if s.head_dim == 128 and s.unroll == 4
             and s.dtype == "bfloat16" and s.source == "table"][:12]
    assert {s.cache_format for s in specs} >= set(kv_cache.FP8_FORMATS)
    # and the decode form alone (its own program: no warning may fail it)
    flat = [s for s in shipped if s.flat and s.head_dim == 128 and s.dtype == "bfloat16"]
    assert {s.cache_format for s in flat} >= set(kv_cache.FP8_FORMATS)
    specialize.compile_for_arch(flat, arch)
    specialize.compile_for_arch(specs, arch)


@pytest.mark.parametrize("arch, fp8_cvt", [("sm_80", False), ("sm_90", True)])
def test_fp8_conversion_path(arch, fp8_cvt):
    spec = next(s for s in kv_cache.shipped_specs() if s.cache_format == "float8_e5m2")
    ptx = specialize.ptx_for_arch([spec], arch)
    assert ("cvt.rn.satfinite.e5m2x2.f32" in ptx) == fp8_cvt


def test_cache_params_struct_matches_kernel():
    """kv_cache's field lists name CacheParams' own fields in the header's
    order, after rope::Params, and the PTX parameter block is the size the
    launcher packs."""
    text = re.sub(r"//[^\n]*", "", (specialize.KERNEL_DIR / "rope_cache.cu").read_text())
    body = re.search(r"struct CacheParams : Params \{(.*?)\};", text, re.S).group(1)
    view = re.search(r"struct CacheView \{(.*?)\};", text, re.S).group(1)
    view_fields = re.findall(r"\b(\w+);", view)
    names = []
    for m in re.finditer(r"\b(\w+)(?:\[(\d+)\])?;", body):
        name, n = m.group(1), m.group(2)
        for i in range(int(n)) if n else [None]:
            full = name + (f"[{i}]" if i is not None else "")
            if re.search(r"CacheView\s+%s\b" % name, body):
                names += [f"{full}.{f}" for f in view_fields]
            else:
                names.append(full)
    listed = [n for n, _ in kv_cache.CACHE_DYNAMIC_FIELDS + kv_cache.CACHE_FIXED_FIELDS]
    assert names == listed
    fields = kv_cache.CACHE_DYNAMIC_FIELDS + kv_cache.CACHE_FIXED_FIELDS
    assert kv_cache.CACHE_PARAMS_SIZE == launch.PARAMS_SIZE + sum(
        8 if c in "qQ" else 4 for _, c in fields)
    ptx = specialize.ptx_for_arch([kv_cache.shipped_specs()[0]])
    sizes = re.findall(r"\.param \.align \d+ \.b8 \w+\[(\d+)\]", ptx)
    assert sizes == [str(kv_cache.CACHE_PARAMS_SIZE)]
