"""Policy losses, value loss and aggregation: hand-checked values and autograd gradients."""
import math

import pytest
import torch

from mrl.algos import losses

F64 = torch.float64


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


def logp_of(ratios):
    """Leaf log-probs lp = log(r) against lp_old = 0, so that r = exp(lp - lp_old)."""
    return torch.log(t(ratios)).requires_grad_(True)


def grad_of_sum(per_token, leaf):
    (g,) = torch.autograd.grad(per_token.sum(), leaf)
    return g


# ----------------------------------------------------------------------------------------- PPO
# eps_low 0.2, eps_high 0.28 (clip to [0.8, 1.28]), clip_c 3. Per token:
#   t0 A=+1 r=1.5: max(-1.5, -1.28) = -1.28, upper clip active, grad 0
#   t1 A=+1 r=1.1: max(-1.1, -1.1) = -1.1, grad d(-A r)/dlp = -A r = -1.1
#   t2 A=-1 r=0.5: max(0.5, 0.8) = 0.8, lower clip active, grad 0; dual min(0.8, 3) = 0.8
#   t3 A=-1 r=4  : max(4, 1.28) = 4; dual min(4, 3) = 3, dual active, grad 0
#   t4 A=-2 r=2  : max(4, 2.56) = 4; dual min(4, 6) = 4, grad -A r = 4
#   t5 masked (A=5, r=100): 0, grad 0
RATIOS = [[1.5, 1.1, 0.5, 4.0, 2.0, 100.0]]
ADV = [[1.0, 1.0, -1.0, -1.0, -2.0, 5.0]]
MASK = [[1, 1, 1, 1, 1, 0]]


