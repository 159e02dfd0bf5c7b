"""lora_func/variants/_orthogonal.py's helpers (shared by OFT and BOFT) beyond the peft
oracles in tests/test_variants_structured_b.py, whose block sizes are small. Written to kill
mutants (tools/mutate.py)."""

from __future__ import annotations

from lora_func.variants._orthogonal import block_size_of


def test_block_size_of_every_triangle():
    """``b(b-1)/2`` entries give ``b`` for every block size up to 300 (an ``isqrt`` off by one
    part only at large ``b``)."""
    assert [block_size_of(b * (b - 1) // 2) for b in range(2, 301)] == list(range(2, 301))
