"""rejection_sample (speculative decoding's accept/reject step): the Triton kernel against
the torch reference on random distributions, and the reference's defining property: the
token it yields at the first position is distributed as the target's p, whatever the
draft's q (a chi-square test over many keyed draws)."""

import pytest
import torch

from kernels.gumbel_noise import gumbel_noise
from kernels.rejection_sample import rejection_sample_reference
from shared.engine.sampler import draw_key
from shared.engine.speculative.rejection import accept_key, draft_key, uniform

TARGET = "kernels.rejection_sample:rejection_sample"


def _inputs(B, K, V, seed, device="cpu", sharp=1.0):
    g = torch.Generator().manual_seed(seed)
    tl = (torch.randn(B, K + 1, V, generator=g) * 2).log_softmax(-1)
    # drafts that resemble the target (some accepted) with their own noise
    ql = (tl[:, :K] * sharp + torch.randn(B, K, V, generator=g)).log_softmax(-1)
    q = ql.exp()
    keys = torch.randint(0, 2**32, (B, K + 1), generator=g, dtype=torch.int64)
    dkeys = torch.randint(0, 2**32, (B, K), generator=g, dtype=torch.int64)
    dt = (ql + gumbel_noise(dkeys.reshape(-1), V).reshape(B, K, V)).argmax(-1)
    n = torch.randint(0, K + 1, (B,), generator=g)
    u = uniform(torch.randint(0, 2**32, (B, K), generator=g, dtype=torch.int64))
    return [t.to(device) for t in (tl, q, dt, n, u, keys)]


@pytest.mark.parametrize("B,K,V", [(6, 4, 300), (3, 1, 2500), (8, 7, 64)])
def test_kernel_matches_reference(runner, B, K, V):
    args = _inputs(B, K, V, seed=B * 100 + K)
    acc, fin = runner(TARGET, *[a.to(runner.device) for a in args])
    racc, rfin = rejection_sample_reference(*args)
    assert acc.cpu().tolist() == racc.tolist()
    assert fin.cpu().tolist() == rfin.tolist()


def test_reference_keeps_the_target_distribution():
    """One draft token from q, then accept/reject: the first token follows p exactly."""
    V, N = 6, 8000
    p = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.07, 0.03])
    q = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.1, 0.05])  # far from p
    counts = torch.zeros(V)
    seeds = torch.arange(N)
    dkeys = torch.tensor([draft_key(int(s), 7) for s in seeds])
    drafts = (q.log()[None] + gumbel_noise(dkeys, V)).argmax(-1)
    u = uniform(torch.tensor([accept_key(int(s), 7) for s in seeds]))
    keys = torch.tensor([[draw_key(int(s), 7), draw_key(int(s), 8)] for s in seeds])
    tl = torch.stack([p.log(), p.log()])[None].expand(N, 2, V)
    acc, fin = rejection_sample_reference(tl, q[None, None].expand(N, 1, V), drafts[:, None],
                                          torch.ones(N, dtype=torch.int64), u[:, None], keys)
    first = torch.where(acc == 1, drafts, fin)
    counts = torch.bincount(first, minlength=V).double()
    expected = p.double() * N
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (chi2, counts.tolist())  # 5 degrees of freedom: p = 0.001
    # and the acceptance rate is sum(min(p, q))
    assert abs(float(acc.double().mean()) - float(torch.minimum(p, q).sum())) < 0.025
