"""Layout validation and its error messages."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autopar.layout import Layout, LayoutError


def test_defaults_and_world_size():
    layout = Layout()
    assert (layout.dp, layout.tp, layout.pp, layout.world_size) == (1, 1, 1, 1)
    assert Layout(dp=2, tp=2, pp=2).world_size == 8
    assert str(Layout(dp=2, bucket_mb=1.0)) == "Layout(dp=2, bucket_mb=1.0)"


@pytest.mark.parametrize("fields, message", [
    ({"dp": 0}, "Layout.dp must be a positive integer, got 0"),
    ({"tp": 1.5}, "Layout.tp must be a positive integer"),
    ({"schedule": "1F1B"}, "Layout.schedule must be one of ['1f1b', 'gpipe', 'interleaved', 'zero-bubble']"),
    ({"recompute": "some"}, "Layout.recompute must be one of"),
    ({"amp": "fp8"}, "Layout.amp must be one of ['off', 'bf16', 'fp16']"),
    ({"zero": 4, "dp": 2}, "Layout.zero must be 0, 1, 2 or 3"),
    ({"zero": 1}, "needs dp > 1"),
    ({"virtual_stages": 2}, "needs schedule='interleaved'"),
    ({"sequence_parallel": True}, "needs tp > 1"),
    ({"bucket_mb": -1}, "Layout.bucket_mb must be a finite number >= 0"),
    ({"grad_comm_dtype": "int8"}, "Layout.grad_comm_dtype must be one of"),
])
def test_bad_fields_name_the_field(fields, message):
    with pytest.raises(LayoutError) as err:
        Layout(**fields)
    assert message in str(err.value)


def test_world_size_mismatch_says_what_to_launch():
    with pytest.raises(LayoutError) as err:
        Layout(dp=4).check_world_size(2)
    text = str(err.value)
    assert "needs dp*tp*pp = 4 processes" in text and "world size is 2" in text
    assert "torchrun --nproc-per-node 4" in text


def test_batch_that_does_not_split_names_sizes_that_work():
    with pytest.raises(LayoutError, match=r"multiple of 4, or dp in \[1, 5\]"):
        Layout(dp=2, microbatches=2).check_batch(10)
    Layout(dp=2).check_batch(8)


def test_dict_round_trip_and_unknown_fields():
    layout = Layout(dp=2, tp=2, schedule="gpipe")
    assert Layout.from_dict(layout.to_dict()) == layout
    with pytest.raises(LayoutError, match=r"unknown Layout field\(s\) \['dpp'\]"):
        Layout.from_dict({"dpp": 2})


@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 8))
def test_world_size_is_the_product(dp, tp, pp):
    layout = Layout(dp=dp, tp=tp, pp=pp)
    layout.check_world_size(dp * tp * pp)
    with pytest.raises(LayoutError):
        layout.check_world_size(dp * tp * pp + 1)
