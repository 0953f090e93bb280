"""cupy-rope: rotary position embedding kernels for any GPU array framework.

CUDA C++ templates compiled at run time with NVRTC (through CuPy), exchanged
with PyTorch, JAX and CuPy over DLPack without copies.
"""

from .api import apply_rope, apply_rope_backward
from .specialize import CompileError

__all__ = ["apply_rope", "apply_rope_backward", "CompileError"]
__version__ = "0.1.0"
