"""A training step compiled on a CUDA model: fused (Triton kernels) and unfused against
the same model in eager PyTorch. Skipped where no GPU is present."""

import copy

import pytest
import torch

import autopar
from autopar.examples import gpt2

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("fusion", [False, True])
def test_a_cuda_step_matches_eager_pytorch(fusion):
    """The causal mask is recovered from a mask built on the GPU, and the compiled step's
    losses and weights follow eager PyTorch's for several SGD-with-momentum steps."""
    torch.manual_seed(0)
    ex = gpt2(layers=2, hidden=64, heads=4, vocab=256, batch=4, seq=32)
    batch = tuple(x.cuda() for x in ex.batch)

    def sgd(params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    model = copy.deepcopy(ex.model).cuda()
    step = autopar.compile(model, None, batch, ex.loss_fn, optimizer=sgd,
                           layout=autopar.Layout(fusion=fusion))
    ref = copy.deepcopy(ex.model).cuda()
    opt = sgd(list(ref.parameters()))
    for _ in range(4):
        loss = step(*batch)
        expected = ex.loss_fn(ref(*batch), *batch)
        opt.zero_grad()
        expected.backward()
        opt.step()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4, msg=name)
