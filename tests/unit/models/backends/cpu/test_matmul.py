"""swarm.models.backends.cpu.matmul: F.linear's result (to float rounding) whatever the rows, the form and the input's shape, and
forms measured per machine and set of weight shapes."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from swarm.models.backends.cpu import int4, matmul
from swarm.models.backends.cpu.matmul import (
    LONG_ROWS,
    MAX_FEW_ROWS,
    PACKED_ROWS,
    PACKED_TIMED_ROWS,
    PLAIN,
    Forms,
    calibrate,
    few_rows_kernel,
    few_rows_limit,
    linear,
    pack,
    packed_rows,
    packers,
    packing_available,
    project,
)
from swarm.testing.weights import four_bit

needs_packing = pytest.mark.skipif(not packing_available(), reason="this torch has no packed-weight kernels")


@pytest.fixture(autouse=True)
def fresh_calibrations(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Each test measures for itself, however often it runs: nothing kept in this process or on disk. Returns
    where calibrations are kept."""
    monkeypatch.setattr(matmul, "_calibrated_by_key", {})
    store = tmp_path / "forms.json"
    monkeypatch.setattr(matmul, "_store_path", lambda: store)
    return store


@pytest.fixture()
def few_columns_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of each product that went through the few-columns form."""
    calls: list[int] = []
    original = matmul._few_columns

    def spy(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape[0])
        return original(rows, weight)

    monkeypatch.setattr(matmul, "_few_columns", spy)
    return calls


@pytest.fixture()
def packed_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of each product that went through the packed weights."""
    calls: list[int] = []
    original = matmul._packed_product

    def spy(
        rows: torch.Tensor,
        packed: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        packer: str,
    ) -> torch.Tensor:
        calls.append(rows.shape[0])
        return original(rows, packed, weight, bias, packer)

    monkeypatch.setattr(matmul, "_packed_product", spy)
    return calls


@pytest.mark.parametrize("rows", [1, 2, 3, MAX_FEW_ROWS, MAX_FEW_ROWS + 1, 16, 17])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("few_rows", [0, MAX_FEW_ROWS])
def test_linear_is_f_linear_for_every_row_count(
    rows: int, bias: bool, few_rows: int, few_columns_calls: list[int]
) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=generator)
    b = torch.randn(96, generator=generator) if bias else None
    x = torch.randn(1, rows, 40, generator=generator)  # [1, N, K], as BlockRange's layers hold them
    forms = Forms(few_rows=few_rows)
    got = linear(x, weight, b, forms)
    assert got.shape == (1, rows, 96)
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)
    assert torch.equal(linear(x, weight, b, forms), got)  # the same inputs always give the same bits
    assert few_columns_calls == ([rows, rows] if rows <= few_rows else [])  # the form the limit asked for


@pytest.mark.parametrize("packer", packers())
@pytest.mark.parametrize("rows", [1, 2, 7, PACKED_ROWS, PACKED_ROWS + 1, LONG_ROWS])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("beyond", [False, True])
def test_packed_weights_give_f_linears_result_for_the_row_counts_they_are_kept_for(
    packer: str, rows: int, bias: bool, beyond: bool, packed_calls: list[int]
) -> None:
    generator = torch.Generator().manual_seed(rows)
    features = 64 if packer == "int4" else 40  # the 4-bit form takes blocks of 32 weights
    weight = torch.randn(96, features, generator=generator)
    weight = four_bit(weight) if packer == "int4" else weight
    b = torch.randn(96, generator=generator) if bias else None
    x = torch.randn(1, rows, features, generator=generator)
    forms = Forms(packer=packer, packed_rows=frozenset(PACKED_TIMED_ROWS), packed_beyond=beyond)
    got = linear(x, weight, b, forms, pack(weight, packer))
    assert got.shape == (1, rows, 96)
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)
    assert torch.equal(linear(x, weight, b, forms, pack(weight, packer)), got)
    packs = rows in PACKED_TIMED_ROWS or beyond
    assert packed_calls == ([rows, rows] if packs else [])
    packed_calls.clear()
    linear(x, weight, b, forms)  # no packed copy given: F.linear, whatever the forms say
    assert packed_calls == []


