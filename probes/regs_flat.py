import subprocess, sys, tempfile, os
sys.path.insert(0, "/work/main")
from cupy_rope import specialize as sp
from cupy_rope.norm_launch import NormFlatSpec
CASES = {
 "bf16-neox-128-u4": NormFlatSpec("bfloat16","float32","bfloat16",128,False,2,"implied","w",True,4),
 "bf16-neox-128-u2": NormFlatSpec("bfloat16","float32","bfloat16",128,False,2,"implied","w",True,2),
 "bf16-gptj-128-u4": NormFlatSpec("bfloat16","float32","bfloat16",128,True,2,"implied","w",True,4),
 "f32-neox-128-u4": NormFlatSpec("float32","float32","float32",128,False,2,"explicit","1+w",False,4),
 "bf16-neox-128": NormFlatSpec("bfloat16","float32","bfloat16",128,False,2,"implied","w",True),
 "bf16-gptj-128": NormFlatSpec("bfloat16","float32","bfloat16",128,True,2,"implied","w",True),
 "f32-neox-64-explicit": NormFlatSpec("float32","float32","float32",64,False,2,"explicit","1+w",False),
 "f16-neox-256-none": NormFlatSpec("float16","bfloat16","float32",256,False,1,"implied","none",True),
}
for n, s in CASES.items():
    ptx = sp._nvrtc_compile([s], "compute_90", lambda nv, prog: nv.getPTX(prog))
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.ptx"); open(f, "wb").write(ptx if isinstance(ptx, bytes) else ptx.encode())
        r = subprocess.run(["ptxas", "-arch=sm_90", "-v", f, "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
        lines = [l for l in r.stderr.splitlines() if "registers" in l or "spill" in l or "error" in l]
        print(n, " | ".join(l.split("ptxas info    :")[-1].strip() for l in lines), r.stderr[-500:] if r.returncode else "", flush=True)
for n, s in {"wan-u4": NormFlatSpec("bfloat16","float32","bfloat16",128,False,2,"implied","w",True,4,"token",40),
             "wan-u2": NormFlatSpec("bfloat16","float32","bfloat16",128,False,2,"implied","w",True,2,"token",40),
             "tok-gptj-f32": NormFlatSpec("float32","float32","float32",128,True,2,"explicit","1+w",False,4,"token",8)}.items():
    ptx = sp._nvrtc_compile([s], "compute_90", lambda nv, prog: nv.getPTX(prog))
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.ptx"); open(f, "wb").write(ptx if isinstance(ptx, bytes) else ptx.encode())
        r = subprocess.run(["ptxas", "-arch=sm_90", "-v", f, "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
        lines = [l for l in r.stderr.splitlines() if "registers" in l or "spill" in l or "error" in l]
        print(n, " | ".join(l.split("ptxas info    :")[-1].strip() for l in lines), r.stderr[-500:] if r.returncode else "", flush=True)
