"""NVRTC compiles every shipped specialization for sm_90, with no GPU (CPU)."""

import dataclasses
import os
import re
from concurrent.futures import ProcessPoolExecutor

import pytest

from cupy_rope import launch, specialize

CHUNK = 60  # name expressions per NVRTC program


def _compile_chunk(args):
    specs, arch = args
    return specialize.compile_for_arch(specs, arch)


def test_every_shipped_specialization_compiles_for_sm90():
    specs = launch.shipped_specs()
    assert len(specs) > 1000  # the whole grid, not a sample
    chunks = [(specs[i:i + CHUNK], "sm_90") for i in range(0, len(specs), CHUNK)]
    workers = min(len(chunks), os.cpu_count() or 1)
    lowered = {}
    with ProcessPoolExecutor(workers) as pool:
        for result in pool.map(_compile_chunk, chunks):
            lowered.update(result)
    assert set(lowered) == {s.name_expression() for s in specs}
    assert all(name.startswith(("_ZN4rope11rope_kernel", "_ZN4rope13packet_kernel",
                                "_ZN4rope11flat_kernel"))
               for name in lowered.values())
    assert {s.mapping for s in specs} == set(specialize.KERNELS)
    assert {s.split_angles for s in specs if s.mapping == "flat" and not s.interleaved} == {
        False, True}
    assert {s.partner_load for s in specs if s.mapping == "flat" and not s.interleaved} == {
        False, True}
    # flat_kernel for x alone and for q + k: both counts compiled for every
    # flat specialization
    flat = [s for s in specs if s.mapping == "flat"]
    assert {s.slabs for s in flat} == {1, 2}
    assert len({dataclasses.replace(s, slabs=1) for s in flat}) * 2 == len(flat)


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_100"])
def test_other_architectures_compile(arch):
    specs = [s for s in launch.shipped_specs() if s.head_dim == 128][:40]
    specialize.compile_for_arch(specs, arch)


@pytest.mark.parametrize("arch, waits, absent", [
    ("sm_75", (), ("mbarrier",)),
    ("sm_80", ("mbarrier.arrive", "mbarrier.test_wait.parity"), ("try_wait",)),
    ("sm_90", ("mbarrier.arrive", "mbarrier.try_wait.parity"), ("test_wait",)),
    ("sm_100", ("mbarrier.arrive", "mbarrier.try_wait.parity"), ("test_wait",)),
])
def test_varlen_sequence_signal_compiles_on_each_path(arch, waits, absent):
    # kernels/positions.cuh SequenceSignal: a block barrier before sm_80, an
    # mbarrier polled with test_wait on sm_80-89 and with try_wait from sm_90.
    specs = [s for s in launch.shipped_specs() if s.pos_mode == "varlen"][:12]
    specialize.compile_for_arch(specs, arch)  # cubin, no warnings
    ptx = specialize.ptx_for_arch(specs, arch)
    entries = ptx.count(".entry ")
    assert entries == len(specs)
    for w in waits:  # every kernel waits on the signal
        assert ptx.count(w) >= entries, w
    for a in absent:
        assert a not in ptx
    assert ptx.count("bar.sync") >= entries  # init barrier, or the barrier after the search


def test_varlen_prefetch_threshold_matches_the_launcher():
    """kernels/rope.cu prefetches for searches of three steps, the sequence
    count above which the launcher may give computed angles more tokens a block
    (LaunchPolicy.varlen_few_seqs, launch.varlen_block_shape)."""
    text = (specialize.KERNEL_DIR / "rope.cu").read_text()
    seqs = int(re.search(r"SEARCH_PREFETCH_MIN_SEQS = (\d+);", text).group(1))
    assert seqs == launch.POLICY.varlen_few_seqs
    assert "p.n_seqs > SEARCH_PREFETCH_MIN_SEQS" in text  # the constant is the test


