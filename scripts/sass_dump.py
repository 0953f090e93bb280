"""SASS of cupy-rope's kernel and torch.compile's for one shape (GPU machine
with the CUDA toolkit's ptxas and cuobjdump):

    TORCHINDUCTOR_CACHE_DIR=/tmp/ind-sass PYTHONPATH=. \
        python scripts/sass_dump.py sbhd24 OUTDIR

writes OUTDIR/ours-<kernel>.sass (the specialization the call planned,
through NVRTC's PTX and ptxas for sm_90) and OUTDIR/compile-*.sass (every
cubin Inductor left in its cache: the autotuner compiles several configs),
prints their instruction counts and Inductor's chosen configs
(.best_config: its triton_cache_hash names the cubin's folder)."""
import glob
import os
import re
import shutil
import subprocess
import sys

import torch

from cupy.cuda import nvrtc

import cupy_rope
from cupy_rope import api, specialize

shape = {"sbhd": (4096, 1, 128, 128), "sbhd24": (512, 32, 24, 128),
         "fp32": (128, 8192, 1, 128)}[sys.argv[1]]
out_dir = sys.argv[2]
os.makedirs(out_dir, exist_ok=True)
dtype = torch.float32 if sys.argv[1] == "fp32" else torch.bfloat16
d, s_len = shape[-1], shape[0]
inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
th = torch.arange(s_len, device="cuda", dtype=torch.float32)[:, None] * inv
cos, sin = th.cos(), th.sin()
x = torch.randn(shape, device="cuda", dtype=dtype)
o = torch.empty_like(x)
full_c = torch.cat((cos, cos), -1).to(dtype).view(s_len, 1, 1, d)
full_s = torch.cat((sin, sin), -1).to(dtype).view(s_len, 1, 1, d)


def formula(x, c, s):
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), -1) * s


torch.compile(formula, dynamic=False)(x, full_c, full_s)
api.clear_plans()
cupy_rope.apply_rope(x, cos, sin, out=o, layout="sbhd")
torch.cuda.synchronize()


def toolkit(name):
    return shutil.which(name) or f"/usr/local/cuda/bin/{name}"


def dump(who, name, cubin):
    sass = subprocess.run([toolkit("cuobjdump"), "-sass", cubin], capture_output=True,
                          text=True, check=True).stdout
    with open(os.path.join(out_dir, f"{who}-{name}.sass"), "w") as f:
        f.write(sass)
    for fn, body in re.findall(r"Function : (\S+)(.*?)(?=Function :|\Z)", sass, re.S):
        n = len(re.findall(r"/\*[0-9a-f]{4}\*/", body)) - body.count("NOP")
        print(f"{who} {name} {fn[:90]}: {n} instructions")


# Ours: CuPy's cache files carry a header before the cubin, so the planned
# specialization is compiled again here to PTX, then by ptxas to a cubin.
(prepared,) = api._plans.values()
spec = prepared.plan.spec
prog = nvrtc.createProgram(specialize.kernel_source(spec.source_file), spec.source_file, [], [])
nvrtc.addNameExpression(prog, spec.name_expression())
nvrtc.compileProgram(prog, list(specialize.NVRTC_OPTIONS) + ["-arch=compute_90"])
ptx = nvrtc.getPTX(prog)
ptx = (ptx.decode() if isinstance(ptx, bytes) else ptx).rstrip("\x00")
nvrtc.destroyProgram(prog)
ptx_path = os.path.join(out_dir, "ours.ptx")
with open(ptx_path, "w") as f:
    f.write(ptx)
cubin = os.path.join(out_dir, "ours.cubin")
print(subprocess.run([toolkit("ptxas"), "-arch=sm_90", "-v", ptx_path, "-o", cubin],
                     capture_output=True, text=True, check=True).stderr.strip())
dump("ours", spec.mapping, cubin)
for cubin in glob.glob(os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "**", "*.cubin"),
                       recursive=True):
    dump("compile", os.path.basename(os.path.dirname(cubin))[:12], cubin)
for cfg in glob.glob(os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "**", "*.best_config"),
                     recursive=True):
    print("best config", os.path.basename(cfg), open(cfg).read())
