"""The 64-bit hash of a tensor's bytes, defined once: torch ops that give the same value on every device.

    h = tensor_hash(torch.randn(4, 4))        # a 0-d int64 tensor on the tensor's device (no host read)
    int(h) & (2**64 - 1)                      # the hash as an unsigned 64-bit number
    probes.dump.hashes.hex_hash(int(h))       # "0x3f2a...": how ``probes show`` prints it

The bytes are the tensor's values in logical (row-major) order, each in its dtype's own bytes
(little-endian, as every device torch runs on stores them): what ``x.contiguous().view(torch.uint8)``
holds. They are read as 64-bit little-endian words ``w_0 .. w_{m-1}``, the last one padded with zero
bytes. With ``mix`` the splitmix64 finaliser, ``G = 0x9E3779B97F4A7C15`` and ``n`` the byte count, all
arithmetic modulo 2^64::

    S = sum(mix(w_i + (i + 1) * G) for i in range(m))
    hash = mix(S + (n + 1) * G)

Each word is mixed with its position, so a permutation changes the hash; the sum makes it independent
of the order the words are added in (buckets, threads, a GPU's reduction tree): the same bytes give the
same hash on every device. The byte count tells apart tensors that differ only by trailing zero bytes.
It is a checksum for "bit-identical or not", not a cryptographic hash.

torch has no unsigned 64-bit arithmetic on every device, so this is int64 arithmetic, which wraps; the
logical right shift masks the sign bits. The C++ kernel (``_stats_kernel.cpp``, ``hash_into``) computes
the same function for contiguous CPU tensors; the tests hold both to a numpy reference.
"""

from __future__ import annotations

import torch

__all__ = ["GOLDEN", "HASH_CHUNK_WORDS", "tensor_hash", "to_signed"]

GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
HASH_CHUNK_WORDS = 1 << 21  # words per pass: bounds the extra memory (a few int64 temporaries of this size)
_MASK64 = (1 << 64) - 1


def to_signed(value: int) -> int:
    """``value`` modulo 2^64 as a signed int64 (what an int64 tensor or column holds)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_G, _M1, _M2 = to_signed(GOLDEN), to_signed(_MIX1), to_signed(_MIX2)


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, in place on int64 bits."""
    z ^= _shr(z, 30)
    z *= _M1
    z ^= _shr(z, 27)
    z *= _M2
    z ^= _shr(z, 31)
    return z


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in logical order, as a flat uint8 tensor starting at an 8-byte boundary."""
    if tensor.is_neg():  # a lazily negated view: its memory holds -x
        tensor = tensor.resolve_neg()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    flat = tensor.contiguous().reshape(-1)
    if flat.dtype is not torch.uint8:
        flat = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=flat.device)
    if flat.storage_offset() % 8:  # a view into its storage: its words would not be aligned
        flat = flat.clone()
    return flat


def tensor_hash(tensor: torch.Tensor, *, chunk_words: int = HASH_CHUNK_WORDS, on_cpu: bool = False) -> torch.Tensor:
    """The hash (see the module docstring) of a dense tensor's bytes: a 0-d int64 tensor, no host read.

        tensor_hash(torch.zeros(0))   # the hash of no bytes
        tensor_hash(x, on_cpu=True)   # a device tensor hashed one chunk at a time on the CPU

    ``on_cpu``: each chunk is copied to the CPU first (saves device memory; the result is on the CPU).
    """
    data = _byte_view(tensor)
    nbytes = data.numel()
    device = torch.device("cpu") if on_cpu else data.device
    whole = nbytes // 8
    total = torch.zeros((), dtype=torch.int64, device=device)
    words = data[:whole * 8].view(torch.int64) if whole else None
    for start in range(0, whole, chunk_words):
        chunk = words[start:start + chunk_words].to(device)  # type: ignore[index]
        positions = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=device)
        positions *= _G
        positions += chunk
        total += _mix_(positions).sum()
    tail = nbytes - whole * 8
    if tail:
        shifts = torch.arange(0, 8 * tail, 8, dtype=torch.int64, device=device)
        word = (data[whole * 8:].to(device=device, dtype=torch.int64) << shifts).sum().reshape(1)
        word += to_signed((whole + 1) * GOLDEN)
        total += _mix_(word).sum()
    total += to_signed((nbytes + 1) * GOLDEN)
    return _mix_(total.reshape(1)).reshape(())
