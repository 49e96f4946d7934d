"""dflash.core.extras.blas.cpu_has_native_bf16: the CPU flags that make bf16 autocast the training default on a CPU."""

import pytest

from dflash.core.extras.blas import cpu_has_native_bf16


@pytest.mark.parametrize("flags, native", [
    ("fpu sse2 avx avx2 fma", False),  # AVX2 only (an AMD EPYC, an older Xeon): bf16 would be emulated
    ("fpu avx2 avx512f avx512bw", False),  # AVX-512 without its bf16 extension
    ("fpu avx2 avx512f avx512_bf16", True),
    ("fpu avx2 avx512f amx_bf16 amx_tile amx_int8", True),  # Sapphire Rapids
])
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, flags, native):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: some cpu\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert cpu_has_native_bf16(str(cpuinfo)) is native


def test_unreadable_flags_mean_float32(tmp_path):
    assert cpu_has_native_bf16(str(tmp_path / "missing")) is False


def test_training_autocasts_bf16_by_default_only_where_it_is_native():
    from dflash.backends.torch.training.run import autocast_bf16_by_default

    assert autocast_bf16_by_default("cuda:0")
    assert autocast_bf16_by_default("cpu") == cpu_has_native_bf16()
