"""Native kernels' build (engine/native.py): built once per source, flags and CPU into the
user's own cache folder, reused by later loads, refused where the CPU lacks what a source
needs, and a failed build reported and given as None (the callers keep their torch path)."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tuneloop.server.engine import native

SOURCE = 'extern "C" int twice(int x) { return 2 * x; }\n'
COMPILER = native._compiler() is not None and native.platform.system() == "Linux"
pytestmark = pytest.mark.skipif(not COMPILER, reason="no C++ compiler on this host")


@pytest.fixture(autouse=True)
def _own_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A temporary directory of the test's own, and nothing cached from other tests."""
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path))
    native.library.cache_clear()
    native.function.cache_clear()
    yield
    native.library.cache_clear()
    native.function.cache_clear()


def test_a_source_is_built_once_and_loaded_again(tmp_path: Path) -> None:
    source = tmp_path / "twice.cpp"
    source.write_text(SOURCE)
    lib = native.library(source)
    assert lib is not None
    assert lib.twice(21) == 42
    [built] = (tmp_path / f"tuneloop-kernels-{os.getuid()}").glob("twice_*.so")
    stamp = built.stat().st_mtime_ns
    native.library.cache_clear()
    assert native.library(source) is not None
    assert built.stat().st_mtime_ns == stamp  # loaded, not compiled again
    source.write_text(SOURCE.replace("2 * x", "3 * x"))  # another source: another library
    native.library.cache_clear()
    again = native.library(source)
    assert again is not None
    assert again.twice(2) == 6
    assert len(list(built.parent.glob("twice_*.so"))) == 2


def test_a_header_beside_the_source_is_part_of_what_is_built(tmp_path: Path) -> None:
    folder = tmp_path / "sources"
    folder.mkdir()
    (folder / "factor.h").write_text("constexpr int kFactor = 2;\n")
    source = folder / "scaled.cpp"
    source.write_text('#include "factor.h"\nextern "C" int scaled(int x) { return kFactor * x; }\n')
    lib = native.library(source)
    assert lib is not None
    assert lib.scaled(21) == 42
    (folder / "factor.h").write_text("constexpr int kFactor = 3;\n")  # the source unchanged
    native.library.cache_clear()
    again = native.library(source)
    assert again is not None
    assert again.scaled(2) == 6  # built again, not the library of the old header


def test_a_function_comes_with_its_signature(tmp_path: Path) -> None:
    """ctypes converts the arguments by the signature set: a float given to an int parameter
    is refused rather than passed as raw bits."""
    source = tmp_path / "twice.cpp"
    source.write_text(SOURCE)
    twice = native.function(source, "twice", (ctypes.c_int,), ctypes.c_int)
    assert twice(21) == 42
    with pytest.raises(ctypes.ArgumentError):
        twice(1.5)
    assert native.function(source, "twice", (ctypes.c_int,), ctypes.c_int, ("no_flag",)) is None


def test_a_cpu_without_the_needed_flags_gets_none(tmp_path: Path) -> None:
    source = tmp_path / "twice.cpp"
    source.write_text(SOURCE)
    assert native.library(source, ("no_such_cpu_flag",)) is None
    assert not (tmp_path / f"tuneloop-kernels-{os.getuid()}").exists()  # nothing was built


def test_a_failed_build_is_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++\n")
    with caplog.at_level(logging.WARNING):
        assert native.library(source) is None
    assert "broken.cpp could not be built" in caplog.text


def test_a_cache_folder_others_can_write_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / f"tuneloop-kernels-{os.getuid()}"
    folder.mkdir()
    folder.chmod(0o777)
    source = tmp_path / "twice.cpp"
    source.write_text(SOURCE)
    with caplog.at_level(logging.WARNING):
        assert native.library(source) is None
    assert "not this user's own folder" in caplog.text


def test_cpu_flags_are_read() -> None:
    flags = native.cpu_flags()
    assert isinstance(flags, frozenset)
    if native.platform.machine() == "x86_64":
        assert "sse2" in flags


def test_bf16_loops_take_cpu_bf16_inputs_autograd_does_not_record() -> None:
    import torch

    x = torch.ones(2, dtype=torch.bfloat16)
    assert native.bf16_without_autograd(x, x)
    assert not native.bf16_without_autograd(x, x.float())
    assert not native.bf16_without_autograd(x, x.to("meta"))
    trained = x.clone().requires_grad_(True)
    assert not native.bf16_without_autograd(x, trained)
    with torch.no_grad():
        assert native.bf16_without_autograd(x, trained)  # nothing recorded there


def test_an_avx2_cap_hides_the_larger_flags_and_builds_for_x86_64_v3(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TUNELOOP_CPU_ISA=avx2: the flags a kernel may ask for are x86-64-v3's at most, the
    sources are built for that level, and bf16 weights are not offered; other values are
    refused by name."""
    from tuneloop.server.engine import dtypes

    native.cpu_flags.cache_clear()
    try:
        monkeypatch.setenv(native.ISA_VARIABLE, "avx2")
        capped = native.cpu_flags()
        assert not {f for f in capped if f.startswith(("avx512", "amx"))}
        assert "-march=x86-64-v3" in native._compile_flags()
        assert "-march=native" not in native._compile_flags()
        if capped:
            assert dtypes.cpu_bf16_flags() is False
        monkeypatch.setenv(native.ISA_VARIABLE, "avx512")
        with pytest.raises(ValueError, match=native.ISA_VARIABLE):
            native.isa_cap()
        monkeypatch.setenv(native.ISA_VARIABLE, "native")
        assert native.isa_cap() is None
        assert native._compile_flags() == native.FLAGS
    finally:
        native.cpu_flags.cache_clear()
