"""RoPE frequencies and attention factors for the rope scaling schemes of model configs.

Builds the ``inv_freq`` vector that :func:`cupy_rope.apply_rope` takes (or the
cos/sin tables made from it) for the scaling schemes that Hugging Face model
configs name in ``rope_scaling`` / ``rope_parameters``, plus the attention
factor that multiplies cos and sin (1.0 for the schemes that have none).

Conventions
-----------
* ``rotary_dim`` (r) is ``int(head_dim * partial_rotary_factor)``, as in
  Hugging Face; it must be even. Only the first r channels of a head rotate
  (``proportional`` is the exception: r is head_dim, see below).
* ``inv_freq`` has r/2 entries; entry f is the angular frequency of pair f:
  (f, f + r/2) in NeoX / rotate-half style, (2f, 2f + 1) in GPT-J style. The
  pairing is the caller's choice (``interleaved=`` of ``apply_rope``); the
  frequencies are the same for both.
* The angle of pair f at position p is ``p * inv_freq[f]``; the rotation uses
  ``attention_factor * cos(angle)`` and ``attention_factor * sin(angle)``.
* Everything is computed in float64 on the CPU; ``inv_freq`` is returned as a
  float32 NumPy array (each entry the float32 rounding of the float64 value).

Schemes (``d`` below is ``rotary_dim``, ``theta`` is ``rope_theta``,
``base_f = theta ** (-2f / d)`` for f in [0, d/2)):

* ``default``: ``inv_freq[f] = base_f``.
* ``linear`` (position interpolation): ``base_f / factor``.
* ``dynamic`` (dynamic NTK): with ``L = max(seq_len, max_position_embeddings)``
  (``seq_len`` None: ``L = max_position_embeddings``), the base becomes
  ``theta * (factor * L / max_position_embeddings - (factor - 1)) ** (d / (d - 2))``,
  so it changes only once the sequence outgrows ``max_position_embeddings``.
* ``yarn``: ``base_f * (1 - ramp_f) + (base_f / factor) * ramp_f`` with
  ``ramp_f = clip((f - low) / (high - low), 0, 1)``: high frequencies are kept,
  low ones interpolated. ``low`` and ``high`` are ``c(beta_fast)`` and
  ``c(beta_slow)`` (defaults 32 and 1), ``c(b) = d * ln(O / (2 pi b)) / (2 ln theta)``
  with ``O = original_max_position_embeddings``: the pair that turns b times
  within O positions; with ``truncate`` (default True; an explicit None or
  False turns it off, as in Hugging Face) low is floored and high ceiled;
  then clipped to [0, d - 1] (high + 0.001 where they meet). Attention
  factor ``attention_factor`` if given, else ``m(factor, mscale) / m(factor, mscale_all_dim)``
  where both mscales are given (DeepSeek-V2/V3), else ``m(factor, 1)``, with
  ``m(s, k) = 1`` for s <= 1 and ``0.1 * k * ln(s) + 1`` otherwise. (DeepSeek's
  attention also scales its softmax by ``m(factor, mscale_all_dim) ** 2``: that
  belongs to the attention, not to cos/sin, and is not included.) ``factor``
  None means ``max_position_embeddings / O``.
* ``llama3``: wavelengths ``2 pi / base_f`` shorter than
  ``original_max_position_embeddings / high_freq_factor`` are kept, those
  longer than ``original_max_position_embeddings / low_freq_factor`` are
  divided by ``factor``, and in between
  ``(1 - s) * base_f / factor + s * base_f`` with
  ``s = (original_max_position_embeddings / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
* ``longrope``: ``base_f / ext[f]`` with ``ext = long_factor`` when
  ``seq_len > original_max_position_embeddings`` and ``short_factor``
  otherwise (also when ``seq_len`` is None). Attention factor
  ``attention_factor`` if given, else ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``
  (1.0 when factor <= 1), where ``factor`` defaults to
  ``max_position_embeddings / original_max_position_embeddings``.
* ``proportional`` (Gemma 4's full-attention layers): the head's first
  ``a = int(head_dim * partial_rotary_factor // 2)`` pairs take
  ``theta ** (-2f / head_dim) / factor`` (``factor`` default 1), the other
  ``head_dim / 2 - a`` pairs frequency 0. Unlike the other schemes the result
  spans the whole head (``rotary_dim = head_dim``): a pair of frequency 0 is
  rotated by angle 0, which leaves its channels exactly as they are.

The formulas follow Hugging Face transformers' rope initialization functions
(5.x behaviour where versions differ: an explicit yarn ``factor`` is used as
given, not replaced by the ratio of the context lengths).

The argument reference (with the keys :func:`from_config` reads) is
``docs/api.md``, section Frequencies.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import numpy as np

from .interop import NoCudaDeviceError, require_cuda  # NoCudaDeviceError: also importable here
from .validate import _as_int

__all__ = [
    "ROPE_TYPES",
    "rope_frequencies",
    "from_config",
    "cos_sin_cache",
    "cos_sin_cache_gpu",
]

#: The scaling schemes understood, with the keys each needs in ``rope_scaling``
#: besides ``rope_type`` (a missing ``original_max_position_embeddings`` falls
#: back to ``max_position_embeddings``, as Hugging Face does).
ROPE_TYPES = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "proportional": (),
}

#: Legacy names: "su" (early Phi-3 configs) is LongRoPE; "mrope" (Qwen2-VL)
#: changes how positions map to frequency bands, not the frequencies.
_ALIASES = {"su": "longrope", "mrope": "default"}

_DEFAULT_THETA = 10000.0


# ---------------------------------------------------------------------------
# argument checks


def _positive_int(v, name: str) -> int:
    n = _as_int(v, name)
    if n <= 0:
        raise ValueError(f"{name}: expected a positive int, got {n}")
    return n


def _config_int(v, name: str) -> int:
    """A positive int, or a float holding one (config.json files and some
    transformers configs store context lengths as floats, e.g. 4096.0)."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return _positive_int(v, name)


