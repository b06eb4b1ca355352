"""Shared by the decode attention tests (``test_triton_kernels.py``): a decode step over a
random paged cache, and a spy that records the kernels a launcher launches."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from kiln.kernels.attention import AttentionMetadata

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def decode_batch(ctx: list[int], bs: int, hk: int, hq: int, d: int, dtype: torch.dtype,
                 spare: int = 1) -> tuple:  # fmt: skip
    """One decode token per sequence of context ``ctx``, over a random paged cache with
    scattered blocks (``spare`` more than needed): q, cache, block tables, lengths and the
    reference's metadata."""
    nblocks = sum(-(-c // bs) for c in ctx) + spare
    cache = torch.randn(2, nblocks, bs, hk, d, device=DEV, dtype=dtype)
    perm = torch.randperm(nblocks).tolist()
    tables = [[perm.pop() for _ in range(-(-c // bs))] for c in ctx]
    width = max(map(len, tables))
    n = len(ctx)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEV)
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=DEV),
        seq_lens=lens,
        block_tables=bt,
        slot_mapping=torch.zeros(n, dtype=torch.long, device=DEV),
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=ctx,
    )
    q = torch.randn(n, hq, d, device=DEV, dtype=dtype)
    return q, cache, bt, lens, meta


def spy_launches(monkeypatch: Any, module: ModuleType, kernels: dict[str, str], key: str,
                 check: Callable[[dict], None] | None = None) -> list[tuple[str, Any]]:  # fmt: skip
    """Replace ``module``'s kernels (label -> attribute) with spies that record each launch
    as (label, the launch's ``key`` argument), run ``check`` on its keyword arguments, and
    launch the real kernel; returns the record."""
    launched: list[tuple[str, Any]] = []

    class Spy:
        def __init__(self, label: str, real: Any) -> None:
            self.label, self.real = label, real

        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            def launch(*a: Any, **k: Any) -> Any:
                launched.append((self.label, k.get(key)))
                if check is not None:
                    check(k)
                return self.real[grid](*a, **k)

            return launch

    for label, attr in kernels.items():
        monkeypatch.setattr(module, attr, Spy(label, getattr(module, attr)))
    return launched
