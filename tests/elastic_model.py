"""The model of the elastic fault tests: the tiny GPT-2 of autopar.examples, whose data
takes 50 ms a batch to read (as a slow disk would), so that a kill lands mid-run."""

from __future__ import annotations

import time

from autopar.examples import Example, gpt2


def slow_gpt2(batch: int = 6) -> Example:
    example = gpt2(batch=batch)
    fast = example.data

    def data(step: int):
        time.sleep(0.05)
        return fast(step)

    example.data = data
    return example
