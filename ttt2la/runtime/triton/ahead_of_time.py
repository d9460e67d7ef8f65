"""Compile every kernel for a GPU target on a machine without one, and report its resource use.

The CPU interpreter checks what the kernels compute, not whether they compile: ``tl.dot`` shape limits, type
rules of the compiled path, register spills and shared memory only show up in the real compiler. This module
runs the ops' launch wrappers on ``meta`` tensors with the kernels swapped for recorders, then compiles each
recorded launch for the target (Hopper by default) down to a cubin and reads its registers, spills and shared
memory with the ``cuobjdump`` that ships with Triton. Run it as ``python -m ttt2la.runtime.triton.ahead_of_time``
(with ``TRITON_INTERPRET`` unset).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import tempfile
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import _common, block, channel_decay, chunk, swiglu, tile_tuning

_POINTER = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16",
            torch.int32: "*i32", torch.int64: "*i64"}


@dataclasses.dataclass
class Launch:
    """One recorded kernel launch: the kernel, its arguments and launch options."""
    kernel: object
    args: tuple
    options: dict

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


@dataclasses.dataclass
class Compiled:
    """Resource use of one compiled launch (``None`` where ``cuobjdump`` could not tell)."""
    name: str
    dtype: str
    constants: str
    registers: int | None
    spill_bytes: int | None
    shared_bytes: int


class _Recorder:
    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.launches.append(Launch(self.kernel, args, options))
        return launch


@contextmanager
def recording():
    """Swap every kernel of the op modules for a recorder; yields the list of recorded launches (the default
    configuration of each launch: nothing is timed on ``meta`` tensors)."""
    launches: list[Launch] = []
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(tile_tuning, "enabled", lambda: False))
        for module in (chunk, channel_decay, block, swiglu):
            for name, value in vars(module).copy().items():
                if isinstance(value, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                    stack.enter_context(mock.patch.object(module, name, _Recorder(value, launches)))
        yield launches


def _signature(launch: Launch):
    signature, constants = {}, {}
    for param, value in zip(launch.kernel.params, launch.args):
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constants[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = _POINTER[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{launch.name}: cannot type argument {param.name}={value!r}")
    return signature, constants


def _resource_use(cubin: bytes, name: str):
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None, None
    match = re.search(r"Function " + re.escape(name) + r":\s*REG:(\d+) STACK:(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else (None, None)


def compile_launch(launch: Launch, target: GPUTarget) -> Compiled:
    """Compile one recorded launch for ``target`` and read its registers, spills and shared memory."""
    signature, constants = _signature(launch)
    options = {k: v for k, v in launch.options.items() if k in ("num_warps", "num_stages")}
    compiled = triton.compile(ASTSource(launch.kernel, signature, constexprs=constants), target=target,
                              options=options)
    registers, spills = _resource_use(compiled.asm["cubin"], launch.name)
    shown = {k: v for k, v in constants.items() if isinstance(v, (int, bool)) and v is not None}
    return Compiled(launch.name, str(constants.get("DT", "")), " ".join(f"{k}={v}" for k, v in shown.items()),
                    registers, spills, compiled.metadata.shared)


def _meta(*shape, dtype):
    return torch.empty(*shape, dtype=dtype, device="meta")


def record_all(dtype: torch.dtype, *, B=1, T=300, H=2, D=128, Dv=128, C=64, Dh=None) -> list[Launch]:
    """Launches of every wrapper (forward and backward, every option that changes a kernel) at one shape."""
    Dh = Dh or D
    x, y = _meta(B, T, H, D, dtype=dtype), _meta(B, T, H, Dv, dtype=dtype)
    lr_t, lr_f = _meta(B, T, H, dtype=dtype), _meta(B, T, H, Dv, dtype=dtype)
    w = _meta(H, D, Dh, dtype=dtype)
    f32 = torch.float32
    n = triton.cdiv(T, C)
    states = _meta(B, n, H, D, Dv, dtype=_common.accumulator(dtype))
    with recording() as launches:
        g = chunk.Spans(*(_meta(B, T, H, dtype=f32) for _ in chunk.Spans._fields))
        h0 = _meta(B, H, D, Dv, dtype=f32)
        bt = chunk.chunk_tile(64, dtype)
        chunk.chunk_forward(x, x, y, g, h0, 1.0, bt, True)
        chunk.chunk_forward(x, x, y, None, None, 1.0, bt, False)
        chunk.chunk_backward(x, x, y, g, h0, y, h0, 1.0, bt, True, True)
        chunk.chunk_backward(x, x, y, g, h0, y, h0, 1.0, bt, True, False)
        chunk.chunk_backward(x, x, y, None, None, y, None, 1.0, bt, False, False)
        gk = _meta(B, T, H, D, dtype=f32)
        _, _, A = channel_decay.channel_forward(x, x, y, gk, h0, 1.0, bt, True)
        for want_dg in (True, False):
            channel_decay.channel_backward(x, x, y, gk, h0, A, y, h0, 1.0, bt, True, want_dg)
        for scale in (None, lr_t, lr_f):
            block.chunk_increments(x, y, n, C, scale=scale)
            block.chunk_increments(x, y, n, C, scale=scale, split_y=True)
            block.chunk_read(y, states, C, scale=scale if scale is not lr_f else None, transpose=True,
                             split_x=scale is not None, split_s=True)
        block.chunk_read(x, states, C)
        block.chunk_read(x.float(), states, C, dot_dtype=dtype, split_x=True, split_s=True)
        block.chunk_increments(x.float(), y, n, C, dot_dtype=dtype, split_x=True)
        swiglu.swiglu_increments(x, w, w, y, n, C, scale=lr_t)
        swiglu.swiglu_increments(x, w, w, y, n, C, scale=lr_f, split_x=True, split_y=True)
        swiglu.swiglu_read(x, w, w, states, C)
    return launches


def check(target: GPUTarget | None = None, dtypes=(torch.bfloat16, torch.float32),
          kernels=None, **shape) -> list[Compiled]:
    """Compile every distinct launch of ``record_all`` for ``target`` (default: Hopper, sm_90).

    ``kernels``: names of the kernels to compile (default: all).
    """
    if _common.INTERPRET:
        raise RuntimeError("the kernels were imported under TRITON_INTERPRET=1; run without it")
    target = target or GPUTarget("cuda", 90, 32)
    results, seen = [], set()
    for dtype in dtypes:
        for launch in record_all(dtype, **shape):
            if kernels is not None and launch.name not in kernels:
                continue
            key = (launch.name, repr(_signature(launch)), repr(sorted(launch.options.items())))
            if key not in seen:
                seen.add(key)
                results.append(compile_launch(launch, target))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for Hopper")
    args = parser.parse_args(argv)
    rows = check(GPUTarget("cuda", args.arch, 32))
    print("| kernel | operands | registers | spill bytes | shared bytes | constants |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.name} | {r.dtype} | {r.registers} | {r.spill_bytes} | {r.shared_bytes} | {r.constants} |")


if __name__ == "__main__":
    main()
