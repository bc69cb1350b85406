"""Shared test settings: one thread per process (the machine has 2 cores), and Triton
kernels in Triton's interpreter (there is no GPU here). The interpreter must be chosen
before triton is first imported (collecting tests/dist imports autopar, which pulls it
in), so it is set here, before any test module is collected."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