def _as_float(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {type(v).__name__}")
    f = float(v)
    if not math.isfinite(f):
        raise ValueError(f"{name}: expected a finite number, got {f}")
    return f


def _positive_float(v, name: str) -> float:
    f = _as_float(v, name)
    if f <= 0:
        raise ValueError(f"{name}: expected a number > 0, got {f}")
    return f


def _rope_type(rope_scaling) -> str:
    """The canonical scheme name of a ``rope_scaling`` dict (None: "default")."""
    if rope_scaling is None:
        return "default"
    if not isinstance(rope_scaling, Mapping):
        raise TypeError(f"rope_scaling: expected a dict or None, got {type(rope_scaling).__name__}")
    name = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if name is None:
        name = "default"
    if not isinstance(name, str):
        raise TypeError(f"rope_scaling['rope_type']: expected a str, got {type(name).__name__}")
    name = _ALIASES.get(name, name)
    if name not in ROPE_TYPES:
        raise ValueError(f"rope_scaling['rope_type']: unknown scaling type {name!r}; "
                         f"expected one of {', '.join(ROPE_TYPES)}")
    return name


def _required(params: Mapping, key: str, rope_type: str):
    if key not in params:
        raise ValueError(f"rope_scaling: the {rope_type!r} scheme needs the key {key!r}, "
                         f"which is missing (got keys {sorted(params)})")
    return params[key]


def _merge(explicit, in_dict, name: str, default):
    """A parameter given both as an argument and in the rope_scaling dict."""
    if explicit is not None and in_dict is not None and explicit != in_dict:
        raise ValueError(f"{name}: given as {explicit!r} and as rope_scaling[{name!r}] = {in_dict!r}; "
                         "pass it once or make them agree")
    if explicit is not None:
        return explicit
    return in_dict if in_dict is not None else default


def _even_head_dim(head_dim) -> int:
    head_dim = _positive_int(head_dim, "head_dim")
    if head_dim % 2:
        raise ValueError(f"head_dim: expected an even number of channels, got {head_dim}")
    return head_dim


def _theta_arg(rope_theta, params: Mapping) -> float:
    theta = _positive_float(_merge(rope_theta, params.get("rope_theta"), "rope_theta", _DEFAULT_THETA),
                            "rope_theta")
    if theta == 1.0:
        raise ValueError("rope_theta: expected a base != 1 (every frequency would be 1)")
    return theta


def _partial_factor_arg(partial_rotary_factor, params: Mapping) -> float:
    prf = _as_float(_merge(partial_rotary_factor, params.get("partial_rotary_factor"),
                           "partial_rotary_factor", 1.0), "partial_rotary_factor")
    if not 0.0 < prf <= 1.0:
        raise ValueError(f"partial_rotary_factor: expected a value in (0, 1], got {prf}")
    return prf


def _seq_len_arg(seq_len) -> Optional[int]:
    if seq_len is None:
        return None
    seq_len = _as_int(seq_len, "seq_len")
    if seq_len < 0:
        raise ValueError(f"seq_len: expected an int >= 0, got {seq_len}")
    return seq_len


def _rotary_dim(head_dim: int, partial_rotary_factor: float) -> int:
    dim = int(head_dim * partial_rotary_factor)  # truncation, as Hugging Face does
    if dim < 2 or dim % 2:
        raise ValueError(f"partial_rotary_factor: head_dim * partial_rotary_factor = {head_dim} * "
                         f"{partial_rotary_factor} gives rotary_dim {dim}; expected an even rotary_dim >= 2")
    return dim


# ---------------------------------------------------------------------------
# the schemes (all float64)


class _Scheme(NamedTuple):
    """The checked inputs of one scheme builder."""

    params: Mapping  # the rope_scaling dict (empty for plain RoPE)
    theta: float  # rope_theta
    dim: int  # rotary_dim
    max_position_embeddings: Optional[int]
    seq_len: Optional[int]


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    """theta ** (-2f / dim), f in [0, dim/2)."""
    return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def _mscale(scale: float, k: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0


def _factor(params: Mapping, rope_type: str) -> float:
    return _positive_float(_required(params, "factor", rope_type), "rope_scaling['factor']")


def _original_max(params: Mapping, rope_type: str, max_position_embeddings) -> int:
    value = params.get("original_max_position_embeddings")
    if value is None:
        if max_position_embeddings is None:
            raise ValueError(f"rope_scaling: the {rope_type!r} scheme needs the key "
                             "'original_max_position_embeddings' (or the max_position_embeddings "
                             "argument to fall back on), got neither")
        return max_position_embeddings
    return _config_int(value, "rope_scaling['original_max_position_embeddings']")


def _default(s: _Scheme):
    return _base_inv_freq(s.theta, s.dim), 1.0


def _linear(s: _Scheme):
    return _base_inv_freq(s.theta, s.dim) / _factor(s.params, "linear"), 1.0


def _dynamic(s: _Scheme):
    factor = _factor(s.params, "dynamic")
    if s.max_position_embeddings is None:
        raise ValueError("max_position_embeddings: the 'dynamic' scheme needs it, got None")
    if s.dim == 2:
        raise ValueError("partial_rotary_factor: the 'dynamic' scheme needs rotary_dim > 2 "
                         "(its exponent is rotary_dim / (rotary_dim - 2)), got rotary_dim 2")
    max_pos = s.max_position_embeddings
    length = max_pos if s.seq_len is None else max(s.seq_len, max_pos)
    scale = factor * length / max_pos - (factor - 1)
    if scale <= 0:
        raise ValueError(f"rope_scaling['factor']: the 'dynamic' scheme gives a base scale "
                         f"{scale} <= 0 for factor {factor}")
    return _base_inv_freq(s.theta * scale ** (s.dim / (s.dim - 2)), s.dim), 1.0


def _yarn_factor(params: Mapping, orig: int, max_position_embeddings) -> float:
    factor = params["factor"]
    if factor is None:  # DeepSeek-V3 style: the ratio of the context lengths
        if max_position_embeddings is None:
            raise ValueError("max_position_embeddings: the 'yarn' scheme with factor None needs it "
                             "(factor = max_position_embeddings / original_max_position_embeddings)")
        factor = max_position_embeddings / orig
    return _positive_float(factor, "rope_scaling['factor']")


def _yarn_attention_factor(params: Mapping, factor: float) -> float:
    attention_factor = params.get("attention_factor")
    if attention_factor is not None:
        return _positive_float(attention_factor, "rope_scaling['attention_factor']")
    mscale = params.get("mscale")
    mscale_all_dim = params.get("mscale_all_dim")
    if mscale and mscale_all_dim:  # DeepSeek-V2/V3: the ratio of two mscales
        mscale = _as_float(mscale, "rope_scaling['mscale']")
        mscale_all_dim = _as_float(mscale_all_dim, "rope_scaling['mscale_all_dim']")
        return _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
    return _mscale(factor)


def _yarn_ramp(params: Mapping, theta: float, dim: int, orig: int) -> np.ndarray:
    """Per pair, 0 where the base frequency is kept, 1 where it is divided by factor."""
    # a zero or missing beta takes the paper's value, as in Hugging Face
    beta_fast = _positive_float(params.get("beta_fast") or 32, "rope_scaling['beta_fast']")
    beta_slow = _positive_float(params.get("beta_slow") or 1, "rope_scaling['beta_slow']")
    # Hugging Face reads .get("truncate", True): only a missing key truncates
    # by default; an explicit None, like False, does not.
    truncate = params.get("truncate", True)

    def correction_dim(turns):
        # the dimension (of dim) whose wavelength fits `turns` times in orig positions
        return dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as in Hugging Face: avoid a zero-width ramp
    return np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)


def _yarn(s: _Scheme):
    _required(s.params, "factor", "yarn")
    orig = _original_max(s.params, "yarn", s.max_position_embeddings)
    factor = _yarn_factor(s.params, orig, s.max_position_embeddings)
    attention_factor = _yarn_attention_factor(s.params, factor)
    ramp = _yarn_ramp(s.params, s.theta, s.dim, orig)
    base = _base_inv_freq(s.theta, s.dim)
    # ramp 0 keeps base (extrapolation), ramp 1 interpolates (base / factor)
    inv_freq = (base / factor) * ramp + base * (1.0 - ramp)
    return inv_freq, float(attention_factor)


def _llama3(s: _Scheme):
    params = s.params
    factor = _factor(params, "llama3")
    low_ff = _positive_float(_required(params, "low_freq_factor", "llama3"),
                             "rope_scaling['low_freq_factor']")
    high_ff = _positive_float(_required(params, "high_freq_factor", "llama3"),
                              "rope_scaling['high_freq_factor']")
    if high_ff <= low_ff:
        raise ValueError(f"rope_scaling['high_freq_factor']: expected a value > low_freq_factor "
                         f"({low_ff}), got {high_ff}")
    orig = _original_max(params, "llama3", s.max_position_embeddings)

    base = _base_inv_freq(s.theta, s.dim)
    wavelen = 2 * math.pi / base
    low_freq_wavelen = orig / low_ff
    high_freq_wavelen = orig / high_ff
    smooth = (orig / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1.0 - smooth) * base / factor + smooth * base
    inv_freq = np.where(wavelen > low_freq_wavelen, base / factor,
                        np.where(wavelen < high_freq_wavelen, base, smoothed))
    return inv_freq, 1.0


def _factor_list(params, key: str, half: int) -> np.ndarray:
    value = _required(params, key, "longrope")
    name = f"rope_scaling[{key!r}]"
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise TypeError(f"{name}: expected a list of {half} numbers, got {type(value).__name__}")
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a list of {half} numbers") from None
    if arr.shape != (half,):
        raise ValueError(f"{name}: expected a list of rotary_dim / 2 = {half} numbers, "
                         f"got shape {list(arr.shape)}")
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError(f"{name}: expected finite numbers > 0")
    return arr


def _longrope_attention_factor(params: Mapping, orig: int, max_position_embeddings) -> float:
    attention_factor = params.get("attention_factor")
    if attention_factor is not None:
        return _positive_float(attention_factor, "rope_scaling['attention_factor']")
    factor = params.get("factor")
    if factor is None:  # Phi-3: the ratio of the context lengths
        if max_position_embeddings is None:
            raise ValueError("max_position_embeddings: the 'longrope' scheme needs it to derive the "
                             "attention factor when rope_scaling has neither 'factor' nor "
                             "'attention_factor'")
        factor = max_position_embeddings / orig
    factor = _positive_float(factor, "rope_scaling['factor']")
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))


