"""saes.adam.Adam: torch.optim.Adam(fused=True)'s update without torch.optim; bit-identical, same state layout."""

import copy

import pytest
import torch

from conceptdict.saes.adam import Adam

pytestmark = pytest.mark.unit


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(12, 7, generator=g)
    return [torch.randn(7, 12, generator=g).requires_grad_(), w.t().contiguous().t().requires_grad_(),
            torch.randn(5, generator=g).requires_grad_(), torch.randn(3, generator=g).requires_grad_()]


def _grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        # the last parameter gets no gradient on odd steps: both optimizers must leave it (and its state) alone
        p.grad = None if (i == 3 and step % 2) else torch.randn(p.shape, generator=g)


def _run(make, steps: int = 6):
    params = _params()
    opt = make(params)
    for s in range(steps):
        opt.param_groups[0]["lr"] = 1e-2 * (s + 1)  # the loop changes lr between steps
        _grads(params, s)
        opt.step()
    return params, opt


def test_bit_identical_to_torch_fused_adam():
    ours, ours_opt = _run(lambda p: Adam(p, lr=1e-2, betas=(0.9, 0.999)))
    ref, ref_opt = _run(lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.9, 0.999), fused=True))
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    ours_sd, ref_sd = ours_opt.state_dict(), ref_opt.state_dict()
    assert ours_sd["state"].keys() == ref_sd["state"].keys()
    for i in ref_sd["state"]:
        for key, value in ref_sd["state"][i].items():
            assert torch.equal(ours_sd["state"][i][key], value), (i, key)
            assert ours_sd["state"][i][key].dtype == value.dtype
    assert ours_sd["param_groups"] == ref_sd["param_groups"]


@pytest.mark.parametrize("direction", ["torch->ours", "ours->torch"])
def test_state_dicts_load_across(direction):
    """A checkpoint written by one resumes in the other and continues identically (old checkpoints hold torch's)."""
    make_ours = lambda p: Adam(p, lr=1e-2)  # noqa: E731
    make_torch = lambda p: torch.optim.Adam(p, lr=1e-2, fused=True)  # noqa: E731
    first, second = (make_torch, make_ours) if direction == "torch->ours" else (make_ours, make_torch)
    params, opt = _run(first, steps=3)
    saved = opt.state_dict()
    resumed = [p.detach().clone().requires_grad_() for p in params]
    opt2 = second(resumed)
    opt2.load_state_dict(copy.deepcopy(saved))  # torch.optim keeps the loaded tensors: as after torch.load
    cont = [p.detach().clone().requires_grad_() for p in params]
    opt3 = first(cont)
    opt3.load_state_dict(copy.deepcopy(saved))
    for s in range(3, 6):
        for ps, o in ((resumed, opt2), (cont, opt3)):
            o.param_groups[0]["lr"] = 1e-2 * (s + 1)
            _grads(ps, s)
            o.step()
    for a, b in zip(resumed, cont):
        assert torch.equal(a, b)


def test_zero_grad():
    params = _params()
    opt = Adam(params, lr=1e-2)
    _grads(params, 0)
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def test_load_of_another_model_names_the_mismatch():
    params, opt = _run(lambda p: Adam(p, lr=1e-2), steps=1)
    with pytest.raises(ValueError, match="sizes \\[4\\].*one group of 3 parameters"):
        Adam(params[:3], lr=1e-2).load_state_dict(opt.state_dict())
    other = [torch.zeros(2, 2, requires_grad=True), *params[1:]]
    with pytest.raises(ValueError, match=r"parameter 0 has shape \(7, 12\), the parameter \(2, 2\)"):
        Adam(other, lr=1e-2).load_state_dict(opt.state_dict())
