"""The model of the elastic fault tests: the tiny GPT-2 of autopar.examples, whose data
takes 50 ms a batch to read (as a slow disk would), so that a kill lands mid-run.

With ELASTIC_TEST_HOLD_AT=K in the environment, a world of one process stops before
reading batch K until torchrun restarts it (a node joined): the test that grows the
world back does not depend on how fast a replacement starts."""

from __future__ import annotations

import os
import time

from autopar.examples import Example, gpt2


def slow_gpt2(batch: int = 6) -> Example:
    example = gpt2(batch=batch)
    fast = example.data

    def data(step: int):
        time.sleep(0.05)
        hold = os.environ.get("ELASTIC_TEST_HOLD_AT")
        while hold and os.environ.get("WORLD_SIZE") == "1" and step >= int(hold):
            time.sleep(0.05)
        return fast(step)

    example.data = data
    return example