def _longrope(s: _Scheme):
    half = s.dim // 2
    short = _factor_list(s.params, "short_factor", half)
    long = _factor_list(s.params, "long_factor", half)
    orig = _original_max(s.params, "longrope", s.max_position_embeddings)
    attention_factor = _longrope_attention_factor(s.params, orig, s.max_position_embeddings)
    ext = long if (s.seq_len and s.seq_len > orig) else short
    return _base_inv_freq(s.theta, s.dim) / ext, float(attention_factor)


def _proportional(params, theta, head_dim, prf):
    factor = params.get("factor")
    factor = 1.0 if factor is None else _positive_float(factor, "rope_scaling['factor']")
    rotated = int(prf * head_dim // 2)  # pairs that turn, as transformers counts them
    inv_freq = np.zeros(head_dim // 2, dtype=np.float64)
    inv_freq[:rotated] = theta ** -(np.arange(0, 2 * rotated, 2, dtype=np.float64) / head_dim)
    return (inv_freq / factor).astype(np.float32)


#: rope_type -> builder of (float64 inv_freq [rotary_dim / 2], attention factor);
#: "proportional" spans the whole head and is built apart.
_SCHEMES: Dict[str, Callable[[_Scheme], Tuple[np.ndarray, float]]] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "llama3": _llama3,
    "longrope": _longrope,
}


def rope_frequencies(head_dim, rope_theta=None, rope_scaling=None, partial_rotary_factor=None,
                     max_position_embeddings=None, seq_len=None) -> Tuple[np.ndarray, float]:
    """``inv_freq`` and the attention factor of a RoPE scaling scheme.

    The schemes and their formulas are in this module's docstring; the
    argument reference is ``docs/api.md`` (section Frequencies).

    Parameters
    ----------
    head_dim : int
        Channels per head (even). For MLA models (DeepSeek-V2/V3) pass
        ``qk_rope_head_dim``.
    rope_theta : float, optional
        The base (default 10000.0, or ``rope_scaling['rope_theta']`` when the
        dict carries it, as transformers 5.x ``rope_parameters`` do).
    rope_scaling : dict, optional
        None (plain RoPE) or a dict with ``rope_type`` (or the legacy
        ``type``) among :data:`ROPE_TYPES` and that scheme's keys; other keys
        are ignored.
    partial_rotary_factor : float, optional
        Fraction of the head that rotates, in (0, 1] (default 1.0, or
        ``rope_scaling['partial_rotary_factor']``):
        ``rotary_dim = int(head_dim * partial_rotary_factor)``.
    max_position_embeddings : int, optional
        The model's context length: needed by ``dynamic``, and by
        ``yarn`` / ``longrope`` where they derive the factor from it.
    seq_len : int, optional
        The current sequence length (largest position + 1), read by
        ``dynamic`` and ``longrope``. This function is pure: to reproduce
        Hugging Face's stateful ``dynamic`` module, pass the largest length
        seen since its last reset.

    Returns
    -------
    inv_freq : numpy.ndarray
        The float32 frequencies [rotary_dim / 2] ([head_dim / 2] for
        ``proportional``).
    attention_factor : float
        Multiplies cos and sin (1.0 for schemes without one).

    Raises
    ------
    TypeError, ValueError
        Naming the argument (or the ``rope_scaling`` key) and what was expected.

    Examples
    --------
    >>> inv, factor = rope_frequencies(128, 500000.0, {"rope_type": "llama3", "factor": 8.0,
    ...     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    ...     "original_max_position_embeddings": 8192})
    >>> inv.shape, inv.dtype, factor
    ((64,), dtype('float32'), 1.0)
    """
    head_dim = _even_head_dim(head_dim)
    rope_type = _rope_type(rope_scaling)
    params = dict(rope_scaling) if rope_scaling is not None else {}
    theta = _theta_arg(rope_theta, params)
    prf = _partial_factor_arg(partial_rotary_factor, params)
    if max_position_embeddings is not None:
        max_position_embeddings = _config_int(max_position_embeddings, "max_position_embeddings")
    seq_len = _seq_len_arg(seq_len)
    if rope_type == "proportional":
        return _proportional(params, theta, head_dim, prf), 1.0
    scheme = _Scheme(params, theta, _rotary_dim(head_dim, prf), max_position_embeddings, seq_len)
    inv_freq, attention_factor = _SCHEMES[rope_type](scheme)
    return inv_freq.astype(np.float32), float(attention_factor)


# ---------------------------------------------------------------------------
# model configs


_NESTING_MARKERS = ("rope_type", "type", "rope_theta", "factor", "partial_rotary_factor")


def _check_config(config) -> None:
    """Refuse what cannot be a config, before it reads as one without attributes."""
    if isinstance(config, (str, bytes, os.PathLike)):
        raise TypeError(f"config: from_config takes a config object or a dict and downloads "
                        f"nothing; got the {type(config).__name__} {config!r} (load it first, e.g. "
                        "transformers.AutoConfig.from_pretrained(name), or json.load a config.json)")
    if config is None or isinstance(config, numbers.Number) or (
            isinstance(config, Sequence) and not isinstance(config, Mapping)):
        raise TypeError(f"config: expected a config object or a dict, got {type(config).__name__}")


def _config_getter(config):
    """get(key): a config object's attribute or a dict's key, None if absent."""
    if isinstance(config, Mapping):
        return config.get

    def get(key):
        try:
            return getattr(config, key, None)
        except Exception:  # properties that raise on some configs
            return None
    return get


def _text_config(get):
    """The ``text_config`` of a composite config whose top level cannot say
    the head size (nor carries rope parameters), else None."""
    text = get("text_config")
    if text is None or get("rope_parameters") or get("rope_scaling"):
        return None
    if get("head_dim") or get("qk_rope_head_dim") or (
            get("hidden_size") and get("num_attention_heads")):
        return None
    return text


def _config_rope_params(get, layer_type) -> dict:
    """A copy of the config's rope dict, the entry of ``layer_type`` where
    the dict holds one per layer type ({} for plain RoPE)."""
    params: Any = get("rope_parameters")
    if not params:
        params = get("rope_scaling")
    if params is not None and not isinstance(params, Mapping):
        raise TypeError(f"config: expected rope_parameters / rope_scaling to be a dict or None, "
                        f"got {type(params).__name__}")
    params = dict(params) if params else {}
    nested = [k for k, v in params.items() if isinstance(v, Mapping) or v is None]
    if params and nested and not any(k in params for k in _NESTING_MARKERS):
        if layer_type is None:
            raise ValueError(f"layer_type: the config has rope parameters per layer type "
                             f"({', '.join(map(str, nested))}); pass layer_type= to pick one")
        if layer_type not in params:
            raise ValueError(f"layer_type: expected one of {', '.join(map(str, nested))}, got {layer_type!r}")
        params = dict(params[layer_type] or {})
    return params


def _first_of(value, get, keys, default):
    """``value``, else the first of the config's ``keys`` that is set, else ``default``."""
    for key in keys:
        if value is not None:
            return value
        value = get(key)
    return default if value is None else value


def _layer_override(get, layer_type):
    """The per-layer config (or dict of overrides) of the first layer of
    ``layer_type``, where the config has ``per_layer_config``; else None."""
    per_layer = get("per_layer_config")
    if per_layer is None or (isinstance(per_layer, Mapping) and not per_layer):
        return None
    if not isinstance(per_layer, Mapping):
        try:  # transformers' view: indexed by layer type, as its rope functions do
            return per_layer[layer_type]
        except Exception:
            return None
    types = get("layer_types") or ()
    for i, t in enumerate(types):
        if t != layer_type:
            continue
        for key, value in per_layer.items():  # config.json keys: "05" or 5
            try:
                if int(key) == i:
                    return value
            except (TypeError, ValueError):
                continue
        return None
    return None


class _HeadGeometry(NamedTuple):
    """The head size a config gives, and the partial rotary factor that applies to it."""

    head_dim: Any  # checked by rope_frequencies
    partial_rotary_factor: Any


def _config_head(get, layer_type, prf) -> _HeadGeometry:
    """The config's head size (a per-layer override first, MLA's rope slice
    where there is one) and the partial rotary factor that applies to it."""
    layer_get = get
    if layer_type is not None:
        override = _layer_override(get, layer_type)
        if override is not None:
            layer_get = _config_getter(override)
    head_dim = layer_get("head_dim") or get("head_dim")
    mla = layer_get("qk_rope_head_dim") or get("qk_rope_head_dim")
    if mla:
        try:
            maps = prf != 1.0 and bool(head_dim) and int(head_dim * prf) == mla
        except (TypeError, ValueError, OverflowError):
            maps = False  # rope_frequencies names the bad value
        if maps:
            prf = 1.0  # the factor maps head_dim onto the rope slice already
        head_dim = mla
    if not head_dim:
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        if not hidden or not heads:
            raise ValueError("config: expected head_dim (or qk_rope_head_dim), or hidden_size and "
                             "num_attention_heads")
        head_dim = _positive_int(hidden, "config.hidden_size") // _positive_int(
            heads, "config.num_attention_heads")
    return _HeadGeometry(head_dim, prf)


