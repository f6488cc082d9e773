import pytest
import torch

from soma_cluster.config import ModelConfig
from soma_cluster.model import (
    Layout,
    body_forward,
    campaign_param_count,
    copy_losses,
    decoder_gradient,
    init_body,
    init_head,
    lstm,
    target_logprobs,
)


@pytest.mark.parametrize(
    "n,d,head,expected",
    [
        (8, 32, "shared_frozen", 271_616),
        (4, 32, "shared_frozen", 139_904),
        (256, 32, "shared_frozen", 8_437_760),
        (2, 361, "own", 8_406_746),
        (1, 509, "own", 8_333_905),
        (8, 181, "own", 8_552_264),
    ],
)
def test_parameter_counts_match_spec(n, d, head, expected):
    assert campaign_param_count(ModelConfig(d=d, head=head), n) == expected


def test_body_count_formula():
    for d in (8, 32, 64):
        assert Layout(ModelConfig(d=d, embed_dim=d)).size == 32 * d * d + 5 * d


def test_lstm_matches_torch_lstm():
    torch.manual_seed(0)
    t, p, b, d = 7, 3, 2, 8
    x = torch.randn(p, t, b, d)
    w_ih, w_hh = torch.randn(p, 4 * d, d) * 0.4, torch.randn(p, 4 * d, d) * 0.4
    out = lstm(x, w_ih, w_hh)
    assert torch.equal(out, lstm(x, w_ih, w_hh))
    for c in range(p):
        ref = torch.nn.LSTM(d, d, bias=False)
        with torch.no_grad():
            ref.weight_ih_l0.copy_(w_ih[c])
            ref.weight_hh_l0.copy_(w_hh[c])
            expect, _ = ref(x[c])
        torch.testing.assert_close(out[c], expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("d", [32, 48])
def test_batched_copies_equal_separate_forwards(d):
    cfg = ModelConfig(d=d, head="own" if d != 32 else "shared_frozen")
    g = torch.Generator().manual_seed(1)
    head = init_head(cfg, g)
    bodies = torch.stack([init_body(cfg, g) for _ in range(3)])
    x = torch.randint(0, 256, (2, 17), generator=g)
    y = torch.randint(0, 256, (2, 17), generator=g)
    together = copy_losses(cfg, bodies, head, x, y)
    apart = torch.cat([copy_losses(cfg, bodies[i : i + 1], head, x, y) for i in range(3)])
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-6)
    assert together.shape == (3,)


def test_decoder_rule_equals_autograd_with_body_detached():
    cfg = ModelConfig()
    g = torch.Generator().manual_seed(2)
    body, head = init_body(cfg, g), init_head(cfg, g) * 50
    x = torch.randint(0, 256, (3, 11), generator=g)
    y = torch.randint(0, 256, (3, 11), generator=g)
    h = body_forward(cfg, body[None], head, x).detach()
    e = head.clone().requires_grad_(True)
    loss = -target_logprobs(h, e, y).mean()
    loss.backward()
    torch.testing.assert_close(decoder_gradient(h, head, y), e.grad, rtol=1e-5, atol=1e-7)


def test_initial_loss_is_near_uniform():
    cfg = ModelConfig()
    g = torch.Generator().manual_seed(3)
    loss = copy_losses(
        cfg, init_body(cfg, g)[None], init_head(cfg, g), torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, 9))
    )
    assert abs(float(loss) - 5.545) < 0.05
