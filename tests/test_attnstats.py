"""ops.attnstats against brute-force full-matrix references and the worked numbers of BACKGROUND.md section 4."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit.ops.attnstats as A
from attnkit.ops.logit_cap import softcap

TOL = dict(rtol=1e-5, atol=1e-5)


def _run(q, k, mask=None, *, scaling, cap=None, sinks=None, blocks=None, monkeypatch=None):
    if blocks is not None:
        monkeypatch.setattr(A, "BLOCK_ELEMENTS", blocks[0])
        monkeypatch.setattr(A, "KEY_BLOCK", blocks[1])
    st = A.LayerStats(q.shape[1], k.shape[1])
    A.accumulate_attention(st, q, k, mask, scaling=scaling, cap=cap, sinks=sinks)
    return st


def _brute(q, k, visible, scaling, cap=None, sinks=None):
    """Full [B, H, Tq, Tk] fp64 scores; visible bool broadcastable to them."""
    groups = q.shape[1] // k.shape[1]
    raw = (q.double() @ k.double().repeat_interleave(groups, 1).transpose(-1, -2)) * scaling
    s = cap * torch.tanh(raw / cap) if cap else raw
    vis = visible.expand(s.shape)
    sm = torch.where(vis, s, -math.inf)
    if sinks is not None:
        sink = sinks.double().view(1, -1, 1, 1).expand(*s.shape[:3], 1)
        full = torch.cat([sm, sink], -1)
        logz, p = torch.logsumexp(full, -1), torch.softmax(full, -1)
        ent = -(torch.where(p > 0, p * p.log(), 0)).sum(-1)
        pmax = p[..., :-1].amax(-1)
    else:
        logz, p = torch.logsumexp(sm, -1), torch.softmax(sm, -1)
        ent, pmax = -(torch.where(p > 0, p * p.log(), 0)).sum(-1), p.amax(-1)
    heads = [s[:, h][vis[:, h]] for h in range(s.shape[1])]
    return {
        "max": torch.stack([x.max() for x in heads]),
        "min": torch.stack([x.min() for x in heads]),
        "mean": torch.stack([x.mean() for x in heads]),
        "std": torch.stack([x.std(unbiased=False) for x in heads]),
        "precap": torch.stack([raw[:, h][vis[:, h]].max() for h in range(s.shape[1])]),
        "logz_mean": logz.mean((0, 2)),
        "logz_max": logz.amax((0, 2)),
        "logz_min": logz.amin((0, 2)),
        "logz_std": logz.std((0, 2), unbiased=False),
        "entropy": ent.mean((0, 2)),
        "max_prob": pmax.mean((0, 2)),
    }


def _check(st, ref):
    got = {
        "max": st.logits.max,
        "min": st.logits.min,
        "mean": st.logits.mean,
        "std": st.logits.std,
        "precap": st.precap_max,
        "logz_mean": st.logz.mean,
        "logz_max": st.logz.max,
        "logz_min": st.logz.min,
        "logz_std": st.logz.std,
        "entropy": st.entropy.mean,
        "max_prob": st.max_prob.mean,
    }
    for key, value in got.items():
        torch.testing.assert_close(value, ref[key], **TOL, msg=key)


@pytest.mark.parametrize("blocks", [None, (64, 7)])
@pytest.mark.parametrize("cap", [None, 5.0])
def test_causal_gqa_matches_full_matrix(blocks, cap, monkeypatch):
    torch.manual_seed(0)
    q, k = torch.randn(2, 8, 37, 8) * 3, torch.randn(2, 2, 37, 8) * 3
    st = _run(q, k, scaling=8**-0.5, cap=cap, blocks=blocks, monkeypatch=monkeypatch)
    _check(st, _brute(q, k, torch.ones(37, 37).tril().bool(), 8**-0.5, cap))
    assert st.logits.n.tolist() == [2 * 37 * 38 / 2] * 8


def test_logits_hundreds_apart_match_full_matrix(monkeypatch):
    """Scores far below the row max (exp underflows; the pass clamps exp inputs at EXP_FLOOR) stay exact."""
    torch.manual_seed(4)
    q, k = torch.randn(1, 4, 40, 8) * 20, torch.randn(1, 2, 40, 8) * 10
    st = _run(q, k, scaling=8**-0.5, blocks=(96, 8), monkeypatch=monkeypatch)
    ref = _brute(q, k, torch.ones(40, 40).tril().bool(), 8**-0.5)
    assert (ref["max"] - ref["min"]).min() > 4 * -A.EXP_FLOOR  # the case is real: spreads of hundreds
    _check(st, ref)


def test_sliding_window_and_padding_mask(monkeypatch):
    torch.manual_seed(1)
    q, k = torch.randn(2, 4, 30, 8) * 2, torch.randn(2, 4, 30, 8) * 2
    i = torch.arange(30)
    visible = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 6)  # window 6
    visible = visible[None, None].repeat(2, 1, 1, 1)
    visible[1, :, :, :3] = False  # left padding in row 1
    st = _run(q, k, visible, scaling=0.3, blocks=(40, 4), monkeypatch=monkeypatch)
    rows = visible.any(-1, keepdim=True)  # queries 0..2 of row 1 see nothing
    ref = _brute(q[:, :, :], k, visible, 0.3)
    # rows that see nothing are left out: compare on the visible rows only
    vis_rows = rows.expand(2, 4, 30, 1)[..., 0]
    logz = torch.logsumexp(torch.where(visible, (q.double() @ k.double().transpose(-1, -2)) * 0.3, -math.inf), -1)
    torch.testing.assert_close(st.logz.mean, torch.stack([logz[:, h][vis_rows[:, h]].mean() for h in range(4)]), **TOL)
    assert st.logz.n.tolist() == [2 * 30 - 3] * 4
    torch.testing.assert_close(st.logits.max, ref["max"], **TOL)
    torch.testing.assert_close(st.logits.mean, ref["mean"], **TOL)
    float_mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)
    st2 = _run(q, k, float_mask, scaling=0.3)
    torch.testing.assert_close(st2.logz.mean, st.logz.mean, **TOL)


def test_sinks_join_the_softmax():
    torch.manual_seed(2)
    q, k = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    st = _run(q, k, scaling=8**-0.5, sinks=sinks)
    _check(st, _brute(q, k, torch.ones(12, 12).tril().bool(), 8**-0.5, sinks=sinks))


def test_background_worked_numbers():
    assert A.z_loss(torch.tensor([10.0, 5.0, 0.0])).item() == pytest.approx(0.010014, rel=1e-4)
    assert A.z_loss(torch.tensor([2.0, 1.0, 0.0])).item() == pytest.approx(0.0005798, rel=1e-3)
    assert torch.logsumexp(torch.tensor([10.0, 5.0, 0.0]), 0).item() == pytest.approx(10.007, abs=1e-3)
    assert torch.tensor([10.0, 5.0, 0.0]).exp().sum().item() == pytest.approx(22175.88, rel=1e-6)
    capped = softcap(torch.tensor([100.0, 50.0, 10.0, 0.0, -10.0, -100.0]), 30.0)
    torch.testing.assert_close(capped, torch.tensor([29.92, 27.93, 9.645, 0.0, -9.645, -29.92]), atol=5e-3, rtol=0)


def test_single_logit_750_and_layernormed_2():
    q = torch.tensor([10.0, 20, 30, 40]).view(1, 1, 1, 4)
    k = torch.tensor([5.0, 10, 15, 20]).view(1, 1, 1, 4)
    st = _run(q, k, scaling=4**-0.5)
    assert st.logits.max.item() == 750.0 and st.logz.max.item() == 750.0
    assert st.above.item() == 1 and st.entropy.mean.item() == 0.0 and st.max_prob.mean.item() == 1.0
    ln = torch.nn.functional.layer_norm
    st = _run(ln(q, (4,)), ln(k, (4,)), scaling=4**-0.5)
    assert st.logits.max.item() == pytest.approx(2.0, rel=1e-5)


def test_moments_merge_equals_one_pass():
    torch.manual_seed(3)
    x = torch.randn(3, 5, 100) * 10 + 1000
    m = A.Moments(5)
    for part in x.split([7, 50, 43], dim=2):
        m.add(part)
    flat = x.double().transpose(0, 1).reshape(5, -1)
    torch.testing.assert_close(m.mean, flat.mean(1), rtol=1e-9, atol=0)
    torch.testing.assert_close(m.std, flat.std(1, unbiased=False), rtol=1e-6, atol=0)
    assert m.min.tolist() == flat.amin(1).tolist() and m.max.tolist() == flat.amax(1).tolist()