def _apply_config_quirks(params: dict, get) -> None:
    """Readings transformers applies to some configs' rope dicts (in place)."""
    if get("model_type") == "phi3" and params.get("rope_type", params.get("type")) == "yarn":
        params["rope_type"] = "longrope"  # Phi3Config's reading of legacy configs
        params.pop("type", None)
    if _rope_type(params or None) in ("yarn", "llama3", "longrope"):
        top_orig = get("original_max_position_embeddings")  # Phi-3's top-level key wins
        if top_orig is not None:
            params["original_max_position_embeddings"] = top_orig


def from_config(config, seq_len=None, *, layer_type=None) -> Tuple[np.ndarray, float]:
    """:func:`rope_frequencies` for a model config: a transformers config object or a dict.

    Reads attributes (or keys); transformers is not imported and nothing is
    downloaded. Which keys are read, and in which order of priority
    (``rope_parameters`` / ``rope_scaling``, ``rope_theta``,
    ``partial_rotary_factor``, ``head_dim`` / ``qk_rope_head_dim``, Phi-3's
    and Gemma 4's quirks, composite configs through ``text_config``), is
    listed in ``docs/api.md`` (section Frequencies); each follows
    transformers' own reading.

    Parameters
    ----------
    config : object or dict
        A transformers ``PretrainedConfig`` (or anything with its attributes)
        or a dict such as a loaded ``config.json``. A model name or a path is
        refused.
    seq_len : int, optional
        As in :func:`rope_frequencies` (``dynamic`` and ``longrope``).
    layer_type : str, optional
        The layer type whose parameters to read, where the config has rope
        parameters per layer type (e.g. ``"full_attention"``).

    Returns
    -------
    inv_freq : numpy.ndarray
        The float32 frequencies [rotary_dim / 2], as :func:`rope_frequencies`.
    attention_factor : float
        Multiplies cos and sin.

    Raises
    ------
    TypeError
        ``config`` is a string, a path or another non-config value, or its
        rope dict is not a dict.
    ValueError
        The config cannot say the head size, ``layer_type`` is missing or
        unknown, or :func:`rope_frequencies` refuses the parameters read.

    Examples
    --------
    >>> inv, factor = from_config({"hidden_size": 4096, "num_attention_heads": 32,
    ...                            "rope_theta": 500000.0})
    >>> inv.shape, factor
    ((64,), 1.0)
    """
    _check_config(config)
    get = _config_getter(config)
    text = _text_config(get)
    if text is not None:
        return from_config(text, seq_len, layer_type=layer_type)
    params = _config_rope_params(get, layer_type)
    theta = _first_of(params.pop("rope_theta", None), get,
                      ("rope_theta", "rotary_emb_base", "default_theta"), _DEFAULT_THETA)
    prf = _first_of(params.pop("partial_rotary_factor", None), get,
                    ("partial_rotary_factor", "rotary_pct"), 1.0)
    head = _config_head(get, layer_type, prf)
    _apply_config_quirks(params, get)
    return rope_frequencies(head.head_dim, rope_theta=theta, rope_scaling=params or None,
                            partial_rotary_factor=head.partial_rotary_factor,
                            max_position_embeddings=get("max_position_embeddings"), seq_len=seq_len)


