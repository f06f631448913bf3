"""Measurements kept per machine in the cache directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.models.backends.cpu.kept import keep, machine, read_kept


def test_a_measurement_is_kept_only_for_a_cpu_with_the_same_instruction_sets(tmp_path: Path) -> None:
    """Two CPUs a VM names alike ("AMD EPYC": a Zen 3 with AVX2 only, a Zen 5 with AVX-512) get their own."""

    def cpuinfo(name: str, family: int, model: int, flags: str) -> Path:
        path = tmp_path / name
        block = f"processor\t: {{}}\nmodel name\t: AMD EPYC\ncpu family\t: {family}\nmodel\t\t: {model}\n"
        path.write_text("\n".join(block.format(cpu) + f"flags\t\t: {flags}\n" for cpu in range(2)))
        return path

    zen3 = machine(cpuinfo("zen3", 25, 1, "fpu sse2 avx2 fma"))
    zen5 = machine(cpuinfo("zen5", 26, 2, "fpu sse2 avx2 fma avx512f avx512_bf16"))
    zen5_flags_only = machine(cpuinfo("zen5b", 25, 1, "fpu sse2 avx2 fma avx512f avx512_bf16"))
    assert len({zen3, zen5, zen5_flags_only}) == 3
    assert machine(cpuinfo("zen3-again", 25, 1, "fpu sse2 avx2 fma")) == zen3
    assert "AMD EPYC" in zen3 and "unknown" in machine(tmp_path / "missing")


@pytest.mark.parametrize("damage", ["not json", "[1, 2]", ""])
def test_a_damaged_file_reads_as_nothing_kept_and_is_rewritten_whole(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "kept.json"
    path.write_text(damage)
    assert read_kept(path, "a") is None
    keep(path, "a", {"rows": 2})
    keep(path, "b", [1])
    assert read_kept(path, "a") == {"rows": 2} and read_kept(path, "b") == [1]
    assert read_kept(tmp_path / "missing.json", "a") is None
    assert [p.name for p in tmp_path.iterdir()] == ["kept.json"]  # no partial file left behind
