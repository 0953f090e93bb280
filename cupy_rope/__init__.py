"""cupy-rope: rotary position embedding kernels for any GPU array framework.

CUDA C++ templates compiled at run time with NVRTC (through CuPy), exchanged
with PyTorch, JAX and CuPy over DLPack without copies; NumPy inputs run the
float64 reference. The functions are described in ``docs/api.md``.
"""

from .api import (RotaryEmbedding, apply_rope, apply_rope_backward, apply_rope_qk,
                  apply_rope_qkv, apply_rope_qkv_backward)
from .interop import NoCudaDeviceError
from .kv_cache import apply_qkv_rope_and_cache, apply_rope_and_cache, slot_mapping_from_page_table
from .qk_norm import apply_qk_norm_rope, apply_qk_norm_rope_backward, apply_qkv_norm_rope
from .specialize import CompileError

__all__ = ["apply_rope", "apply_rope_backward", "apply_rope_qk", "apply_rope_qkv",
           "apply_rope_qkv_backward", "RotaryEmbedding", "apply_qk_norm_rope",
           "apply_qk_norm_rope_backward", "apply_qkv_norm_rope", "apply_rope_and_cache",
           "apply_qkv_rope_and_cache", "slot_mapping_from_page_table", "CompileError",
           "NoCudaDeviceError"]
__version__ = "0.1.0"
