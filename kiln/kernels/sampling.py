"""Token selection from prepared logits: a Triton kernel, its launcher, the torch reference
and the dispatcher the sampler calls.

Per row r of (N, V) float32 logits ``x`` (penalties and bans already applied):

* greedy rows (``inv_temp[r] == 0``) take ``argmax(x[r])``;
* the others take ``argmax(x[r, v] * inv_temp[r] + g(r, v))`` over the tokens with
  ``x[r, v] >= thr[r]`` (the filters' keep-threshold; -inf keeps every token), where
  ``g = -log(-log(u))`` is Gumbel noise: Gumbel-max, a draw from ``softmax(x * inv_temp)``
  restricted to the surviving tokens.

Ties go to the lowest index, as with ``torch.argmax``. The uniform ``u`` is a pure function
of the row's 64-bit seed, its step (how many tokens the sequence has output) and the
vocabulary index, computed with exact integer arithmetic: the same bits in the kernel, in
the reference, on the CPU and on the GPU. Only the float math after it (two logs, one
multiply-add) may round differently, so kernel and reference pick the same token except
where two candidates' scores are within a rounding error of each other.

``keys`` is an (N, 3) int64 tensor per row: the seed's low and high 32 bits, and the step.

The hash: ``mix`` is a 32-bit xorshift-multiply finalizer (the "lowbias32" constants); the
row key ``a = mix(mix(mix(step ^ S) ^ seed_hi) ^ seed_lo)``, ``b = mix(a ^ S2)``, and token
v gets ``h = mix(mix(v ^ a) + b)``, a bijection of v for each row. ``u`` takes the top 23
bits of h: ``((h >> 9) + 0.5) / 2**23``, exactly representable, strictly inside (0, 1)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels._triton import use_triton

__all__ = [
    "hash_bits_ref",
    "hash_bits_triton",
    "sample_ref",
    "sample_splits",
    "sample_tokens",
    "split_seed",
]

M32 = 0xFFFFFFFF
MUL_A = 0x7FEB352D
MUL_B = 0x846CA68B  # >= 2**31: the torch version multiplies by MUL_B - 2**31 plus a shift
STEP_SALT = 0x9E3779B9
KEY_SALT = 0x85EBCA6B
NOISE_BITS = 23
_BLOCK = 2048
_TARGET_PROGRAMS = 264  # two per SM on an H100 / H200
_REF_CHUNK = 1 << 16  # elements per slice in the reference


def split_seed(seed: int) -> tuple[int, int]:
    """Any Python int -> the (low, high) 32-bit halves of its value modulo 2**64."""
    s = seed & (2**64 - 1)
    return s & M32, s >> 32


# ---- torch reference -------------------------------------------------------------------
# int64 tensors holding values in [0, 2**32); every product stays below 2**63, so nothing
# relies on signed overflow.


def _mix(x: torch.Tensor) -> torch.Tensor:
    """In place (x must own its memory); returns x."""
    x ^= x >> 16
    x.mul_(MUL_A).bitwise_and_(M32)
    x ^= x >> 15
    top = (x & 1) << 31
    x.mul_(MUL_B - 2**31).add_(top).bitwise_and_(M32)
    x ^= x >> 16
    return x


def _row_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 3) int64 [seed_lo, seed_hi, step] -> the rows' (a, b), each (N, 1) int64."""
    lo, hi, step = keys[:, 0:1], keys[:, 1:2], keys[:, 2:3] & M32
    a = _mix(_mix(_mix(step ^ STEP_SALT) ^ hi) ^ lo)
    return a, _mix(a ^ KEY_SALT)


