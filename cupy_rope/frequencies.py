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
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Tuple

import numpy as np

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


def _rotary_dim(head_dim: int, partial_rotary_factor: float) -> int:
    dim = int(head_dim * partial_rotary_factor)  # truncation, as Hugging Face does
    if dim < 2 or dim % 2:
        raise ValueError(f"partial_rotary_factor: head_dim * partial_rotary_factor = {head_dim} * "
                         f"{partial_rotary_factor} gives rotary_dim {dim}; expected an even rotary_dim >= 2")
    return dim


# ---------------------------------------------------------------------------
# the schemes (all float64)


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    """theta ** (-2f / dim), f in [0, dim/2)."""
    return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def _mscale(scale: float, k: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0


def _original_max(params: Mapping, rope_type: str, max_position_embeddings) -> int:
    value = params.get("original_max_position_embeddings")
    if value is None:
        if max_position_embeddings is None:
            raise ValueError(f"rope_scaling: the {rope_type!r} scheme needs the key "
                             "'original_max_position_embeddings' (or the max_position_embeddings "
                             "argument to fall back on), got neither")
        return max_position_embeddings
    return _config_int(value, "rope_scaling['original_max_position_embeddings']")


def _yarn(params, theta, dim, max_position_embeddings):
    factor = _required(params, "factor", "yarn")
    orig = _original_max(params, "yarn", max_position_embeddings)
    if factor is None:  # DeepSeek-V3 style: the ratio of the context lengths
        if max_position_embeddings is None:
            raise ValueError("max_position_embeddings: the 'yarn' scheme with factor None needs it "
                             "(factor = max_position_embeddings / original_max_position_embeddings)")
        factor = max_position_embeddings / orig
    factor = _positive_float(factor, "rope_scaling['factor']")

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale = params.get("mscale")
        mscale_all_dim = params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            mscale = _as_float(mscale, "rope_scaling['mscale']")
            mscale_all_dim = _as_float(mscale_all_dim, "rope_scaling['mscale_all_dim']")
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor)
    else:
        attention_factor = _positive_float(attention_factor, "rope_scaling['attention_factor']")

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

    base = _base_inv_freq(theta, dim)
    # ramp 0 up to `low` (keep base: extrapolation), 1 from `high` on (base / factor)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    inv_freq = (base / factor) * ramp + base * (1.0 - ramp)
    return inv_freq, float(attention_factor)


def _llama3(params, theta, dim, max_position_embeddings):
    factor = _positive_float(_required(params, "factor", "llama3"), "rope_scaling['factor']")
    low_ff = _positive_float(_required(params, "low_freq_factor", "llama3"),
                             "rope_scaling['low_freq_factor']")
    high_ff = _positive_float(_required(params, "high_freq_factor", "llama3"),
                              "rope_scaling['high_freq_factor']")
    if high_ff <= low_ff:
        raise ValueError(f"rope_scaling['high_freq_factor']: expected a value > low_freq_factor "
                         f"({low_ff}), got {high_ff}")
    orig = _original_max(params, "llama3", max_position_embeddings)

    base = _base_inv_freq(theta, dim)
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


def _longrope(params, theta, dim, max_position_embeddings, seq_len):
    half = dim // 2
    short = _factor_list(params, "short_factor", half)
    long = _factor_list(params, "long_factor", half)
    orig = _original_max(params, "longrope", max_position_embeddings)

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        factor = params.get("factor")
        if factor is None:  # Phi-3: the ratio of the context lengths
            if max_position_embeddings is None:
                raise ValueError("max_position_embeddings: the 'longrope' scheme needs it to derive the "
                                 "attention factor when rope_scaling has neither 'factor' nor "
                                 "'attention_factor'")
            factor = max_position_embeddings / orig
        factor = _positive_float(factor, "rope_scaling['factor']")
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    else:
        attention_factor = _positive_float(attention_factor, "rope_scaling['attention_factor']")

    ext = long if (seq_len and seq_len > orig) else short
    return _base_inv_freq(theta, dim) / ext, float(attention_factor)


