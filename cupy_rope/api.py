"""Public functions."""

from __future__ import annotations

from . import interop, launch, reference
from .validate import check_call


def apply_rope(x, cos=None, sin=None, *, inv_freq=None, freqs=None, positions=None,
               offsets=None, layout="bshd", interleaved=False, rotary_dim=None,
               inplace=False, out=None, backward=False):
    """Apply rotary position embedding to ``x``.

    Shapes (b = batch, s = sequence, h = heads, d = head_dim, r = rotary_dim):

    - ``x``: [b, s, h, d] (``layout="bshd"``) or [s, b, h, d] (``"sbhd"``), any
      strides (e.g. ``q.transpose(1, 2)`` of a [b, h, s, d] tensor) with no copy.
      float32, float16 or bfloat16 on a CUDA device (torch, JAX, CuPy or any
      DLPack producer); a NumPy array runs the float64 NumPy reference instead.
    - One angle source, indexed by f in [0, r/2):
        ``cos``, ``sin``: [max_position, r/2] tables (float32 or x's dtype);
        ``inv_freq``: [r/2] float32, theta = position * inv_freq[f] computed in
        the kernel (fp32 product, accurate sincosf; no table traffic);
        ``freqs``: [max_position, r/2] float32 angles theta.
    - Positions: by default the sequence index s; ``positions`` [s] or [b, s]
      (int32/int64) replaces it; ``offsets`` (an int, or [b] int32/int64, e.g.
      KV-cache lengths when decoding) is added to it.
    - ``rotary_dim``: defaults to 2 * (width of the angle source); channels
      [r, d) are not rotated: copied bit-exact when writing a new array, not
      touched at all in place.
    - ``interleaved=False``: NeoX / rotate-half pairs (f, f + r/2);
      ``interleaved=True``: GPT-J pairs (2f, 2f + 1).
    - Each pair (a, b) becomes (a cos - b sin, b cos + a sin);
      ``backward=True`` applies the transpose (rotation by -theta), i.e. the
      gradient with respect to x given the gradient of the output.

    Output: a new array of x's framework (torch -> torch, JAX -> JAX, CuPy or
    other DLPack -> CuPy), or ``out`` when given, or ``x`` itself with
    ``inplace=True``. The kernel is enqueued on the caller's current stream
    (torch's for torch tensors, CuPy's otherwise); nothing synchronizes.

    A position outside a table that the host cannot see (device ``positions``
    or ``offsets``) yields NaN in the rotated channels, never an
    out-of-bounds read; positions known on the host are checked up front.
    """
    call = check_call(x, cos, sin, inv_freq=inv_freq, freqs=freqs, positions=positions,
                      offsets=offsets, layout=layout, interleaved=interleaved,
                      rotary_dim=rotary_dim, inplace=inplace, out=out, backward=backward)
    if not call.x.on_gpu:
        return reference.apply_numpy(call)
    if call.inplace:
        result, out_t = x, call.x
    elif call.out is not None:
        result, out_t = out, call.out
    else:
        result = interop.empty_like(call.x)
        out_t = interop.describe(result, "out")
    stream = interop.stream_for(call.x)
    device_id = call.x.device[1]
    import cupy

    if cupy.cuda.runtime.getDevice() == device_id:
        launch.launch(call, out_t, stream)
    else:
        with cupy.cuda.Device(device_id):
            launch.launch(call, out_t, stream)
    if result is out or call.inplace:
        return result
    return interop.wrap_result(call.x, result)


def apply_rope_backward(grad, cos=None, sin=None, **kwargs):
    """Gradient of :func:`apply_rope` with respect to x: rotation by -theta.

    Takes the output gradient ``grad`` (shaped like x) and the same angle,
    position and layout arguments as the forward call.
    """
    kwargs["backward"] = True
    return apply_rope(grad, cos, sin, **kwargs)
