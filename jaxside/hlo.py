"""Read the GEMMs of a compiled XLA program: did every GEMM really run in FP8?

`jax.jit(f).lower(...).compile().as_text()` is the optimized HLO. `gemm_operand_types` lists each
GEMM instruction (a `dot`, fused or not, or a cuBLAS GEMM custom call) with the element types of
its two matrix operands; on Hopper an FP8 GEMM multiplies f8e4m3fn / f8e5m2 operands, and anything
else is a silent high-precision fallback.
"""

from __future__ import annotations

import re

FP8_TYPES = ("f8e4m3fn", "f8e5m2")
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*([\w\[\],{}:()#\s]+?)\s+([\w\-]+)\((.*)$")
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")


def _operands(arguments: str) -> list[str]:
    """The top-level comma-separated operands of `op(...)`, from the text after the opening parenthesis."""
    operands, depth, current = [], 0, ""
    for char in arguments:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                break
            depth -= 1
        if char == "," and depth == 0:
            operands.append(current.strip())
            current = ""
        else:
            current += char
    return [*operands, current.strip()] if current.strip() else operands


def gemm_operand_types(hlo_text: str) -> list[tuple[str, str]]:
    """(type of A, type of B) of every GEMM instruction: dots (fused ones included) and cuBLAS GEMM custom calls."""
    types, gemms = {}, []
    for line in hlo_text.splitlines():
        match = _DEFINITION.match(line)
        if not match:
            continue
        name, result_type, opcode, arguments = match.groups()
        types[name] = result_type.split("[")[0].strip("( ")
        is_gemm = opcode == "dot" or (opcode == "custom-call" and any(t in line for t in _GEMM_TARGETS))
        if is_gemm:
            gemms.append(_operands(arguments)[:2])

    def type_of(operand: str) -> str:
        if "[" in operand:  # printed with its shape: "f8e4m3fn[64,64]{1,0} %p"
            return operand.split("[")[0].strip()
        return types[operand.lstrip("%")]

    return [(type_of(a), type_of(b)) for a, b in gemms]


def fp8_gemm_count(hlo_text: str) -> tuple[int, int]:
    """(GEMMs whose operands are both FP8, all GEMMs) of an optimized HLO text."""
    gemms = gemm_operand_types(hlo_text)
    return sum(all(t in FP8_TYPES for t in pair) for pair in gemms), len(gemms)


__all__ = ["FP8_TYPES", "fp8_gemm_count", "gemm_operand_types"]