def _proportional(params, theta, head_dim, prf):
    factor = params.get("factor")
    factor = 1.0 if factor is None else _positive_float(factor, "rope_scaling['factor']")
    rotated = int(prf * head_dim // 2)  # pairs that turn, as transformers counts them
    inv_freq = np.zeros(head_dim // 2, dtype=np.float64)
    inv_freq[:rotated] = theta ** -(np.arange(0, 2 * rotated, 2, dtype=np.float64) / head_dim)
    return (inv_freq / factor).astype(np.float32)


def rope_frequencies(head_dim, rope_theta=None, rope_scaling=None, partial_rotary_factor=None,
                     max_position_embeddings=None, seq_len=None) -> Tuple[np.ndarray, float]:
    """``inv_freq`` and the attention factor of a RoPE scaling scheme.

    Args:
        head_dim: channels per head (even). Hugging Face derives it as
            ``hidden_size // num_attention_heads`` where a config has no
            ``head_dim``; for MLA models (DeepSeek-V2/V3) pass ``qk_rope_head_dim``.
        rope_theta: the base (default 10000.0, or ``rope_scaling['rope_theta']``
            when the dict carries it, as transformers 5.x ``rope_parameters`` do).
        rope_scaling: None (plain RoPE) or a dict with ``rope_type`` (or the
            legacy ``type``) among :data:`ROPE_TYPES` and that scheme's keys:
            ``factor``; ``low_freq_factor``, ``high_freq_factor`` (llama3);
            ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``,
            ``truncate``, ``attention_factor`` (yarn); ``short_factor``,
            ``long_factor``, ``attention_factor`` (longrope); ``factor``
            (proportional, optional);
            ``original_max_position_embeddings`` (yarn, llama3, longrope;
            defaults to ``max_position_embeddings``). Other keys are ignored.
        partial_rotary_factor: fraction of the head that rotates, in (0, 1]
            (default 1.0, or ``rope_scaling['partial_rotary_factor']``);
            ``rotary_dim = int(head_dim * partial_rotary_factor)`` (for
            ``proportional``: the number of pairs with a nonzero frequency is
            ``int(head_dim * partial_rotary_factor // 2)``, and rotary_dim is
            head_dim).
        max_position_embeddings: the model's context length; needed by
            ``dynamic``, and by ``yarn``/``longrope`` where they derive the
            factor from it.
        seq_len: the current sequence length (largest position + 1). Used by
            ``dynamic`` (rescaled base once seq_len > max_position_embeddings)
            and ``longrope`` (long factors once seq_len >
            original_max_position_embeddings); ignored by the others. This
            function is pure: Hugging Face's rotary module for ``dynamic``
            keeps state instead (once a forward has grown the base it keeps
            it, and resets to the original only for a sequence shorter than
            max_position_embeddings), so to reproduce its frequencies pass
            the largest length seen since that reset.

    Returns:
        ``(inv_freq, attention_factor)``: float32 NumPy array [rotary_dim / 2]
        (entry f for pair f, see the module docstring; [head_dim / 2] for
        ``proportional``) and a Python float by
        which cos and sin are multiplied (1.0 for schemes without one).

    Raises:
        ValueError / TypeError naming the argument (or the ``rope_scaling`` key)
        and what was expected.
    """
    head_dim = _positive_int(head_dim, "head_dim")
    if head_dim % 2:
        raise ValueError(f"head_dim: expected an even number of channels, got {head_dim}")
    rope_type = _rope_type(rope_scaling)
    params = dict(rope_scaling) if rope_scaling is not None else {}

    theta = _positive_float(_merge(rope_theta, params.get("rope_theta"), "rope_theta", _DEFAULT_THETA),
                            "rope_theta")
    if theta == 1.0:
        raise ValueError("rope_theta: expected a base != 1 (every frequency would be 1)")
    prf = _as_float(_merge(partial_rotary_factor, params.get("partial_rotary_factor"),
                           "partial_rotary_factor", 1.0), "partial_rotary_factor")
    if not 0.0 < prf <= 1.0:
        raise ValueError(f"partial_rotary_factor: expected a value in (0, 1], got {prf}")
    if max_position_embeddings is not None:
        max_position_embeddings = _config_int(max_position_embeddings, "max_position_embeddings")
    if seq_len is not None:
        seq_len = _as_int(seq_len, "seq_len")
        if seq_len < 0:
            raise ValueError(f"seq_len: expected an int >= 0, got {seq_len}")
    if rope_type == "proportional":
        return _proportional(params, theta, head_dim, prf), 1.0
    dim = _rotary_dim(head_dim, prf)

    attention_factor = 1.0
    if rope_type == "default":
        inv_freq = _base_inv_freq(theta, dim)
    elif rope_type == "linear":
        factor = _positive_float(_required(params, "factor", rope_type), "rope_scaling['factor']")
        inv_freq = _base_inv_freq(theta, dim) / factor
    elif rope_type == "dynamic":
        factor = _positive_float(_required(params, "factor", rope_type), "rope_scaling['factor']")
        if max_position_embeddings is None:
            raise ValueError("max_position_embeddings: the 'dynamic' scheme needs it, got None")
        if dim == 2:
            raise ValueError("partial_rotary_factor: the 'dynamic' scheme needs rotary_dim > 2 "
                             "(its exponent is rotary_dim / (rotary_dim - 2)), got rotary_dim 2")
        length = max_position_embeddings if seq_len is None else max(seq_len, max_position_embeddings)
        scale = factor * length / max_position_embeddings - (factor - 1)
        if scale <= 0:
            raise ValueError(f"rope_scaling['factor']: the 'dynamic' scheme gives a base scale "
                             f"{scale} <= 0 for factor {factor}")
        inv_freq = _base_inv_freq(theta * scale ** (dim / (dim - 2)), dim)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn(params, theta, dim, max_position_embeddings)
    elif rope_type == "llama3":
        inv_freq, attention_factor = _llama3(params, theta, dim, max_position_embeddings)
    else:  # longrope
        inv_freq, attention_factor = _longrope(params, theta, dim, max_position_embeddings, seq_len)
    return inv_freq.astype(np.float32), float(attention_factor)


# ---------------------------------------------------------------------------
# model configs


_NESTING_MARKERS = ("rope_type", "type", "rope_theta", "factor", "partial_rotary_factor")


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


def _layer_override(config, get, layer_type):
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


def from_config(config, seq_len=None, *, layer_type=None) -> Tuple[np.ndarray, float]:
    """:func:`rope_frequencies` for a model config: a transformers config object or a dict.

    Reads attributes (or keys), transformers is not imported:

    * the scheme: ``rope_parameters`` (transformers 5.x) or ``rope_scaling``
      (4.x, and config.json files); per-layer-type ``rope_parameters``
      (``{"full_attention": {...}, "sliding_attention": {...}}``) need
      ``layer_type`` to pick one;
    * ``rope_theta``: from that dict, else the top-level ``rope_theta`` (or
      ``rotary_emb_base``), else ``default_theta``, else 10000.0;
    * ``partial_rotary_factor``: from that dict, else top-level
      ``partial_rotary_factor`` (or ``rotary_pct``), else 1.0;
    * ``head_dim``: ``qk_rope_head_dim`` (MLA models; where a
      ``partial_rotary_factor`` already maps ``head_dim`` onto it, as in
      Mistral 4 and DeepSeek-V4 configs, it is not applied a second time),
      else ``head_dim``, else ``hidden_size // num_attention_heads``; with
      ``layer_type``, a per-layer override of ``head_dim`` (Gemma 4's
      ``per_layer_config``: 512 for its full-attention layers) as in
      transformers;
    * ``max_position_embeddings``; a top-level ``original_max_position_embeddings``
      (Phi-3) takes priority over the dict's for yarn, llama3 and longrope, as
      in transformers; Phi-3 configs (``model_type`` "phi3") that name
      ``yarn`` mean LongRoPE, as transformers' Phi3Config reads them.

    A composite (multimodal) config whose top level has no rope parameters
    and cannot give the head size is read through its ``text_config``. For a
    per-layer ``yarn`` entry ``truncate`` is read from that entry
    (transformers reads it from the top-level dict, where a per-layer config
    has none, and so always truncates).

    Returns ``(inv_freq, attention_factor)`` as :func:`rope_frequencies`.
    """
    get = _config_getter(config)
    text = get("text_config")
    if text is not None and not (get("rope_parameters") or get("rope_scaling")) and not (
            get("head_dim") or get("qk_rope_head_dim")
            or (get("hidden_size") and get("num_attention_heads"))):
        # a composite config whose top level cannot say the head size
        return from_config(text, seq_len, layer_type=layer_type)

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

    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = get("rope_theta")
    if theta is None:
        theta = get("rotary_emb_base")
    if theta is None:
        theta = get("default_theta")
    if theta is None:
        theta = _DEFAULT_THETA

    prf = params.pop("partial_rotary_factor", None)
    if prf is None:
        prf = get("partial_rotary_factor")
    if prf is None:
        prf = get("rotary_pct")
    if prf is None:
        prf = 1.0

    layer_get = get
    if layer_type is not None:
        override = _layer_override(config, get, layer_type)
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

    if get("model_type") == "phi3" and params.get("rope_type", params.get("type")) == "yarn":
        params["rope_type"] = "longrope"  # Phi3Config's reading of legacy configs
        params.pop("type", None)

    if _rope_type(params or None) in ("yarn", "llama3", "longrope"):
        top_orig = get("original_max_position_embeddings")
        if top_orig is not None:
            params["original_max_position_embeddings"] = top_orig

    return rope_frequencies(head_dim, rope_theta=theta, rope_scaling=params or None,
                            partial_rotary_factor=prf,
                            max_position_embeddings=get("max_position_embeddings"), seq_len=seq_len)


# ---------------------------------------------------------------------------
# cos / sin tables


def _check_table_args(max_position, attention_factor):
    max_position = _positive_int(max_position, "max_position")
    attention_factor = _positive_float(attention_factor, "attention_factor")
    return max_position, attention_factor


def cos_sin_cache(inv_freq, max_position, attention_factor=1.0, device_array_module=None):
    """cos and sin tables [max_position, r/2] for ``apply_rope(x, cos, sin)``.

    ``cos[p, f] = attention_factor * cos(p * inv_freq[f])`` and likewise sin,
    for positions p in [0, max_position). Computed on the CPU in float64 from
    the float32 values of ``inv_freq`` (so the angles are those the kernel's
    ``inv_freq=`` path uses: ``p * inv_freq`` is exact in float64 for
    p < 2**29) and rounded once to float32.

    Args:
        inv_freq: [r/2] array (NumPy or anything ``numpy.asarray`` takes),
            rounded to float32 first.
        max_position: rows of the tables (> 0).
        attention_factor: multiplies both tables (> 0).
        device_array_module: None to return NumPy arrays, or an array module
            (e.g. ``cupy``) whose ``asarray`` the float32 tables are passed
            through (a copy to the current device for CuPy).

    Returns:
        ``(cos, sin)``, C-contiguous float32 [max_position, r/2].
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
    ones to within one float32 rounding. ``inv_freq`` may be a NumPy or CuPy
    array (rounded to float32). CuPy is imported here, not at module import.

    Returns:
        ``(cos, sin)``: C-contiguous CuPy float32 arrays [max_position, r/2] on
        the current device, written on the current stream.
    """
    import cupy

    max_position, attention_factor = _check_table_args(max_position, attention_factor)
    if isinstance(inv_freq, cupy.ndarray):
        if inv_freq.dtype.kind not in "fiu":
            raise TypeError(f"inv_freq: expected a float array, got dtype {inv_freq.dtype}")
        if inv_freq.ndim != 1 or inv_freq.size == 0:
            raise ValueError(f"inv_freq: expected a non-empty 1-D array [rotary_dim / 2], "
                             f"got shape {list(inv_freq.shape)}")
        inv = cupy.ascontiguousarray(inv_freq, dtype=cupy.float32)
        if not bool(cupy.isfinite(inv).all()):
            raise ValueError("inv_freq: expected finite values")
    else:
        inv = cupy.asarray(_inv_freq_host(inv_freq))
    half = inv.size
    cos = cupy.empty((max_position, half), dtype=cupy.float32)
    sin = cupy.empty((max_position, half), dtype=cupy.float32)
    _gpu_kernel()(inv, half, attention_factor, cos, sin)
    return cos, sin
