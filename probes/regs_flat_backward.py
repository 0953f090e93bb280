import subprocess, sys, tempfile, os
sys.path.insert(0, "/work/main")
from cupy_rope import specialize as sp
from cupy_rope.norm_launch import NormFlatSpec
def F(*a, **k): return NormFlatSpec(*a, **k)
CASES = {
 "bwd-neox-u2": F("bfloat16","float32","bfloat16",128,False,2,"implied","w",False,2,backward=True,weight_grad=True),
 "bwd-neox-u1": F("bfloat16","float32","bfloat16",128,False,2,"implied","w",False,1,backward=True,weight_grad=True),
 "bwd-gptj-u2": F("bfloat16","float32","bfloat16",128,True,2,"implied","w",False,2,backward=True,weight_grad=True),
 "bwd-f32-u2-nowg": F("float32","float32","float32",128,False,2,"explicit","1+w",False,2,backward=True,weight_grad=False),
}
for n, s in CASES.items():
    ptx = sp._nvrtc_compile([s], "compute_90", lambda nv, prog: nv.getPTX(prog))
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.ptx"); open(f, "wb").write(ptx if isinstance(ptx, bytes) else ptx.encode())
        r = subprocess.run(["ptxas", "-arch=sm_90", "-v", f, "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
        lines = [l for l in r.stderr.splitlines() if "registers" in l or "spill" in l or "error" in l]
        print(n, " | ".join(l.split("ptxas info    :")[-1].strip() for l in lines), r.stderr[-800:] if r.returncode else "", flush=True)
for n, s in {"tokbwd-wan-u2": F("bfloat16","float32","bfloat16",128,False,2,"implied","w",False,2,"token",40,True,True),
             "tokbwd-wan-u1-gptj": F("bfloat16","float32","bfloat16",128,True,2,"implied","w",False,1,"token",8,True,True),
             "tokbwd-f32-u2": F("float32","float32","float32",128,False,2,"explicit","1+w",False,2,"token",8,True,False)}.items():
    ptx = sp._nvrtc_compile([s], "compute_90", lambda nv, prog: nv.getPTX(prog))
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.ptx"); open(f, "wb").write(ptx if isinstance(ptx, bytes) else ptx.encode())
        r = subprocess.run(["ptxas", "-arch=sm_90", "-v", f, "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
        lines = [l for l in r.stderr.splitlines() if "registers" in l or "spill" in l or "error" in l]
        print(n, " | ".join(l.split("ptxas info    :")[-1].strip() for l in lines), r.stderr[-800:] if r.returncode else "", flush=True)