# ---------------------------------------------------------------------------
# cos / sin tables


def _check_table_args(max_position, attention_factor):
    max_position = _positive_int(max_position, "max_position")
    attention_factor = _positive_float(attention_factor, "attention_factor")
    return max_position, attention_factor


def cos_sin_cache(inv_freq, max_position, attention_factor=1.0, device_array_module=None):
    """The cos and sin tables [max_position, r/2] for ``apply_rope(x, cos, sin)``.

    ``cos[p, f] = attention_factor * cos(p * inv_freq[f])`` and likewise sin,
    for positions p in [0, max_position), computed on the CPU in float64 from
    the float32 values of ``inv_freq`` (the angles of the kernel's
    ``inv_freq=`` path: ``p * inv_freq`` is exact in float64 for p < 2**29)
    and rounded once to float32.

    Parameters
    ----------
    inv_freq : array_like
        [r/2] frequencies (NumPy, CuPy, or anything ``numpy.asarray`` takes),
        rounded to float32 first.
    max_position : int
        Rows of the tables (> 0).
    attention_factor : float, default 1.0
        Multiplies both tables (> 0).
    device_array_module : module, optional
        None for NumPy arrays, or an array module (e.g. ``cupy``) whose
        ``asarray`` the float32 tables are passed through.

    Returns
    -------
    cos, sin : array
        C-contiguous float32 [max_position, r/2].

    Raises
    ------
    TypeError, ValueError
        Naming the argument: ``inv_freq`` not a non-empty 1-D array of finite
        numbers, ``max_position`` or ``attention_factor`` not positive.

    Examples
    --------
    >>> inv, factor = rope_frequencies(64)
    >>> cos, sin = cos_sin_cache(inv, 4096, factor)
    >>> cos.shape, cos.dtype
    ((4096, 32), dtype('float32'))
    """
    max_position, attention_factor = _check_table_args(max_position, attention_factor)
    inv = _inv_freq_host(inv_freq).astype(np.float64)
    angles = np.arange(max_position, dtype=np.float64)[:, None] * inv[None, :]
    cos = (np.cos(angles) * attention_factor).astype(np.float32)
    sin = (np.sin(angles) * attention_factor).astype(np.float32)
    if device_array_module is not None:
        cos, sin = device_array_module.asarray(cos), device_array_module.asarray(sin)
    return cos, sin


