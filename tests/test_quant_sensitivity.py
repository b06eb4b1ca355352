"""The quality gate's per-projection cost estimate (kiln/quant/sensitivity.py): the Fisher
term from a backward pass through the unquantized model, against autograd by hand, and the
estimate's arithmetic. (Whether it ranks real projections well is measured on SmolLM2:
docs/quantization.md; on a random model the loss is not near a minimum, where a
second-order estimate would predict it.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln import LLM
from kiln.kernels import _triton
from kiln.quant.sensitivity import output_grad_sq, sensitivity
from kiln.quant.stats import decoder_linears, make_kv_cache, single_sequence_metadata


def _model() -> torch.nn.Module:
    return LLM("dummy:tiny", device="cpu", progress=False).engine.model


def _windows() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 200, (n,), generator=g).tolist() for n in (23, 9)]


def _summed_loss(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    kv = make_kv_cache(model, len(ids))
    meta = single_sequence_metadata(len(ids), kv.tokens_per_block, torch.device("cpu"))
    t = torch.tensor(ids)
    hidden = model(t, torch.arange(len(ids)), kv.layers, meta)
    return F.cross_entropy(model.compute_logits(hidden[:-1]).float(), t[1:], reduction="sum")


def test_output_grad_sq_matches_autograd_by_hand() -> None:
    model = _model()
    lin = decoder_linears(model)
    names = ["layers.0.attn.qkv", "layers.1.mlp.down"]
    got, tokens = output_grad_sq(model, _windows(), {n: lin[n] for n in names})
    assert tokens == 22 + 8
    assert all(p.grad is None for p in model.parameters())  # nothing kept on the model
    assert not _triton._reference_only  # the reference-only switch is restored
    want = {n: torch.zeros(lin[n].out_features) for n in names}
    outs: dict[str, torch.Tensor] = {}
    hooks = [lin[n].register_forward_hook(lambda m, a, o, n=n: outs.__setitem__(n, o))
             for n in names]  # fmt: skip
    try:
        for w in _windows():
            with torch.enable_grad():
                for p in model.parameters():
                    p.requires_grad_(True)
                loss = _summed_loss(model, w)
                gs = torch.autograd.grad(loss, [outs[n] for n in names])
            for n, g in zip(names, gs, strict=True):
                want[n] += g.pow(2).sum(0)
    finally:
        for h in hooks:
            h.remove()
    for n in names:
        torch.testing.assert_close(got[n], want[n] / tokens, rtol=1e-4, atol=1e-12)


def test_sensitivity_is_half_the_fisher_weighted_mean_square() -> None:
    fisher = torch.tensor([4.0, 0.0, 1.0])
    dy = torch.tensor([[1.0, 5.0, 2.0], [3.0, -5.0, 0.0]])  # mean squares 5, 25, 2
    assert sensitivity(fisher, dy) == 0.5 * (4 * 5 + 0 * 25 + 1 * 2)