def test_ppo_dual_clip_values_gradients_and_metrics():
    lp = logp_of(RATIOS)
    per_token, m = losses.ppo(lp, torch.zeros_like(lp), t(ADV), t(MASK), 0.2, 0.28, clip_c=3.0)
    torch.testing.assert_close(per_token, t([[-1.28, -1.1, 0.8, 3.0, 4.0, 0.0]]), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(grad_of_sum(per_token, lp), t([[0.0, -1.1, 0.0, 0.0, 4.0, 0.0]]),
                               rtol=1e-14, atol=1e-14)
    # 5 valid tokens: one upper clip, one lower clip, one dual clip
    assert m["clipfrac_upper"].item() == pytest.approx(0.2, rel=1e-7)
    assert m["clipfrac_lower"].item() == pytest.approx(0.2, rel=1e-7)
    assert m["clipfrac"].item() == pytest.approx(0.4, rel=1e-7)
    assert m["clipfrac_dual"].item() == pytest.approx(0.2, rel=1e-7)
    # approx KL = mean(lp_old - lp) = -log(1.5*1.1*0.5*4*2)/5 = -log(6.6)/5
    assert m["approx_kl"].item() == pytest.approx(-math.log(6.6) / 5, rel=1e-14)
    assert not any(v.requires_grad for v in m.values())


def test_ppo_without_dual_clip():
    lp = logp_of(RATIOS)
    per_token, m = losses.ppo(lp, torch.zeros_like(lp), t(ADV), t(MASK), 0.2, 0.28)
    # t3 keeps max(4, 1.28) = 4 with gradient -A r = 4
    torch.testing.assert_close(per_token, t([[-1.28, -1.1, 0.8, 4.0, 4.0, 0.0]]), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(grad_of_sum(per_token, lp), t([[0.0, -1.1, 0.0, 4.0, 4.0, 0.0]]),
                               rtol=1e-14, atol=1e-14)
    assert m["clipfrac_dual"].item() == 0.0


def test_ppo_per_response_advantage_broadcasts_and_weights_multiply():
    lp = logp_of([[1.1, 0.9], [1.0, 1.0]])
    adv_b = t([2.0, -1.0])
    w = t([[0.5, 2.0], [1.0, 3.0]])
    per_token, _ = losses.ppo(lp, torch.zeros_like(lp), adv_b, t([[1, 1], [1, 0]]), 0.2, 0.2, 3.0, weights=w)
    # row 0 A=2: -2*1.1*0.5 = -1.1, -2*0.9*2 = -3.6; row 1 A=-1 r=1: 1*1 = 1, masked 0
    torch.testing.assert_close(per_token, t([[-1.1, -3.6], [1.0, 0.0]]), rtol=1e-14, atol=1e-14)
    # gradient -A r w: [-1.1, -3.6], [1, 0]
    torch.testing.assert_close(grad_of_sum(per_token, lp), t([[-1.1, -3.6], [1.0, 0.0]]), rtol=1e-14, atol=1e-14)


def test_ppo_ratio_log_is_clamped_at_20():
    lp = t([[25.0]]).requires_grad_(True)
    per_token, m = losses.ppo(lp, t([[0.0]]), t([[-1.0]]), t([[1]]), 0.2, 0.2)
    assert per_token.item() == pytest.approx(math.exp(20.0), rel=1e-14)
    assert grad_of_sum(per_token, lp).item() == 0.0  # clamp saturated
    assert m["approx_kl"].item() == -20.0


def test_ppo_rejects_bad_clip_c_and_shapes():
    lp = t([[0.0]])
    with pytest.raises(ValueError, match="clip_c"):
        losses.ppo(lp, lp, t([1.0]), t([[1]]), 0.2, 0.2, clip_c=1.0)
    with pytest.raises(ValueError):
        losses.ppo(lp, lp, t([1.0, 2.0, 3.0]), t([[1]]), 0.2, 0.2)


def test_nan_padding_reaches_neither_loss_nor_gradient():
    nan = float("nan")
    lp = t([[0.1, nan]]).requires_grad_(True)
    old = t([[0.0, nan]])
    adv = t([[1.0, nan]])
    mask = t([[1, 0]])
    for fn in (losses.ppo, losses.gspo, losses.cispo):
        per_token, m = fn(lp, old, adv, mask, 0.2, 0.28)
        g = grad_of_sum(per_token, lp)
        assert torch.isfinite(per_token).all() and torch.isfinite(g).all() and g[0, 1] == 0
        assert all(torch.isfinite(v) for v in m.values())
    per_token, _ = losses.sapo(lp, old, adv, mask)
    assert torch.isfinite(grad_of_sum(per_token, lp)).all()


# ---------------------------------------------------------------------------------------- GSPO
def test_gspo_sequence_ratio_value_and_gradient():
    # row 0 mask [1,1,0], lp - lp_old = [0.2, 0.4, (9 masked)]: log s = 0.3, s = e^0.3 = 1.34986 > 1.28,
    #   A = +1 -> every token clipped: L = -1.28, grad 0
    # row 1 mask [1,1,1], diffs [0.1, -0.1, 0.3]: log s = 0.1, s = e^0.1 = 1.10517 in [0.8, 1.28],
    #   A = -2 -> L = 2 s on every token; d L_t / d lp_t = -A s = 2 s (only through its own lp_t)
    lp = t([[0.2, 0.4, 9.0], [0.1, -0.1, 0.3]]).requires_grad_(True)
    old = torch.zeros(2, 3, dtype=F64)
    mask = t([[1, 1, 0], [1, 1, 1]])
    per_token, m = losses.gspo(lp, old, t([1.0, -2.0]), mask, 0.2, 0.28)
    s1 = math.exp(0.1)
    torch.testing.assert_close(per_token, t([[-1.28, -1.28, 0.0], [2 * s1, 2 * s1, 2 * s1]]), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(grad_of_sum(per_token, lp), t([[0.0, 0.0, 0.0], [2 * s1] * 3]), rtol=1e-14, atol=1e-14)
    assert m["clipfrac_upper"].item() == pytest.approx(2 / 5, rel=1e-7)
    assert m["clipfrac_lower"].item() == 0.0


def test_gspo_aggregated_gradient_is_paper_formula():
    # GSPO: grad J = s_i A_i * mean_t grad lp_t; with seq-mean-token-mean over 2 sequences,
    # d loss / d lp_it = -A_i s_i / |y_i| / 2. Row 0: s = e^0.1 (diffs 0.3,-0.1), A = 1, |y| = 2;
    # row 1: s = e^-0.1 (diffs -0.2, 0.1, -0.2), A = 0.5, |y| = 3.
    lp = t([[0.3, -0.1, 0.0], [-0.2, 0.1, -0.2]]).requires_grad_(True)
    mask = t([[1, 1, 0], [1, 1, 1]])
    per_token, _ = losses.gspo(lp, torch.zeros_like(lp), t([1.0, 0.5]), mask, 0.2, 0.28)
    loss = losses.aggregate(per_token, mask, "seq-mean-token-mean")
    (g,) = torch.autograd.grad(loss, lp)
    g0 = -1.0 * math.exp(0.1) / 2 / 2
    g1 = -0.5 * math.exp(-0.1) / 3 / 2
    torch.testing.assert_close(g, t([[g0, g0, 0.0], [g1, g1, g1]]), rtol=1e-14, atol=1e-14)


def test_gspo_log_ratio_clamped_at_10():
    lp = t([[11.0]]).requires_grad_(True)
    per_token, _ = losses.gspo(lp, t([[0.0]]), t([-1.0]), t([[1]]), 0.2, 0.2)
    assert per_token.item() == pytest.approx(math.exp(10.0), rel=1e-14)
    assert grad_of_sum(per_token, lp).item() == 0.0


# --------------------------------------------------------------------------------------- CISPO
def test_cispo_value_and_stop_gradient_on_clipped_ratio():
    # r = [2, 1, 0.5] (lp = log r, lp_old = 0), clip to [0.8, 1.28] -> weights [1.28, 1, 0.8]
    # A = [1, -1, 2]. L = -sg(w) A lp = [-1.28 log 2, 0, -0.8*2*log 0.5 = 1.6 log 2]
    # grad = -w A = [-1.28, 1, -1.6]: the clipped tokens keep a gradient (unlike PPO)
    lp = logp_of([[2.0, 1.0, 0.5]])
    per_token, m = losses.cispo(lp, torch.zeros_like(lp), t([[1.0, -1.0, 2.0]]), t([[1, 1, 1]]), 0.2, 0.28)
    ln2 = math.log(2.0)
    torch.testing.assert_close(per_token, t([[-1.28 * ln2, 0.0, 1.6 * ln2]]), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(grad_of_sum(per_token, lp), t([[-1.28, 1.0, -1.6]]), rtol=1e-14, atol=1e-14)
    assert m["clipfrac_upper"].item() == pytest.approx(1 / 3, rel=1e-7)
    assert m["clipfrac_lower"].item() == pytest.approx(1 / 3, rel=1e-7)


def test_cispo_without_lower_bound():
    # canonical MiniMax-M1 form: no lower clip, so r = 0.5 keeps weight 0.5: grad -0.5*2 = -1
    lp = logp_of([[2.0, 0.5]])
    per_token, m = losses.cispo(lp, torch.zeros_like(lp), t([[1.0, 2.0]]), t([[1, 1]]), None, 4.0)
    torch.testing.assert_close(grad_of_sum(per_token, lp), t([[-2.0, -1.0]]), rtol=1e-14, atol=1e-14)
    assert m["clipfrac"].item() == 0.0


# ---------------------------------------------------------------------------------------- SAPO
def test_sapo_values_and_gradients():
    # gate f(r) = sigmoid(tau (r-1)) * 4/tau; L = -f(r) A; dL/dlp = -A 4 g (1-g) r  (g = sigmoid(.))
    # t0 r=1 A=+1 tau=1   : L = -2,          grad = -1*4*0.25*1 = -1 (plain policy gradient)
    # t1 r=1 A=-1 tau=1.05: L = 2/1.05,      grad = +1
    # t2 r=2 A=+1 tau=1   : g = sigmoid(1);  L = -4 g; grad = -4 g (1-g) * 2
    # t3 A=0 (tau_neg)    : L = 0, grad 0
    lp = logp_of([[1.0, 1.0, 2.0, 3.0]])
    per_token, m = losses.sapo(lp, torch.zeros_like(lp), t([[1.0, -1.0, 1.0, 0.0]]), t([[1, 1, 1, 1]]))
    g = 1 / (1 + math.exp(-1.0))
    torch.testing.assert_close(per_token, t([[-2.0, 2 / 1.05, -4 * g, 0.0]]), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(grad_of_sum(per_token, lp), t([[-1.0, 1.0, -8 * g * (1 - g), 0.0]]),
                               rtol=1e-14, atol=1e-14)
    # gate_mean: [2/1, 2/1.05, 4 g, sigmoid(1.05*(3-1))*4/1.05 (A = 0 takes tau_neg)] / 4
    gates = [2.0, 2 / 1.05, 4 * g, 4 / 1.05 / (1 + math.exp(-2.1))]
    assert m["gate_mean"].item() == pytest.approx(sum(gates) / 4, rel=1e-14)
    assert m["approx_kl"].item() == pytest.approx(-math.log(6.0) / 4, rel=1e-14)


# --------------------------------------------------------------------------------- aggregation
NAN = float("nan")
PER_TOKEN = [[1.0, 2.0, 3.0, NAN], [4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]]
AGG_MASK = [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]  # row 2 fully masked


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", (6 + 4) / 4),                   # 4 valid tokens
    ("seq-mean-token-sum", (6 + 4) / 2),           # 2 non-empty sequences
    ("seq-mean-token-mean", (6 / 3 + 4 / 1) / 2),
    ("seq-mean-token-sum-norm", (6 + 4) / 2 / 4),  # norm defaults to T = 4
])
def test_aggregate_modes(mode, expected):
    assert losses.aggregate(t(PER_TOKEN), t(AGG_MASK), mode).item() == pytest.approx(expected, rel=1e-15)


def test_aggregate_norm_and_global_counts():
    pt, mask = t(PER_TOKEN), t(AGG_MASK)
    assert losses.aggregate(pt, mask, "seq-mean-token-sum-norm", norm=5).item() == pytest.approx(10 / 2 / 5)
    assert losses.aggregate(pt, mask, "token-mean", global_tokens=8).item() == pytest.approx(10 / 8)
    # dp_size multiplies to cancel DP gradient averaging
    assert losses.aggregate(pt, mask, "token-mean", global_tokens=8, dp_size=2).item() == pytest.approx(2.5)
    assert losses.aggregate(pt, mask, "seq-mean-token-mean", global_sequences=torch.tensor(4), dp_size=2
                            ).item() == pytest.approx((2 + 4) / 4 * 2)
    with pytest.raises(ValueError, match="global_tokens"):
        losses.aggregate(pt, mask, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_sequences"):
        losses.aggregate(pt, mask, "seq-mean-token-sum", global_tokens=8, dp_size=2)
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        losses.aggregate(pt, mask, "mean")


@pytest.mark.parametrize("mode", losses.AGG_MODES)
def test_aggregate_empty_and_fully_masked_give_zero_without_nan(mode):
    x = torch.randn(2, 3, dtype=F64, requires_grad=True)
    loss = losses.aggregate(x, torch.zeros(2, 3), mode)
    (g,) = torch.autograd.grad(loss, x)
    assert loss.item() == 0.0 and (g == 0).all()
    assert losses.aggregate(torch.zeros(0, 5), torch.zeros(0, 5), mode).item() == 0.0
    assert losses.aggregate(torch.zeros(3, 0), torch.zeros(3, 0), mode).item() == 0.0
    assert losses.aggregate(torch.zeros(0, 5), torch.zeros(0, 5), mode, global_tokens=0, global_sequences=0,
                            dp_size=4).item() == 0.0


def test_empty_policy_loss_metrics_are_zero():
    e = torch.zeros(0, 4, dtype=F64)
    per_token, m = losses.ppo(e, e, torch.zeros(0, dtype=F64), e, 0.2, 0.2, 3.0)
    assert per_token.shape == (0, 4) and all(v.item() == 0.0 for v in m.values())


# ---------------------------------------------------------------------------------- value loss
def test_value_loss_clipped():
    # eps 0.2.
    # t0 v=1.0 v_old=0.5 R=2: clip(v) = 0.7; (1-2)^2 = 1 < (0.7-2)^2 = 1.69 -> 1.69, clipped, grad 0
    # t1 v=0.6 v_old=0.5 R=0: clip(v) = 0.6; both 0.36 (not counted as clipped), grad 2(v-R) = 1.2
    # t2 v=0.0 v_old=0.5 R=1: clip(v) = 0.3; 1 > 0.49 -> 1, grad 2(v-R) = -2
    # t3 masked. token-mean: 0.5*(1.69+0.36+1)/3 = 0.508333..., grad 0.5*[0,1.2,-2]/3
    v = t([[1.0, 0.6, 0.0, 7.0]]).requires_grad_(True)
    loss, m = losses.value(v, t([[0.5, 0.5, 0.5, 0.0]]), t([[2.0, 0.0, 1.0, 0.0]]), t([[1, 1, 1, 0]]), 0.2,
                           "token-mean")
    assert loss.item() == pytest.approx(0.5 * 3.05 / 3, rel=1e-14)
    (g,) = torch.autograd.grad(loss, v)
    torch.testing.assert_close(g, t([[0.0, 0.2, -1 / 3, 0.0]]), rtol=1e-14, atol=1e-14)
    assert m["vf_clipfrac"].item() == pytest.approx(1 / 3, rel=1e-7)
    # no clip: 0.5*(1 + 0.36 + 1)/3
    loss2, m2 = losses.value(v, t([[0.5, 0.5, 0.5, 0.0]]), t([[2.0, 0.0, 1.0, 0.0]]), t([[1, 1, 1, 0]]), None,
                             "token-mean")
    assert loss2.item() == pytest.approx(0.5 * 2.36 / 3, rel=1e-14) and m2["vf_clipfrac"].item() == 0.0


def test_float32_bool_mask_inputs_keep_dtype():
    lp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    for fn in (losses.ppo, losses.gspo, losses.cispo):
        pt, m = fn(lp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask, 0.2, 0.28)
        assert pt.dtype == torch.float32 and m["approx_kl"].dtype == torch.float32
        loss = losses.aggregate(pt, mask, "token-mean")
        (g,) = torch.autograd.grad(loss, lp)
        # r = 1 (on-policy): every loss has the policy gradient -A grad lp, over 3 valid tokens
        torch.testing.assert_close(g, torch.tensor([[-1 / 3, -1 / 3, 0.0], [1 / 3, 0.0, 0.0]]))