def _inv_freq_host(inv_freq) -> np.ndarray:
    if hasattr(inv_freq, "get") and type(inv_freq).__module__.startswith("cupy"):
        inv_freq = inv_freq.get()
    try:
        arr = np.asarray(inv_freq)
    except Exception:
        raise TypeError(f"inv_freq: expected an array of floats, got {type(inv_freq).__name__}") from None
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"inv_freq: expected a float array, got dtype {arr.dtype}")
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"inv_freq: expected a non-empty 1-D array [rotary_dim / 2], "
                         f"got shape {list(arr.shape)}")
    arr = arr.astype(np.float32)
    if not np.all(np.isfinite(arr)):
        raise ValueError("inv_freq: expected finite values")
    return arr


def _inv_freq_device(cupy, inv_freq):
    """``inv_freq`` as a contiguous float32 CuPy array, checked as on the host."""
    if not isinstance(inv_freq, cupy.ndarray):
        return cupy.asarray(_inv_freq_host(inv_freq))
    if inv_freq.dtype.kind not in "fiu":
        raise TypeError(f"inv_freq: expected a float array, got dtype {inv_freq.dtype}")
    if inv_freq.ndim != 1 or inv_freq.size == 0:
        raise ValueError(f"inv_freq: expected a non-empty 1-D array [rotary_dim / 2], "
                         f"got shape {list(inv_freq.shape)}")
    inv = cupy.ascontiguousarray(inv_freq, dtype=cupy.float32)
    if not bool(cupy.isfinite(inv).all()):
        raise ValueError("inv_freq: expected finite values")
    return inv


