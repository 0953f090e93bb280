"""Probe (deleted once answered): registers and spills of norm specs (NVRTC PTX -> ptxas -v), no GPU."""
import subprocess, sys, tempfile, os, dataclasses
from cupy_rope import specialize as sp
from cupy_rope.norm_launch import NormSpec

def spec(**kw):
    base = dict(dtype="bfloat16", angle_dtype="float32", weight_dtype="bfloat16", head_dim=128, rotary_dim=128,
                interleaved=False, source="table", pairs=8, tail_vec=1, strided=False, table_strided=False,
                pos_mode="implied", scope="head", weight_mode="w", weight_vec=True, round_before=True,
                lanes=8, items=1, unroll=4, backward=False, weight_grad=False, min_blocks=2, stages=2)
    base.update(kw)
    return NormSpec(**base)

CASES = {
  "qwen-fwd-u4": spec(),
  "qwen-fwd-u1": spec(unroll=1),
  "wan-fwd": spec(scope="token", unroll=2),
  "qwen-bwd": spec(backward=True, weight_grad=True, round_before=False, unroll=1),
  "wan-bwd": spec(scope="token", unroll=2, backward=True, weight_grad=True, round_before=False),
}
CASES["wan-fwd-p4"] = spec(scope="token", unroll=3, pairs=4, lanes=16)
CASES["qwen-fwd-p4"] = spec(pairs=4, lanes=16, unroll=4)
CASES["qwen-bwd-p4"] = spec(pairs=4, lanes=16, unroll=2, backward=True, weight_grad=True, round_before=False)
CASES["wan-bwd-p4"] = spec(scope="token", unroll=3, pairs=4, lanes=16, backward=True, weight_grad=True, round_before=False)
for n0 in list(CASES):
    for mb in (3, 4):
        CASES[f"{n0}-mb{mb}"] = dataclasses.replace(CASES[n0], min_blocks=mb)
names = sys.argv[1:] or list(CASES)
for n in names:
    s = CASES[n]
    ptx = sp._nvrtc_compile([s], "compute_90", lambda nv, prog: nv.getPTX(prog))
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.ptx")
        open(f, "wb").write(ptx if isinstance(ptx, bytes) else ptx.encode())
        r = subprocess.run(["ptxas", "-arch=sm_90", "-v", f, "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
        lines = [l for l in r.stderr.splitlines() if "registers" in l or "spill" in l]
        print(n, " | ".join(l.split("ptxas info    :")[-1].strip() for l in lines))