def test_varlen_prefetch_only_with_tables():
    """The searching warp's L1 prefetch (kernels/rope.cu) is compiled into
    varlen kernels that read cos/sin tables, and into no other rope_kernel."""
    specs = [s for s in launch.shipped_specs() if s.source_file == "rope.cu"
             and s.head_dim == 128]
    with_prefetch = [s for s in specs if s.pos_mode == "varlen" and s.source == "table"]
    with_prefetch = with_prefetch[:3] + with_prefetch[-3:]  # NeoX and GPT-J, several unrolls
    without = ([s for s in specs if s.pos_mode == "varlen" and s.source != "table"][:6]
               + [s for s in specs if s.pos_mode != "varlen"][:6])
    assert len(with_prefetch) == 6 and len(without) == 12
    entries = specialize.ptx_for_arch(with_prefetch).split(".entry ")[1:]
    assert len(entries) == 6 and all("prefetch.global.L1" in e for e in entries)
    assert "prefetch" not in specialize.ptx_for_arch(without)


def test_compile_error_is_reported():
    bad = specialize.Spec("float32", "float32", 8, 6, False, "table", 4, 1, False, False, True,
                          4, "implied")  # 4 pairs do not divide 3
    with pytest.raises(specialize.CompileError, match="PAIRS divides"):
        specialize.compile_for_arch([bad], "sm_90")


def test_params_struct_matches_kernel_header():
    """launch.PARAM_FIELDS lists rope::Params' fields in the header's order."""
    text = (specialize.KERNEL_DIR / "params.cuh").read_text()
    text = re.sub(r"//[^\n]*", "", text)
    slabs = int(re.search(r"MAX_SLABS = (\d+);", text).group(1))
    assert slabs == launch.MAX_SLABS

    def fields(struct):
        """(type, name, array length) of each member, a base struct's first."""
        base, body = re.search(r"struct %s(?: : (\w+))? \{(.*?)\};" % struct, text,
                               re.S).groups()
        own = [(m.group(1).split()[-1].strip("*"), m.group(2), m.group(3))
               for m in re.finditer(r"([\w\s\*]*?)\s*\b(\w+)(?:\[(\w+)\])?;", body)]
        return (fields(base) if base else []) + own

    def expand(struct, prefix=""):
        names = []
        for type_, name, array in fields(struct):
            n = None if array is None else slabs if array == "MAX_SLABS" else int(array)
            for i in range(n) if n else [None]:
                full = prefix + name + (f"[{i}]" if i is not None else "")
                if type_ in ("View", "Slab", "FlatSlab"):
                    names += expand(type_, full + ".")
                else:
                    names.append(full)
        return names

    assert expand("CallData") == [name for name, _ in launch.DYNAMIC_FIELDS]
    assert expand("Params") == [name for name, _ in launch.PARAM_FIELDS]
    assert launch.PARAMS_SIZE == sum(8 if c in "qQ" else 4 for _, c in launch.PARAM_FIELDS)
    # flat_kernel's own block: the per-call fields first, then its own
    assert expand("FlatParams") == [name for name, _ in launch.FLAT_PARAM_FIELDS]
    assert launch.FLAT_PARAMS_SIZE == sum(8 if c in "qQ" else 4
                                          for _, c in launch.FLAT_PARAM_FIELDS)
    assert launch.FLAT_PARAM_FIELDS[:len(launch.DYNAMIC_FIELDS)] == tuple(launch.DYNAMIC_FIELDS)


def test_param_blocks_are_the_size_the_launcher_packs():
    """Each kernel's parameter block, as NVRTC lays it out (the .param
    declaration in the PTX: C++ padding included), is exactly the bytes the
    launcher packs: Params for rope_kernel and packet_kernel, FlatParams for
    flat_kernel."""
    want = {"flat": launch.FLAT_PARAMS_SIZE, "packet": launch.PARAMS_SIZE,
            "rope": launch.PARAMS_SIZE}
    picked = {}
    for spec in launch.shipped_specs():
        picked.setdefault(spec.mapping, spec)
    assert set(picked) == set(want)
    for mapping, spec in picked.items():
        ptx = specialize.ptx_for_arch([spec])
        sizes = re.findall(r"\.param \.align \d+ \.b8 \w+\[(\d+)\]", ptx)
        assert sizes == [str(want[mapping])], (mapping, sizes)


def test_kernel_source_is_self_contained():
    src = specialize.kernel_source()
    assert '#include "' not in src
    assert "#include <" not in src  # no CUDA toolkit headers needed
