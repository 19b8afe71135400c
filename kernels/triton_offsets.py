"""Which operands a Pallas kernel on the Triton backend can address whole.

Pallas's Triton lowering computes a ref's element offsets in 32 bits unless the ref holds
more than 4 GiB, and the pointer arithmetic reads those bits as signed: the elements of a
ref of 2 to 4 GiB past 2**31 are out of reach, which only a 1-byte dtype (e4m3) can reach
(on the H200, the last layer of Llama-3.1-8B's 32-layer, 3.5 GiB e4m3 gate|up stack gave
products 100x off; benchmarks/README.md, "One GPU: FP8 weights and the FP8 KV cache").
Past 4 GiB the offsets are 64-bit (a 4.7 GiB stack's last layer read correctly on an
H100: tests/test_fp8_gemm.py::test_pallas_kernels_read_the_last_layer_of_a_stack_past_2_gib).
"""

from __future__ import annotations

MAX_32_BIT_ELEMENTS = 2**31 - 1
WIDE_OFFSET_BYTES = 2**32  # a ref of more bytes gets 64-bit offsets


def reaches(elements: int, itemsize: int) -> bool:
    """Whether a Pallas Triton kernel addresses every element of a ref of ``elements``
    elements of ``itemsize`` bytes."""
    return elements <= MAX_32_BIT_ELEMENTS or elements * itemsize > WIDE_OFFSET_BYTES


def unreachable_counts(elements_per_unit: int, itemsize: int) -> range:
    """The counts of units (pages, layers) of ``elements_per_unit`` elements each whose ref
    a Pallas Triton kernel cannot address whole: empty for 2-byte and wider dtypes but for
    a count of exactly 2**31 elements."""
    first = MAX_32_BIT_ELEMENTS // elements_per_unit + 1
    last = WIDE_OFFSET_BYTES // (elements_per_unit * itemsize)
    return range(first, max(first, last + 1))