def test_an_unknown_packer_is_refused() -> None:
    with pytest.raises(ValueError, match="packer"):
        pack(torch.randn(4, 4), "blas")


@pytest.mark.parametrize(
    "x",
    [
        torch.randn(40),  # one token, no batch dimension
        torch.randn(0, 40),  # no rows at all
        torch.randn(40, 3).T,  # three rows, not contiguous
        torch.randn(2, 1, 40),
    ],
    ids=["1-D", "0 rows", "transposed", "3-D"],
)
def test_linear_takes_any_input_shape_f_linear_takes(x: torch.Tensor) -> None:
    weight = torch.randn(24, 40)
    got = linear(x, weight, None, Forms(few_rows=MAX_FEW_ROWS))
    assert got.shape == F.linear(x, weight).shape
    torch.testing.assert_close(got, F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_the_few_columns_form_is_taken_only_up_to_the_limit_and_for_cpu_float32() -> None:
    weight = torch.randn(8, 4)
    assert few_rows_kernel(torch.randn(1, 4), weight, 1)
    assert few_rows_kernel(torch.randn(1, 3, 4), weight, 3)
    assert not few_rows_kernel(torch.randn(1, 4), weight, 0)  # the machine said never
    assert not few_rows_kernel(torch.randn(4, 4), weight, 3)  # more rows than the limit: F.linear
    assert not few_rows_kernel(torch.randn(0, 4), weight, 3)  # nothing to compute
    assert not few_rows_kernel(torch.randn(1, 4, dtype=torch.bfloat16), weight.bfloat16(), 4)  # other dtypes
    one_row = torch.randn(1, 4)
    assert torch.equal(
        linear(one_row.bfloat16(), weight.bfloat16(), None, Forms(few_rows=4)),
        F.linear(one_row.bfloat16(), weight.bfloat16()),
    )


def test_the_limit_is_the_longest_run_of_row_counts_where_the_form_is_clearly_faster() -> None:
    assert few_rows_limit({1: (1.0, 0.5), 2: (1.0, 0.8), 3: (1.0, 0.95), 4: (1.0, 0.5)}) == 2  # 3 is a tie
    assert few_rows_limit({1: (1.0, 2.0), 2: (1.0, 0.5)}) == 0  # slower for one row: never
    assert few_rows_limit({rows: (2.0, 1.0) for rows in range(1, MAX_FEW_ROWS + 1)}) == MAX_FEW_ROWS
    assert few_rows_limit({}) == 0


def test_packed_weights_are_kept_for_each_row_count_where_they_were_clearly_faster() -> None:
    seconds = {2: (1.0, 1.2), 3: (1.0, 0.5), 4: (1.0, 0.95), 5: (2.0, 1.0), 16: (1.0, 0.9)}
    assert packed_rows(seconds) == {3, 5, 16}  # not a run: MKL's speed jumps about between row counts
    assert packed_rows({}) == frozenset()


def paced_clock(f_linear_s: float, few_columns_s: float) -> tuple[Callable[[], float], list[int]]:
    """A clock under which every timed pass of F.linear takes f_linear_s and every pass of the few-columns form
    few_columns_s (calibration times them in turn: F.linear, then the other), and the count of its reads."""
    reads = [0]
    passes = itertools.cycle([f_linear_s, few_columns_s])
    now = [0.0]

    def clock() -> float:
        reads[0] += 1
        if reads[0] % 2 == 0:  # the end of a pass
            now[0] += next(passes)
        return now[0]

    return clock, reads


def test_forms_name_the_form_each_row_count_takes() -> None:
    forms = Forms(few_rows=3, packer="int4", packed_rows=frozenset({1, 2}))
    assert [forms.form(rows) for rows in (1, 2, 3, 4, PACKED_ROWS + 1)] == [
        "int4",
        "int4",
        "few_rows",
        "plain",
        "plain",
    ]
    assert Forms(packer="onednn", packed_beyond=True).form(PACKED_ROWS + 1) == "onednn"
    assert PLAIN.form(1) == "plain"


@pytest.mark.parametrize(
    ("f_linear_s", "other_s", "expected"),
    # rows the few-columns form takes stay with it when packed weights are no faster than it
    [
        (2.0, 1.0, Forms(MAX_FEW_ROWS, "first", frozenset(range(MAX_FEW_ROWS + 1, PACKED_ROWS + 1)), True)),
        (1.0, 2.0, PLAIN),
    ],
)
@pytest.mark.parametrize("packing", [False, pytest.param(True, marks=needs_packing)])
def test_calibration_keeps_the_forms_that_were_faster(
    f_linear_s: float, other_s: float, expected: Forms, packing: bool
) -> None:
    clock, _ = paced_clock(f_linear_s, other_s)
    forms = calibrate([torch.randn(24, 8), torch.randn(8, 24)], packing=packing, clock=clock)
    if packing and expected.packer:  # every packer saved as much: the first is kept
        expected = Forms(expected.few_rows, packers()[0], expected.packed_rows, expected.packed_beyond)
    assert forms == (expected if packing else Forms(few_rows=expected.few_rows))


def test_calibration_runs_once_per_shapes_and_skips_what_it_cannot_serve() -> None:
    clock, reads = paced_clock(1.0, 1.0)
    weights = [torch.randn(24, 8), torch.randn(8, 24)]
    assert calibrate(weights, repeats=2, clock=clock) == PLAIN  # a tie is not "clearly faster"
    timed = MAX_FEW_ROWS * 3 * 2 * 2  # per row count: warm-up + 2 repeats, two forms, two clock reads
    assert reads[0] == timed
    assert calibrate([torch.randn(8, 24), torch.randn(24, 8)], clock=clock) == PLAIN  # the same shapes: kept
    bf16 = [torch.randn(24, 8, dtype=torch.bfloat16)]
    assert calibrate(bf16, clock=clock) == PLAIN  # not float32: never timed
    assert calibrate([], clock=clock) == PLAIN
    assert reads[0] == timed
    with pytest.raises(ValueError, match="repeats"):
        calibrate(weights, repeats=0)


@needs_packing
def test_calibration_with_packing_times_each_packer_once_more_per_row_count() -> None:
    clock, reads = paced_clock(1.0, 1.0)
    weights = [torch.randn(24, 8), torch.randn(8, 24)]
    calibrate(weights, repeats=2, clock=clock)
    assert calibrate(weights, repeats=2, packing=True, clock=clock) == PLAIN  # packing is its own key
    per_packer = len(PACKED_TIMED_ROWS) + 1  # and LONG_ROWS
    timed_packers = [p for p in packers() if p != "int4"]  # the 4-bit form only for 4-bit weights
    assert reads[0] == (MAX_FEW_ROWS * 2 + per_packer * len(timed_packers)) * 3 * 2 * 2


def test_calibration_times_every_shape_within_its_byte_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matmul, "CALIBRATION_BYTES", 4 * 100)  # 100 floats
    shapes: list[tuple[int, ...]] = []
    original = matmul._time_forms

    def record(weights: list[torch.Tensor], *args: object) -> dict:  # type: ignore[type-arg]
        shapes.extend(tuple(w.shape) for w in weights)
        return original(weights, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(matmul, "_time_forms", record)
    big, small = torch.randn(1000, 10), torch.randn(3, 7)
    calibrate([big, big, big, small])  # a large first weight must not crowd out the later shapes
    assert shapes == [(10, 10), (3, 7)]  # each shape once, the large one cut to its first 100 floats


def test_calibration_leaves_the_global_random_stream_alone() -> None:
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    calibrate([torch.zeros(16, 8)])  # made before the seed's draw, so it is not part of the stream
    assert torch.equal(torch.rand(3), expected)


def test_project_uses_the_layers_weight_and_bias() -> None:
    layer = torch.nn.Linear(40, 24, bias=True)
    x = torch.randn(2, 40)
    with torch.no_grad():
        torch.testing.assert_close(project(x, layer, Forms(few_rows=2)), layer(x), atol=1e-5, rtol=1e-5)


def _never_timed() -> float:
    raise AssertionError("calibration timed the forms again")


def test_a_calibration_is_kept_on_disk_for_the_next_process(fresh_calibrations: Path) -> None:
    clock, _ = paced_clock(2.0, 1.0)
    weights = [torch.randn(24, 8), torch.randn(8, 24)]
    measured = calibrate(weights, clock=clock)
    assert measured.few_rows == MAX_FEW_ROWS
    matmul._calibrated_by_key.clear()  # as a new process would start
    assert calibrate(weights, clock=_never_timed) == measured
    assert calibrate(weights, repeats=1, clock=_never_timed) == measured  # repeats are how, not what
    other_shapes = [torch.randn(16, 8)]
    assert calibrate(other_shapes, clock=paced_clock(1.0, 2.0)[0]) == PLAIN  # kept beside the first
    matmul._calibrated_by_key.clear()
    assert calibrate(weights, clock=_never_timed) == measured
    assert len(json.loads(fresh_calibrations.read_text())) == 2


@pytest.mark.skipif(not int4.available(), reason="no 4-bit kernel here (needs x86-64 AVX2 and a C compiler)")
def test_a_calibration_that_timed_the_4_bit_kernel_holds_for_that_build_of_it_only(
    fresh_calibrations: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = [four_bit(torch.randn(64, 64, generator=torch.Generator().manual_seed(1)) * 0.05)]
    measured = calibrate(weights, packing=True, repeats=1)
    assert "int4" in matmul._offered(weights)
    matmul._calibrated_by_key.clear()
    assert calibrate(weights, packing=True, clock=_never_timed) == measured  # kept for the same build
    monkeypatch.setattr(int4, "kernel_version", lambda: "another build")
    matmul._calibrated_by_key.clear()
    with pytest.raises(AssertionError, match="timed the forms again"):
        calibrate(weights, packing=True, clock=_never_timed)
    unpacked = calibrate(weights)  # no packed form offered: its key names no kernel build
    matmul._calibrated_by_key.clear()
    monkeypatch.setattr(int4, "kernel_version", lambda: "a third build")
    assert calibrate(weights, clock=_never_timed) == unpacked


@pytest.mark.parametrize(
    "damage",
    [
        "not json",
        "[1, 2]",
        json.dumps({"few_rows": 99, "packer": "", "packed_rows": [], "packed_beyond": False}),
        json.dumps({"few_rows": 1, "packer": "cublas", "packed_rows": [], "packed_beyond": False}),
        json.dumps({"few_rows": 1, "packer": "", "packed_rows": [17, "x"], "packed_beyond": False}),
        json.dumps({"few_rows": 1}),
    ],
    ids=["not json", "not a map", "too many rows", "unknown packer", "bad rows", "fields missing"],
)
def test_a_damaged_store_is_measured_again_and_rewritten(fresh_calibrations: Path, damage: str) -> None:
    weights = [torch.randn(24, 8)]
    calibrate(weights, clock=paced_clock(1.0, 1.0)[0])
    kept = json.loads(fresh_calibrations.read_text())
    (key,) = kept
    if damage.startswith("{"):  # a damaged entry in an intact file
        kept[key] = json.loads(damage)
        fresh_calibrations.write_text(json.dumps(kept))
    else:
        fresh_calibrations.write_text(damage)
    matmul._calibrated_by_key.clear()
    assert calibrate(weights, clock=paced_clock(2.0, 1.0)[0]).few_rows == MAX_FEW_ROWS  # timed again
    assert json.loads(fresh_calibrations.read_text())[key]["few_rows"] == MAX_FEW_ROWS


def test_calibration_works_where_nothing_can_be_kept(
    fresh_calibrations: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocked = tmp_path / "a file" / "forms.json"  # its parent is a file: nothing can be written there
    (tmp_path / "a file").write_text("")
    monkeypatch.setattr(matmul, "_store_path", lambda: blocked)
    assert calibrate([torch.randn(24, 8)], clock=paced_clock(2.0, 1.0)[0]).few_rows == MAX_FEW_ROWS


_MEASURER = """
import sys, torch
from swarm.models.backends.cpu import matmul
torch.set_num_threads(int(sys.argv[1]))
reads, now = [0], [0.0]
def clock():  # a pass of F.linear takes 2 s, of the few-columns form 1 s; the first read waits for the test
    if reads[0] == 0:
        print("measuring", flush=True)
        sys.stdin.readline()
    reads[0] += 1
    if reads[0] % 2 == 0:  # the end of a pass: they alternate, F.linear first
        now[0] += 2.0 if reads[0] % 4 == 2 else 1.0
    return now[0]
print(matmul.calibrate([torch.randn(24, 8)], clock=clock).few_rows, flush=True)
"""


def test_a_calibration_waits_for_another_process_measuring_and_takes_what_it_kept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Peers started together on one machine measure one at a time: timed beside each other, each would keep
    for good forms none of them would have measured alone."""
    monkeypatch.setattr(matmul, "_store_path", lambda: tmp_path / matmul.STORE_NAME)
    other = subprocess.Popen(
        [sys.executable, "-c", _MEASURER, str(torch.get_num_threads())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "FLOWSWARM_CACHE": str(tmp_path)},
    )
    assert other.stdin is not None and other.stdout is not None
    try:
        assert other.stdout.readline() == "measuring\n"  # it holds the lock now
        ours: list[Forms] = []
        waiting = threading.Thread(
            target=lambda: ours.append(calibrate([torch.randn(24, 8)], clock=_never_timed))
        )
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and not ours  # waits for the other process, does not time beside it
        other.stdin.write("go\n")
        other.stdin.flush()
        theirs = int(other.stdout.readline())
        waiting.join(30)
        assert not waiting.is_alive()
        assert [forms.few_rows for forms in ours] == [theirs] and theirs > 0  # theirs, not timed again
    finally:
        other.kill()
        other.wait()


_THREAD_PROBE = """
import os, threading, torch
from swarm.models.backends.cpu import matmul
from swarm.testing.weights import four_bit
torch.set_num_threads(1)
weight = four_bit(torch.randn(512, 64)) if {packer!r} == "int4" else torch.randn(512, 64)
forms = matmul.Forms(few_rows=4, packer={packer!r}, packed_rows=frozenset(range(1, 17)), packed_beyond=True)
packed = matmul.pack(weight, {packer!r}) if {packer!r} else None
inputs = [torch.randn(rows, 64) for rows in (1, 3, 8, 64)]
before = set(os.listdir("/proc/self/task"))
def compute():
    for x in inputs:
        matmul.linear(x, weight, forms=forms, packed=packed)
    # OpenMP's threads for this one live as long as it does
    print(len(set(os.listdir("/proc/self/task")) - before))
worker = threading.Thread(target=compute)
worker.start()
worker.join()
"""


@pytest.mark.skipif(
    (os.cpu_count() or 1) < 2 or not Path("/proc/self/task").is_dir(), reason="needs 2 CPUs, Linux"
)
@pytest.mark.parametrize("packer", ["", *packers()])
def test_a_worker_thread_computes_on_the_processs_thread_count(packer: str) -> None:
    """A thread that computes (a peer's executor, a client's head batcher) keeps to torch's thread count: OpenMP
    starts no threads of its own for it. In a fresh process, whose OpenMP state no other test touched."""
    probe = subprocess.run(
        [sys.executable, "-c", _THREAD_PROBE.format(packer=packer)],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[3],
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["1"], probe.stdout + probe.stderr  # the worker thread alone
