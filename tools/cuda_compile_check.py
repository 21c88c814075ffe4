"""Compile kvtier's CUDA kernels with NVRTC on a machine without a GPU: catch what would fail on the device.

kvtier's CUDA kernels (``kernels/model/_cuda_few_row.py``) are sources MLX
compiles with NVRTC the first time they run (``mx.fast.cuda_kernel``). A
typo or an instruction the target lacks shows only then, on a lent GPU
whose minutes are scarce. This script builds each kernel's source the way
MLX 0.32 does (its default header, the kernel's header, the signature MLX
generates for the inputs and outputs, the template constants, the body) and
compiles it to SASS for each ``--arch``, printing NVRTC's log. No GPU is
needed; NVRTC itself and three include trees are::

    pip download --no-deps "nvidia-cuda-nvrtc==13.*" "nvidia-cuda-runtime==13.*" -d /tmp/nvrtc
    # unzip both wheels into /tmp/nvrtc/root (libnvrtc.so.13, include/cuda_bf16.h, ...)
    # MLX's device headers (mlx/backend/cuda/device/*.cuh): an MLX source checkout
    # of the installed version; CCCL: the MLX CUDA wheel's mlx/include/cccl

    python tools/cuda_compile_check.py --nvrtc /tmp/nvrtc/root/nvidia/cu13/lib/libnvrtc.so.13 \\
        --mlx-src ~/src/mlx --cccl /tmp/mlx-cuda-wheel/mlx/include/cccl \\
        --cuda-include /tmp/nvrtc/root/nvidia/cu13/include --arch sm_90a,sm_80,sm_75

Exit status 1 if a kernel fails on an arch it should run on (``sm_80`` and
up for the bf16 ``mma``; lower arches are expected to fail, which the load's
self-check turns into MLX's products).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.model import _cuda_few_row

# NOTE: as MLX 0.32's custom_kernel.cpp writes it (default_header).
_MLX_DEFAULT_HEADER = (
    '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
)


def kernel_source(
    name: str, body: str, inputs: tuple[str, ...] = ("x", "w"), outputs: tuple[str, ...] = ("y",)
) -> str:
    """A kernel's whole source as MLX generates it (bf16 inputs with their shapes where the body reads them)."""
    src = _MLX_DEFAULT_HEADER + _cuda_few_row._HEADER
    src += "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    src += f"__global__ void custom_kernel_{name}(\n"
    params = []
    for arg in inputs:
        params.append(f"    const __nv_bfloat16* {arg}")
        if f"{arg}_shape" in body:
            params.append(f"    const __grid_constant__ Shape {arg}_shape")
    params += [f"    __nv_bfloat16* {out}" for out in outputs]
    src += ",\n".join(params) + ") {\n"
    src += f"  constexpr int WARPS = {_cuda_few_row._WARPS};\n\n"
    return src + body + "\n}\n\n} // namespace mlx::core::cu\n"


def kernels() -> dict[str, str]:
    """Every CUDA kernel kvtier hands MLX (``_cuda_few_row.KERNELS``), by name: its source as MLX generates it."""
    return {
        f"kvtier_few_row_{name}": kernel_source(f"kvtier_few_row_{name}", body, inputs, outputs)
        for name, (body, inputs, outputs) in _cuda_few_row.KERNELS.items()
    }


def compile_source(
    lib: ctypes.CDLL, source: str, arch: str, includes: list[str]
) -> tuple[int, str]:
    """NVRTC's result code and log for ``source`` compiled to SASS for ``arch``."""
    prog = ctypes.c_void_p()
    code = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None)
    if code != 0:
        return code, "nvrtcCreateProgram failed"
    opts = [
        b"--device-as-default-execution-space",
        f"--gpu-architecture={arch}".encode(),
        *(f"--include-path={p}".encode() for p in includes),
    ]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    code = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value + 1)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return int(code), log.value.decode(errors="replace")


def main() -> int:
    """Compile every variant for every arch; print each result."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nvrtc", type=Path, required=True, help="libnvrtc.so")
    p.add_argument(
        "--mlx-src",
        type=Path,
        required=True,
        help="an MLX source checkout (its mlx/ folder's parent)",
    )
    p.add_argument("--cccl", type=Path, required=True, help="the MLX CUDA wheel's mlx/include/cccl")
    p.add_argument(
        "--cuda-include", type=Path, required=True, help="CUDA's include folder (cuda_bf16.h)"
    )
    p.add_argument("--arch", default="sm_90a,sm_80")
    args = p.parse_args()
    lib = ctypes.CDLL(str(args.nvrtc))
    includes = [str(args.mlx_src), str(args.cccl), str(args.cuda_include)]
    failed = False
    for name, source in kernels().items():
        for arch in args.arch.split(","):
            code, log = compile_source(lib, source, arch, includes)
            expected = int(arch.removeprefix("sm_").rstrip("a")) >= 80
            status = "ok" if code == 0 else f"failed ({code})"
            print(f"{name} {arch}: {status}{'' if code == 0 or not expected else ' UNEXPECTED'}")
            if code != 0:
                print("  " + "\n  ".join(log.strip().splitlines()[-6:]))
                failed = failed or expected
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
