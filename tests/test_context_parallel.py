"""Context parallelism's pieces on one process: the zigzag split, the attention of one rank's queries
over the whole row, and a micro-batch's per-rank view (the collectives run in test_trainer_parallel)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from stages.trainer.context_parallel import attend_local_queries, local_positions, local_view
from stages.trainer.packing import pack, to_token_batch
from stages.trainer.testing import make_batch


def test_zigzag_gives_each_rank_an_early_and_a_late_chunk():
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([local_positions(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="2\\*cp = 4"):
        local_positions(10, 2, 0)


def _reference(q, k, v, cu, scale):
    """Causal attention of the whole row, each sequence alone."""
    out = torch.empty_like(q)
    b = cu.tolist()
    for a, e in zip(b[:-1], b[1:]):
        qs, ks, vs = (x[a:e].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(2, 0), vs.repeat_interleave(2, 0)
        out[a:e] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_local_queries_attend_as_in_the_whole_row(cp):
    """Every rank's output rows (sequences cut across chunk borders, GQA 4:2) equal the whole row's."""
    g = torch.Generator().manual_seed(0)
    s = 48
    cu = torch.tensor([0, 5, 19, 20, 41, 48], dtype=torch.int32)
    q = torch.randn(s, 4, 8, generator=g)
    k, v = torch.randn(s, 2, 8, generator=g), torch.randn(s, 2, 8, generator=g)
    ref = _reference(q, k, v, cu, 0.3)
    for r in range(cp):
        mine = local_positions(s, cp, r)
        out = attend_local_queries(q[mine], k, v, cu, mine, 0.3)
        torch.testing.assert_close(out, ref[mine], rtol=1e-5, atol=1e-5)


def test_local_view_keeps_each_response_token_on_exactly_one_rank():
    tb = to_token_batch(make_batch(2, 3, seed=3))
    (mb,) = pack(tb, list(range(tb.n)), 512, packed_row=True, align=16)
    s = mb.tokens.shape[1]
    seen = []
    for r in range(2):
        part = local_view(mb, 2, r)
        mine = local_positions(s, 2, r)
        assert torch.equal(part.tokens, mb.tokens[:, mine])
        # each kept response token predicts from a local position whose target is that token
        flat_targets = part.targets.reshape(-1)[part.resp_pos]
        whole = dict(zip(mb.tok_index.tolist(), mb.targets.reshape(-1)[mb.resp_pos].tolist()))
        assert flat_targets.tolist() == [whole[i] for i in part.tok_index.tolist()]
        seen += part.tok_index.tolist()
    assert sorted(seen) == sorted(mb.tok_index.tolist())
    assert len(np.unique(seen)) == len(seen)