_GPU_KERNEL = None


def _gpu_kernel():
    global _GPU_KERNEL
    if _GPU_KERNEL is None:
        import cupy

        # one thread per table entry: angle in float64 (exact: position < 2**29
        # times a float32), float64 sincos, scaled, rounded once to float32
        _GPU_KERNEL = cupy.ElementwiseKernel(
            "raw float32 inv_freq, int64 half, float64 factor",
            "float32 c, float32 s",
            """
            const long long p = (long long)i / half;
            const long long f = (long long)i - p * half;
            const double angle = (double)p * (double)inv_freq[f];
            double sv, cv;
            sincos(angle, &sv, &cv);
            c = (float)(cv * factor);
            s = (float)(sv * factor);
            """,
            "cupy_rope_cos_sin_cache",
        )
    return _GPU_KERNEL


def cos_sin_cache_gpu(inv_freq, max_position, attention_factor=1.0):
    """:func:`cos_sin_cache` computed on the current CuPy device.

    Each entry is ``float32(attention_factor * cos(p * inv_freq[f]))`` with the
    angle and the cos/sin in float64 on the GPU, so the tables match the CPU
    ones to within one float32 rounding. CuPy is imported here, not at
    module import.

    Parameters
    ----------
    inv_freq : numpy.ndarray or cupy.ndarray
        [r/2] frequencies, rounded to float32.
    max_position : int
        Rows of the tables (> 0).
    attention_factor : float, default 1.0
        Multiplies both tables (> 0).

    Returns
    -------
    cos, sin : cupy.ndarray
        C-contiguous float32 [max_position, r/2] on the current device,
        written on the current stream.

    Raises
    ------
    NoCudaDeviceError
        (a ``RuntimeError``) where CuPy is missing or sees no CUDA device;
        :func:`cos_sin_cache` builds the same tables on the CPU.
    TypeError, ValueError
        As :func:`cos_sin_cache`.

    Examples
    --------
    >>> inv, factor = rope_frequencies(128, 500000.0)
    >>> cos, sin = cos_sin_cache_gpu(inv, 8192, factor)    # doctest: +SKIP
    >>> cos.shape, type(cos).__module__                    # doctest: +SKIP
    ((8192, 64), 'cupy')
    """
    max_position, attention_factor = _check_table_args(max_position, attention_factor)
    cupy = require_cuda("cos_sin_cache_gpu")
    inv = _inv_freq_device(cupy, inv_freq)
    half = inv.size
    cos = cupy.empty((max_position, half), dtype=cupy.float32)
    sin = cupy.empty((max_position, half), dtype=cupy.float32)
    _gpu_kernel()(inv, half, attention_factor, cos, sin)
    return cos, sin
