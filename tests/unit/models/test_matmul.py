"""swarm.models.matmul.linear: F.linear's result (to float rounding) whatever the rows, the form and the input rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swarm.models.matmul import MAX_FEW_ROWS, few_rows_kernel, linear, project


@pytest.mark.parametrize("rows", [1, 2, 3, MAX_FEW_ROWS, MAX_FEW_ROWS + 1, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_f_linear_for_every_row_count(rows: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=generator)
    b = torch.randn(96, generator=generator) if bias else None
    x = torch.randn(1, rows, 40, generator=generator)  # [1, N, K], as BlockRange's layers hold them
    got = linear(x, weight, b)
    assert got.shape == (1, rows, 96)
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)
    assert torch.equal(linear(x, weight, b), got)  # the same inputs always give the same bits


def test_the_few_rows_form_is_taken_only_where_it_was_measured_faster() -> None:
    weight = torch.randn(8, 4)
    assert few_rows_kernel(torch.randn(1, 4), weight)
    assert few_rows_kernel(torch.randn(1, MAX_FEW_ROWS, 4), weight)
    assert not few_rows_kernel(torch.randn(MAX_FEW_ROWS + 1, 4), weight)  # longer inputs: F.linear
    assert not few_rows_kernel(torch.randn(1, 4, dtype=torch.bfloat16), weight.bfloat16())  # other dtypes
    one_row = torch.randn(1, 4)
    assert torch.equal(
        linear(one_row.bfloat16(), weight.bfloat16()), F.linear(one_row.bfloat16(), weight.bfloat16())
    )


def test_project_uses_the_layers_weight_and_bias() -> None:
    layer = torch.nn.Linear(40, 24, bias=True)
    x = torch.randn(2, 40)
    with torch.no_grad():
        torch.testing.assert_close(project(x, layer), layer(x), atol=1e-5, rtol=1e-5)
