"""FP8 layerwise casting: store Linear/Conv weights in float8, compute in bf16/fp16/fp32.

Plain torch; knows nothing of ComfyUI and works on any ``torch.nn.Module``. Pieces:

- :func:`quantize_weight` / :func:`quantize_with_scale` / :func:`dequantize_weight`: one
  weight ⇄ float8 storage with an optional scale (none, per-tensor, per-output-channel).
- :func:`plan_layers`: which layers of a module are cast and which are kept (regex skip
  patterns on module names, :func:`default_skip_patterns` per architecture family; defined
  in ``fp8_patterns`` and re-exported here).
- :func:`scaled_linear` / :func:`scale_weight`: the compute side (storage → compute dtype,
  scale applied), shared by the plain-torch layers here and the ComfyUI op layers in
  ``comfy_integration``.
- :func:`apply_fp8_layerwise`: cast a plain module (benchmarks, non-ComfyUI use); returns
  a handle whose ``restore()`` puts the original layers back.

Why not ``diffusers.hooks.apply_layerwise_casting``: it casts a module's weights *in place*,
has no removal (so it cannot be undone on unload), has no scale (small weights fall into
float8's subnormal range: the 2+2-block Flux measurement in issue 4 gives 0.083 relative
error unscaled vs 0.065 with a per-tensor scale) and its default skip patterns use
diffusers' module names. In ComfyUI, ``ModelPatcher.clone()`` shares one nn.Module between
every branch, so in-place casting would change the input MODEL. The ComfyUI integration
therefore builds *new* layer modules holding the float8 tensors (ComfyUI cast ops: they
already cast weights to the input dtype at forward time, stream in lowvram mode and take
LoRA patches through ``convert_weight``/``set_weight``) and hands them to the clone as
object patches, which ComfyUI swaps in on load and restores on unload. The plain-module API
here replaces child modules the same way (and restores them) instead of casting in place.

Units: bytes everywhere; scales are float32 tensors.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

STORAGE_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SCALINGS = ("none", "per-tensor", "per-output-channel")
# Largest finite value of each float8 format (OCP FP8 spec; torch.finfo gives the same).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

# Skip patterns and the layer plan live in fp8_patterns; re-exported here (one import for callers).
from .fp8_patterns import (  # noqa: F401
    CASTABLE_TYPES,
    COMMON_SKIPS,
    FAMILY_BLOCKS,
    FAMILY_SIGNATURES,
    FAMILY_SKIPS,
    HIGH_PRECISION,
    PRESETS,
    LayerPlan,
    coverage,
    default_skip_patterns,
    detect_family,
    parse_patterns,
    plan_layers,
)


# ---------------------------------------------------------------------------------------------
# Quantisation
# ---------------------------------------------------------------------------------------------
def _check_storage(storage_dtype: torch.dtype) -> float:
    if storage_dtype not in FP8_MAX:
        raise ValueError(f"storage dtype must be one of {list(STORAGE_DTYPES)}, got {storage_dtype}")
    return FP8_MAX[storage_dtype]


def compute_scale(weight: torch.Tensor, storage_dtype: torch.dtype, scaling: str,
                  power_of_two: bool = False) -> torch.Tensor | None:
    """Scale s with weight ≈ s · q, q the float8 value: ``None`` for ``none``; a 0-d float32
    tensor ``amax/fmax`` for ``per-tensor``; shape (out, 1, ...) (weight.ndim dims) for
    ``per-output-channel`` (dim 0 = output channels of Linear/Conv). fmax is the largest
    finite float8 value (448 for e4m3fn, 57344 for e5m2), so the largest |w| maps to it and
    small weights move out of the subnormal range. An all-zero tensor/row gets scale 1.

    ``power_of_two``: s rounded up to a power of two (2^ceil(log2(amax/fmax)); the largest |w|
    maps into (fmax/2, fmax]). Same relative precision (float8 is a floating-point format), and s
    and every product q · s are exact in bf16/fp16/fp32: for code that multiplies by the scale in
    the compute dtype (core's QuantizedTensor dequantises so), where amax/fmax itself would be
    rounded (bf16 keeps 8 bits; an e5m2 scale is an fp16 subnormal)."""
    fmax = _check_storage(storage_dtype)
    if scaling == "none":
        return None
    w = weight.detach()
    if scaling == "per-tensor":
        amax = w.abs().max().float()
    elif scaling == "per-output-channel":
        amax = w.abs().reshape(w.shape[0], -1).amax(dim=1).float().reshape((-1,) + (1,) * (w.ndim - 1))
    else:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    s = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    return torch.exp2(torch.ceil(torch.log2(s))) if power_of_two else s


def quantize_with_scale(weight: torch.Tensor, storage_dtype: torch.dtype, scale: torch.Tensor | None,
                        rows_per_chunk: int = 4096) -> torch.Tensor:
    """float8 tensor q = round(clamp(weight / scale, ±fmax)) (round to nearest even), same
    shape and device as ``weight``. Worked in float32 over ``rows_per_chunk`` rows at a time
    (a few MiB of scratch per chunk). Values beyond ±fmax saturate instead of becoming NaN."""
    fmax = _check_storage(storage_dtype)
    out = torch.empty(weight.shape, dtype=storage_dtype, device=weight.device)
    if weight.numel() == 0:
        return out
    s = None if scale is None else scale.detach().to(device=weight.device, dtype=torch.float32)
    weight = weight.detach()
    for i in range(0, weight.shape[0], rows_per_chunk):
        w = weight[i:i + rows_per_chunk].to(torch.float32, copy=True)
        if s is not None:
            w.div_(s if s.ndim == 0 else s[i:i + rows_per_chunk])
        out[i:i + rows_per_chunk] = w.clamp_(-fmax, fmax).to(storage_dtype)
    return out


def quantize_weight(weight: torch.Tensor, storage_dtype: torch.dtype, scaling: str = "per-tensor",
                    work_device: torch.device | str | None = None,
                    out_device: torch.device | str | None = None,
                    power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantise one weight to float8: returns ``(q, scale)`` (see :func:`compute_scale`, also
    for ``power_of_two``).

    ``work_device``: where the arithmetic runs (e.g. the GPU, much faster than the CPU for
    large models; default the weight's device); ``out_device``: where q and scale are put
    (default the weight's device). ``weight`` is not modified.
    """
    src_device = weight.device
    w = weight.detach()
    if work_device is not None:
        w = w.to(work_device)
    scale = compute_scale(w, storage_dtype, scaling, power_of_two)
    q = quantize_with_scale(w, storage_dtype, scale)
    dest = torch.device(out_device) if out_device is not None else src_device
    if q.device != dest:
        q = q.to(dest)
        scale = None if scale is None else scale.to(dest)
    return q, scale


def _times_scale(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t · scale`` worked in float32 and rounded once to ``dtype`` (default ``t.dtype``).

    Never casts the scale to a 16-bit dtype first: an e5m2 scale (amax/57344, ~1e-6 for
    std-0.02 weights) or a small channel's e4m3 scale is an fp16 subnormal with a few
    significant bits left, and bf16 keeps only 8 bits of any scale (a systematic error of up
    to 0.4 % on every weight it multiplies). Issue 14 item 9."""
    dtype = t.dtype if dtype is None else dtype
    return (t.to(torch.float32) * scale.to(device=t.device, dtype=torch.float32)).to(dtype)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q`` (float8, or its values already cast to a float dtype) times ``scale``, in ``dtype``
    (the product is worked in float32 and rounded once)."""
    return q.to(dtype) if scale is None else _times_scale(q, scale, dtype)


def scale_weight(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Storage-domain weight already in the compute dtype → real weight (multiplied by scale
    in float32, rounded once to the weight's dtype)."""
    return weight if scale is None else _times_scale(weight, scale)


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with a float8 weight's scale folded in where it is cheapest.

    ``weight``: storage-domain values in the compute dtype, shape (out, in); ``scale``: None,
    0-d or (out, 1), float32. In bf16/fp32 the scale multiplies whichever of input / output /
    weight is smallest (as ComfyUI's scaled-fp8 op does), so the per-forward overhead is one
    small elementwise multiply. In fp16 it always multiplies the weight: storage-domain values
    reach 448 (e4m3) or 57344 (e5m2), so an unscaled matmul would overflow fp16's 65504, and an
    input multiplied by a tiny e5m2 scale would fall into fp16's subnormals. The multiply is
    worked in float32 and rounded once to the compute dtype (see :func:`_times_scale`).
    """
    if scale is None:
        return F.linear(x, weight, bias)
    if weight.dtype == torch.float16:
        return F.linear(x, _times_scale(weight, scale), bias)
    # Plain comparisons (ties: weight, then output): torch.compile traces them with dynamic
    # shapes, where ``min(sizes, key=sizes.get)`` broke the graph at every Linear (item 15).
    n_weight, n_in = weight.numel(), x.numel()
    n_out = n_in // max(1, x.shape[-1]) * weight.shape[0]
    if n_weight <= n_out and (scale.ndim != 0 or n_weight <= n_in):
        return F.linear(x, _times_scale(weight, scale), bias)
    if scale.ndim != 0 or n_out <= n_in:
        y = F.linear(x, weight).to(torch.float32) * scale.to(device=x.device, dtype=torch.float32).reshape(-1)
        return (y if bias is None else y + bias).to(x.dtype)
    return F.linear(_times_scale(x, scale), weight, bias)


def fp8_matmul_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`fp8_linear` can run this Linear: float8_e4m3fn weight, 2-D/3-D float
    input, inner and output sizes multiples of 16 (cuBLASLt's float8 layout rule), CUDA or CPU."""
    return (weight.dtype == torch.float8_e4m3fn and x.ndim in (2, 3) and x.dtype in HIGH_PRECISION
            and x.shape[-1] % 16 == 0 and weight.shape[0] % 16 == 0 and x.device.type in ("cuda", "cpu"))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
               bias: torch.Tensor | None) -> torch.Tensor:
    """Linear on float8 tensor cores: ``x`` is quantised to float8_e4m3fn per row (token)
    with scale amax/448, then ``torch._scaled_mm`` multiplies it with the float8 ``weight``
    (out, in) using row-wise scales (activation rows × weight output channels), bf16 output.

    Faster than casting the weight up (half the bytes read, float8 GEMM) where the hardware
    has float8 tensor cores (NVIDIA compute capability ≥ 8.9); torch also runs it on CPU
    (slowly; used to test the numerics). Adds the activation rounding error: on the 1+1-block
    Flux fixture 0.028 → 0.038 relative L2 (per-tensor weight scale). Output in ``x.dtype``.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    amax = x2.abs().amax(dim=1, keepdim=True).float()
    sa = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    xq = (x2.float() / sa).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    n = weight.shape[0]
    sb = torch.ones((), device=x.device) if scale is None else scale.to(device=x.device, dtype=torch.float32)
    sb = sb.reshape(1, -1).expand(1, n).contiguous()
    y = torch._scaled_mm(xq, weight.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16).to(x.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*shape[:-1], n)


def check_fp8_matmul(device: torch.device | str) -> None:
    """Raise ValueError (naming the device) unless :func:`fp8_linear` runs on ``device``:
    CPU, or a CUDA GPU with compute capability ≥ 8.9 (Ada, Hopper, Blackwell), probed with a
    16×16 product."""
    dev = torch.device(device)
    reason = None
    if dev.type == "cuda":
        cc = torch.cuda.get_device_capability(dev)
        if cc < (8, 9):
            reason = f"compute capability {cc[0]}.{cc[1]} < 8.9 (float8 tensor cores: RTX 40xx, L4/L40, H100/H200)"
    elif dev.type != "cpu":
        reason = "float8 matmul is only available on NVIDIA GPUs (and emulated on CPU)"
    if reason is None:
        try:
            w = torch.ones((16, 16), device=dev).to(torch.float8_e4m3fn)
            y = fp8_linear(torch.ones((16, 16), device=dev, dtype=torch.bfloat16), w, None, None)
            if float(y[0, 0]) != 16.0:
                reason = f"probe returned {float(y[0, 0])} instead of 16"
        except Exception as e:  # noqa: BLE001 - any backend failure means unusable; its message says why
            reason = str(e)
    if reason is not None:
        raise ValueError(f"fp8_matmul cannot run on {dev}: {reason}. Turn fp8_matmul off (weights stay "
                         "float8 in memory and are cast up per layer instead).")


def param_bytes(t: torch.Tensor | None) -> int:
    """Bytes held by a tensor (numel × element size); 0 for None."""
    return 0 if t is None else t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------
# Plain-module API (benchmarks, any nn.Module)
# ---------------------------------------------------------------------------------------------
class Fp8Layer(torch.nn.Module):
    """A Linear/Conv whose weight is stored in float8 and cast to ``compute_dtype`` per forward.

    Built from an existing layer (the original is not changed; its bias tensor is shared).
    Inputs are cast to the compute dtype; the output stays in it. ``fp8_matmul``: Linear
    layers use :func:`fp8_linear` where :func:`fp8_matmul_supported` says it can run.
    ``comfy_force_forward``: hosts whose fused shortcuts would read a layer's weight directly call
    this forward instead (the weight is float8 and is scaled here).
    """

    comfy_force_forward = True

    def __init__(self, layer: torch.nn.Module, q: torch.Tensor, scale: torch.Tensor | None,
                 compute_dtype: torch.dtype, fp8_matmul: bool = False):
        super().__init__()
        self.fp8_matmul = fp8_matmul
        self.weight = torch.nn.Parameter(q, requires_grad=False)
        self.bias = layer.bias
        self.register_buffer("scale_weight", scale, persistent=False)
        self.compute_dtype = compute_dtype
        self._conv = layer._conv_forward if isinstance(layer, torch.nn.modules.conv._ConvNd) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.compute_dtype)
        if self.fp8_matmul and self._conv is None and fp8_matmul_supported(x, self.weight):
            return fp8_linear(x, self.weight, self.scale_weight, self.bias)
        w = self.weight.to(self.compute_dtype)
        b = None if self.bias is None else self.bias.to(self.compute_dtype)
        if self._conv is None:
            return scaled_linear(x, w, self.scale_weight, b)
        return self._conv(x, scale_weight(w, self.scale_weight), b)


@dataclass
class Fp8Handle:
    """Result of :func:`apply_fp8_layerwise`: the plan, byte counts and ``restore()``."""

    module: torch.nn.Module
    plan: LayerPlan
    originals: dict[str, torch.nn.Module]
    bytes_before: int
    bytes_after: int

    def restore(self) -> None:
        """Put every original layer back (idempotent)."""
        for name, layer in self.originals.items():
            _set_submodule(self.module, name, layer)
        self.originals = {}


def _set_submodule(root: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of every parameter and persistent buffer of ``module`` (its state dict)."""
    return sum(param_bytes(t) for t in module.state_dict().values())


def apply_fp8_layerwise(module: torch.nn.Module, storage_dtype: torch.dtype = torch.float8_e4m3fn,
                        compute_dtype: torch.dtype = torch.bfloat16, scaling: str = "per-tensor",
                        skip_patterns: Iterable[str | tuple[str, str]] | None = None,
                        work_device: torch.device | str | None = None, fp8_matmul: bool = False) -> Fp8Handle:
    """Replace the eligible layers of a plain module by :class:`Fp8Layer` (float8 storage).

    ``skip_patterns`` default: :func:`default_skip_patterns` for the module's family. Returns
    an :class:`Fp8Handle` (``restore()`` undoes it). The float8 tensors are put on each
    layer's current device. For a benchmark: build the model, call this, run forwards with
    inputs in ``compute_dtype``; compare weight bytes (``handle.bytes_after``) and time with
    the untouched model. ``fp8_matmul``: see :class:`Fp8Layer`.
    """
    if skip_patterns is None:
        skip_patterns = default_skip_patterns(detect_family(module))
    plan = plan_layers(module, skip_patterns)
    before = weight_bytes(module)
    originals = {}
    for name in plan.cast:
        layer = module.get_submodule(name)
        q, s = quantize_weight(layer.weight, storage_dtype, scaling, work_device=work_device)
        originals[name] = layer
        _set_submodule(module, name, Fp8Layer(layer, q, s, compute_dtype, fp8_matmul))
    return Fp8Handle(module, plan, originals, before, weight_bytes(module))


def check_dtypes(device: torch.device | str, storage_dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
    """Raise ValueError (naming device and dtypes) unless ``device`` can hold ``storage_dtype``
    tensors, cast them to ``compute_dtype`` and run a Linear in it. Runs a tiny probe on the
    device (a 4×8 weight) rather than trusting a table: support differs by backend (MPS has
    no float8; old GPUs emulate bf16)."""
    try:
        w = torch.ones((4, 8), dtype=torch.float32, device=device).to(storage_dtype)
        x = torch.ones((2, 8), dtype=compute_dtype, device=device)
        y = F.linear(x, w.to(compute_dtype))
        if not bool(torch.isfinite(y).all()) or float(y[0, 0]) != 8.0:
            raise RuntimeError("probe returned wrong values")
    except Exception as e:  # noqa: BLE001 - any backend failure means unusable; its message says why
        raise ValueError(f"device {device} cannot store {str(storage_dtype).replace('torch.', '')} weights and "
                         f"compute in {str(compute_dtype).replace('torch.', '')}: {e}. Choose another "
                         "compute_dtype (float32 works everywhere) or run this model on another device.") from None
