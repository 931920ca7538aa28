"""Sizes and lengths as `cpctl plan` reads and prints them: GiB, bytes per element of each dtype,
token counts (4096, 128k, 1M), numbers given on the command line."""

from __future__ import annotations

import math
import re

from cpctl.errors import CpctlError

GiB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # the dtypes a model's weights come in, by the names cpctl uses
TORCH_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}  # as torch and config.json name them

_LENGTH = re.compile(r"(\d+(?:\.\d+)?)([kKmM]?)")


def parse_tokens(text: str, *, what: str = "--seq-len") -> int:
    """4096, 128k (x 1024), 1M or 1.5M (x 1024**2)."""
    match = _LENGTH.fullmatch(str(text).strip().replace("_", "").replace(",", ""))
    if match is None:
        raise CpctlError(f"{what} {text}: not a length; write tokens as e.g. 4096, 128k or 1M")
    number, suffix = match.groups()
    scale = {"": 1, "k": 1024, "m": 1024**2}[suffix.lower()]
    tokens = float(number) * scale
    if tokens != int(tokens) or tokens < 1:
        raise CpctlError(f"{what} {text}: must be a whole number of tokens, at least 1")
    return int(tokens)


def format_tokens(tokens: int) -> str:
    if tokens % 1024**2 == 0:
        return f"{tokens // 1024**2}M"
    if tokens % 1024 == 0:
        return f"{tokens // 1024}k"
    return f"{tokens:,}"


def parse_number(text: str, *, what: str, integer: bool = False, minimum: float = 1) -> float:
    try:
        value = int(text) if integer else float(text)
    except (TypeError, ValueError):
        raise CpctlError(f"{what} {text}: not {'an integer' if integer else 'a number'}") from None
    if math.isnan(value) or math.isinf(value):
        raise CpctlError(f"{what} {text}: not a finite number")
    if value < minimum:
        raise CpctlError(f"{what} {text}: must be at least {minimum:g}")
    return value


def parse_dtype(text: str, *, what: str) -> str:
    """bf16, fp16 or fp32 (also as torch names them: bfloat16, float16, float32)."""
    name = str(text).strip().lower().removeprefix("torch.")
    name = TORCH_DTYPE_NAMES.get(name, name)
    if name not in DTYPE_BYTES:
        raise CpctlError(f"{what} {text}: not a dtype of model weights; write {', '.join(sorted(DTYPE_BYTES))}")
    return name