def _hash(a: torch.Tensor, b: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash of token(s) v under row key(s) (a, b), broadcast; a new tensor."""
    h = _mix(v ^ a)
    h += b
    return _mix(h.bitwise_and_(M32))


def hash_bits_ref(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """(N, 3) keys -> (N, vocab) int64: the 32-bit hash of every (row, token)."""
    a, b = _row_keys(keys)
    return _hash(a, b, torch.arange(vocab, device=keys.device)[None])


def _gumbel(a: torch.Tensor, b: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    bits = _hash(a, b, v) >> (32 - NOISE_BITS)
    u = bits.float().add_(0.5).mul_(2.0**-NOISE_BITS)
    return u.log_().neg_().log_().neg_()


def sample_ref(
    x: torch.Tensor,  # (N, V) float32
    inv_temp: torch.Tensor,  # (N,) float32, 0 = greedy
    thr: torch.Tensor,  # (N,) float32 keep-threshold on x
    keys: torch.Tensor,  # (N, 3) int64
) -> torch.Tensor:
    """(N,) int64 token ids; see the module docstring. The CPU's version: it looks at the
    data on the host to hash only what it needs, per row either every token (a slice of
    rows and columns at a time, so the int64 temporaries stay in cache) or, when few
    survive the threshold, only those."""
    n, vocab = x.shape
    out = torch.zeros(n, dtype=torch.int64, device=x.device)
    if n == 0 or vocab == 0:
        return out
    inv_l, thr_l = inv_temp.tolist(), thr.tolist()
    greedy = [r for r in range(n) if inv_l[r] == 0]
    dense = [r for r in range(n) if inv_l[r] != 0 and thr_l[r] == float("-inf")]
    cut = [r for r in range(n) if inv_l[r] != 0 and thr_l[r] != float("-inf")]
    dev = x.device
    if greedy:
        out[greedy] = (x if len(greedy) == n else x[greedy]).argmax(-1)
    a, b = _row_keys(keys)
    sparse: list[int] = []
    if cut:
        keep = (x if len(cut) == n else x[cut]) >= thr[cut, None]
        # counted 64 rows at a time: a sum of bools makes an int64 copy of its input
        few = [c * 8 <= vocab for part in keep.split(64) for c in part.sum(-1).tolist()]
        dense = sorted(dense + [r for r, f in zip(cut, few, strict=True) if not f])
        sparse = [r for r, f in zip(cut, few, strict=True) if f]
    if sparse:
        ri = torch.tensor(sparse, device=dev)
        pr, pc = keep[torch.tensor(few, device=dev)].nonzero(as_tuple=True)  # pr indexes ri
        rows = ri[pr]
        score = x[rows, pc] * inv_temp[rows] + _gumbel(a[rows, 0], b[rows, 0], pc)
        top = torch.full((len(sparse),), float("-inf"), device=dev)
        top = top.scatter_reduce(0, pr, score, "amax")
        hit = score == top[pr]
        first = torch.full((len(sparse),), vocab, dtype=torch.int64, device=dev)
        first = first.scatter_reduce(0, pr[hit], pc[hit], "amin")
        out[ri] = first.masked_fill_(first == vocab, 0)  # no survivor: index 0
    per, cols = max(1, _REF_CHUNK // vocab), min(vocab, _REF_CHUNK)
    for i in range(0, len(dense), per):
        ri = torch.tensor(dense[i : i + per], device=dev)
        xs, it, t, ka, kb = x[ri], inv_temp[ri, None], thr[ri, None], a[ri], b[ri]
        best = torch.full((len(ri),), float("-inf"), device=dev)
        best_i = torch.zeros(len(ri), dtype=torch.int64, device=dev)
        for c0 in range(0, vocab, cols):
            xc = xs[:, c0 : c0 + cols]
            v = torch.arange(c0, c0 + xc.shape[1], device=dev)[None]
            score = _gumbel(ka, kb, v).add_(xc * it).masked_fill_(~(xc >= t), float("-inf"))
            val, idx = score.max(-1)  # the first maximum
            better = val > best  # strict: an earlier slice keeps a tie
            best = torch.where(better, val, best)
            best_i = torch.where(better, idx + c0, best_i)
        out[ri] = best_i
    return out


# ---- Triton ------------------------------------------------------------------------------


@triton.jit
def _mix_tl(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _row_keys_tl(keys_ptr, row):
    lo = tl.load(keys_ptr + row * 3).to(tl.uint32)
    hi = tl.load(keys_ptr + row * 3 + 1).to(tl.uint32)
    step = tl.load(keys_ptr + row * 3 + 2).to(tl.uint32)
    a = _mix_tl(_mix_tl(_mix_tl(step ^ 0x9E3779B9) ^ hi) ^ lo)
    return a, _mix_tl(a ^ 0x85EBCA6B)


@triton.jit
def _bits_tl(a, b, cols):
    return _mix_tl(_mix_tl(cols.to(tl.uint32) ^ a) + b)


@triton.jit
def _sample_kernel(
    x_ptr,
    stride_x,
    inv_temp_ptr,
    thr_ptr,
    keys_ptr,
    out_ptr,
    part_val_ptr,
    part_idx_ptr,
    vocab,
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,  # chunks of BLOCK per program: a compile-time trip count
    SPLITS: tl.constexpr,  # programs per row; 1: the program stores the token itself
):
    row = tl.program_id(0)
    split = tl.program_id(1)  # this program's slice of the vocabulary: CHUNKS * BLOCK tokens
    inv_t = tl.load(inv_temp_ptr + row)
    thr = tl.load(thr_ptr + row)
    greedy = inv_t == 0.0
    inv_t = tl.where(greedy, 1.0, inv_t)  # no 0 * -inf = nan on greedy rows
    a, b = _row_keys_tl(keys_ptr, row)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    base = x_ptr + row.to(tl.int64) * stride_x
    for c in range(0, CHUNKS):
        cols = (split * CHUNKS + c) * BLOCK + offs
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf"))
        if greedy:  # the row's branch: no noise to compute
            score = x
        else:
            k = (_bits_tl(a, b, cols) >> 9).to(tl.float32)  # 32 - NOISE_BITS
            u = (k + 0.5) * 1.1920928955078125e-07  # 2**-23
            score = x * inv_t - tl.log(-tl.log(u))
            score = tl.where(x >= thr, score, float("-inf"))
        better = score > best  # strict: a lane keeps its earliest maximum
        best = tl.where(better, score, best)
        best_i = tl.where(better, cols, best_i)
    top = tl.max(best, axis=0)
    tok = tl.min(tl.where(best == top, best_i, vocab), axis=0)
    if SPLITS == 1:
        tok = tl.where(top == float("-inf"), 0, tok)  # nothing finite: index 0, as torch does
        tl.store(out_ptr + row, tok.to(tl.int64))
    else:
        tl.store(part_val_ptr + row * SPLITS + split, top)
        tl.store(part_idx_ptr + row * SPLITS + split, tok)


@triton.jit
def _sample_reduce_kernel(part_val_ptr, part_idx_ptr, out_ptr, vocab, SPLITS: tl.constexpr):
    """One program per row: the best of its slices' maxima, ties to the lowest index (the
    slices are in vocabulary order and each holds its own first maximum)."""
    row = tl.program_id(0)
    offs = tl.arange(0, SPLITS)
    val = tl.load(part_val_ptr + row * SPLITS + offs)
    idx = tl.load(part_idx_ptr + row * SPLITS + offs)
    top = tl.max(val, axis=0)
    tok = tl.min(tl.where(val == top, idx, vocab), axis=0)
    tok = tl.where(top == float("-inf"), 0, tok)
    tl.store(out_ptr + row, tok.to(tl.int64))


@triton.jit
def _hash_kernel(keys_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    a, b = _row_keys_tl(keys_ptr, row)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    bits = _bits_tl(a, b, cols)
    tl.store(out_ptr + row.to(tl.int64) * vocab + cols, bits.to(tl.int64), mask=cols < vocab)


def sample_splits(n: int, vocab: int) -> int:
    """Programs per row: one row per program leaves most SMs idle at small batches, so at
    up to ``_TARGET_PROGRAMS // 4`` rows each row's vocabulary is cut into enough slices (a
    power of two up to 64, at most one per chunk of ``_BLOCK``) to reach
    ``_TARGET_PROGRAMS`` programs. On an H200 at a 128,256-token vocabulary: one row 71 to
    4.3 µs with temperature (15 to 2.9 greedy), 64 rows 72 to 30; at 256 rows two slices
    were slower (121 against 108 µs), hence the floor of four."""
    chunks = triton.cdiv(vocab, _BLOCK)
    want = min(triton.cdiv(_TARGET_PROGRAMS, max(n, 1)), chunks, 64)
    return triton.next_power_of_2(want) if want >= 4 else 1


def sample_triton(
    x: torch.Tensor,
    inv_temp: torch.Tensor,
    thr: torch.Tensor,
    keys: torch.Tensor,
    splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``sample_ref``; rows of x must be contiguous in their last dim.
    ``splits`` (a power of two) overrides ``sample_splits``: each row's vocabulary is cut
    into that many slices, one program each, and a second kernel takes the best. ``out``:
    an (N,) int64 buffer the tokens are written into, else a new tensor."""
    n, vocab = x.shape
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=x.device)
    elif out.shape != (n,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous ({n},) int64 tensor, got {tuple(out.shape)} {out.dtype}"
        )
    if not n:
        return out
    sp = sample_splits(n, vocab) if splits is None else splits
    if sp < 1 or sp & (sp - 1):
        raise ValueError(f"splits must be a power of two >= 1, got {sp}")
    chunks = triton.cdiv(triton.cdiv(vocab, _BLOCK), sp)
    part_val = torch.empty(n, sp, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(n, sp, dtype=torch.int32, device=x.device)
    args = (inv_temp.contiguous(), thr.contiguous(), keys.contiguous(), out, part_val, part_idx)
    _sample_kernel[(n, sp)](
        x, x.stride(0), *args, vocab, BLOCK=_BLOCK, CHUNKS=chunks, SPLITS=sp, num_warps=8
    )
    if sp > 1:
        _sample_reduce_kernel[(n,)](part_val, part_idx, out, vocab, SPLITS=sp, num_warps=1)
    return out


def hash_bits_triton(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The kernel's hash bits, for comparing with ``hash_bits_ref`` in tests."""
    n = keys.shape[0]
    out = torch.empty(n, vocab, dtype=torch.int64, device=keys.device)
    block = 1024
    _hash_kernel[(n, triton.cdiv(vocab, block))](keys.contiguous(), out, vocab, BLOCK=block)
    return out


def sample_tokens(
    x: torch.Tensor,
    inv_temp: torch.Tensor,
    thr: torch.Tensor,
    keys: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The (N,) int64 tokens, into ``out`` (an (N,) int64 buffer) where given."""
    if use_triton(x) and x.stride(-1) == 1:
        return sample_triton(x, inv_temp, thr, keys, out=out)
    tokens = sample_ref(x, inv_temp, thr, keys)
    return tokens if out is None else out.copy_(tokens)
