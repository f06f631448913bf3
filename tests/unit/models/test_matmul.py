"""swarm.models.matmul: F.linear's result (to float rounding) whatever the rows, the form and the input rank, and a
row limit measured per machine and weight shapes."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from swarm.models.matmul import MAX_FEW_ROWS, calibrate, few_rows_kernel, few_rows_limit, linear, project


@pytest.mark.parametrize("rows", [1, 2, 3, MAX_FEW_ROWS, MAX_FEW_ROWS + 1, 17])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("few_rows", [0, MAX_FEW_ROWS])
def test_linear_is_f_linear_for_every_row_count(rows: int, bias: bool, few_rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=generator)
    b = torch.randn(96, generator=generator) if bias else None
    x = torch.randn(1, rows, 40, generator=generator)  # [1, N, K], as BlockRange's layers hold them
    got = linear(x, weight, b, few_rows)
    assert got.shape == (1, rows, 96)
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)
    assert torch.equal(linear(x, weight, b, few_rows), got)  # the same inputs always give the same bits


def test_the_few_columns_form_is_taken_only_up_to_the_limit_and_for_cpu_float32() -> None:
    weight = torch.randn(8, 4)
    assert few_rows_kernel(torch.randn(1, 4), weight, 1)
    assert few_rows_kernel(torch.randn(1, 3, 4), weight, 3)
    assert not few_rows_kernel(torch.randn(1, 4), weight, 0)  # the machine said never
    assert not few_rows_kernel(torch.randn(4, 4), weight, 3)  # more rows than the limit: F.linear
    assert not few_rows_kernel(torch.randn(1, 4, dtype=torch.bfloat16), weight.bfloat16(), 4)  # other dtypes
    one_row = torch.randn(1, 4)
    assert torch.equal(
        linear(one_row.bfloat16(), weight.bfloat16(), None, 4),
        F.linear(one_row.bfloat16(), weight.bfloat16()),
    )


def test_the_limit_is_the_longest_run_of_row_counts_where_the_form_is_clearly_faster() -> None:
    assert few_rows_limit({1: (1.0, 0.5), 2: (1.0, 0.8), 3: (1.0, 0.95), 4: (1.0, 0.5)}) == 2  # 3 is a tie
    assert few_rows_limit({1: (1.0, 2.0), 2: (1.0, 0.5)}) == 0  # slower for one row: never
    assert few_rows_limit({rows: (2.0, 1.0) for rows in range(1, MAX_FEW_ROWS + 1)}) == MAX_FEW_ROWS
    assert few_rows_limit({}) == 0


def test_calibration_times_both_forms_once_per_shapes_and_skips_what_it_cannot_serve() -> None:
    ticks = itertools.count()
    calls = 0

    def clock() -> float:
        nonlocal calls
        calls += 1
        return float(next(ticks))

    weights = [torch.randn(24, 8), torch.randn(8, 24)]  # shapes no other test calibrates
    limit = calibrate(weights, repeats=2, clock=clock)
    assert limit == 0  # every pass "took" one tick: never clearly faster
    assert calls == MAX_FEW_ROWS * 3 * 2 * 2  # per row count: warm-up + 2 repeats, two forms, two clock reads
    assert calibrate(list(reversed(weights)), repeats=2, clock=clock) == limit  # the same shapes: kept
    assert calls == MAX_FEW_ROWS * 3 * 2 * 2
    assert calibrate([torch.randn(24, 8, dtype=torch.bfloat16)], clock=clock) == 0  # not float32: never timed
    assert calibrate([], clock=clock) == 0
    assert calls == MAX_FEW_ROWS * 3 * 2 * 2


def test_project_uses_the_layers_weight_and_bias() -> None:
    layer = torch.nn.Linear(40, 24, bias=True)
    x = torch.randn(2, 40)
    with torch.no_grad():
        torch.testing.assert_close(project(x, layer, 2), layer(x), atol=1e-5, rtol=1e-5)
