"""Which dtype the generation model computes (and the store keeps) its KV in.

The setting ``kv_dtype`` (``schemas.settings.KV_DTYPES``) is ``auto``, ``float32``, ``bfloat16``
or ``float16``. It is the model's compute dtype for the KV forward, so a stored entry is the
model's own cache at that dtype, and it is part of ``model_fp`` (hence of ``kv_fp``).

``auto`` picks ``bfloat16`` where the device computes it natively, else ``float32``:

- CUDA: ``torch.cuda.is_bf16_supported(including_emulation=False)`` for that device (compute
  capability 8.0 or newer, or ROCm); CUDA not visible to this process: float32;
- CPU: the Linux ``/proc/cpuinfo`` flags ``avx512_bf16`` (AVX512-BF16: Cooper Lake, Sapphire
  Rapids, Zen 4 and later) or ``amx_bf16`` (AMX); without them PyTorch emulates bf16 through
  float32 conversions, slower than float32 itself. No ``/proc/cpuinfo`` (macOS, Windows):
  float32, since nothing was detected;
- anything else (``mps``, ``xpu``, ...): float32.

The device string is read as a ``torch.device``, so ``cpu`` and ``cpu:0`` (or ``cuda`` and
``cuda:0``) choose alike.

>>> cpu_computes_bf16("flags\\t\\t: fpu sse avx512f avx512_bf16 amx_tile")
True
>>> resolve_kv_dtype("auto", "cpu:0", cpuinfo="flags : fpu sse avx2").dtype
'float32'
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coinrag.schemas.settings import KV_DTYPES

_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class KvDtype:
    """A resolved ``kv_dtype``: the dtype and why it was chosen (for logs)."""

    dtype: str  # float32 | bfloat16 | float16
    reason: str


def cpu_flags(cpuinfo: str) -> set[str]:
    """The CPU feature flags of a ``/proc/cpuinfo`` text (x86 ``flags``, Arm ``Features``)."""
    out: set[str] = set()
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip().lower() in ("flags", "features"):
            out.update(value.split())
    return out


def cpu_computes_bf16(cpuinfo: str) -> bool:
    """True when the flags name a native bf16 unit (AVX512-BF16 or AMX-BF16)."""
    flags = cpu_flags(cpuinfo)
    return any(flag in flags for flag in _CPU_BF16_FLAGS)


def read_cpuinfo() -> str:
    """This machine's ``/proc/cpuinfo`` ("" where there is none)."""
    try:
        return _CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def device_type(device: str) -> str:
    """``"cpu:0"`` -> ``"cpu"``, ``"cuda:1"`` -> ``"cuda"`` (ValueError for a bad string)."""
    import torch

    try:
        return torch.device(device).type
    except RuntimeError as exc:
        raise ValueError(f"device {device!r} is not a torch device ({exc})") from exc


def _cuda_bf16(device: str) -> KvDtype:
    import torch

    if not torch.cuda.is_available():
        return KvDtype("float32", f"auto: CUDA is not available to this process ({device})")
    with torch.cuda.device(torch.device(device)):
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        name = torch.cuda.get_device_name()
    if native:
        return KvDtype("bfloat16", f"auto: {name} computes bf16 natively")
    return KvDtype("float32", f"auto: {name} has no native bf16")


def resolve_kv_dtype(setting: str, device: str, *, cpuinfo: str | None = None) -> KvDtype:
    """The dtype ``setting`` means on ``device`` (``cpuinfo``: this machine's when None).

    Raises ValueError for a setting outside ``KV_DTYPES`` or a bad device string.
    """
    if setting not in KV_DTYPES:
        raise ValueError(f"kv_dtype {setting!r} is not one of {', '.join(KV_DTYPES)}")
    kind = device_type(device)
    if setting != "auto":
        return KvDtype(setting, f"kv_dtype = {setting} (set)")
    if kind == "cuda":
        return _cuda_bf16(device)
    if kind == "cpu":
        text = read_cpuinfo() if cpuinfo is None else cpuinfo
        if cpu_computes_bf16(text):
            found = sorted(cpu_flags(text) & set(_CPU_BF16_FLAGS))
            return KvDtype("bfloat16", f"auto: the CPU has {', '.join(found)}")
        return KvDtype("float32", "auto: the CPU has no avx512_bf16 / amx_bf16")
    return KvDtype("float32", f"auto: no native bf16 detected for device type {kind!r}")


def resolve_compute_dtype(name: str, setting: str, device: str) -> str:
    """The dtype a compute-dtype setting ``name`` (``schemas.training_settings.COMPUTE_DTYPES``:
    the local question generator's model, embedder training) means on ``device``: ``auto``
    as for ``kv_dtype`` (bfloat16 where the device computes it natively, else float32).

    >>> resolve_compute_dtype("dtype", "float32", "cpu")
    'float32'
    """
    from coinrag.schemas.training_settings import COMPUTE_DTYPES

    if setting not in COMPUTE_DTYPES:
        raise ValueError(f"{name} {setting!r} is not one of {', '.join(COMPUTE_DTYPES)}")
    return resolve_kv_dtype(setting, device).dtype
