"""Make /proc/cpuinfo list (or not list) native bf16 matmul, for this process and every process it
starts (they inherit PYTHONPATH): the way to run the suite as on the other kind of CPU.

Used through the sitecustomize.py beside it in native_bf16/ or no_bf16/:
    PYTHONPATH=tools/cpu_kind/no_bf16 make test
muonlab reads the flags from /proc/cpuinfo only (muonlab.kernels.newton_schulz.cpu_flags), so
rewriting that file's text as Python opens it changes what "auto" resolves to and nothing else:
the arithmetic still runs on this CPU (emulated bf16 where it has none: slower, same bits).
"""

import builtins
import io

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def install(native_bf16: bool) -> None:
    real_open = builtins.open

    def open_(file, *args, **kwargs):
        if file != "/proc/cpuinfo":
            return real_open(file, *args, **kwargs)
        with real_open(file) as f:
            lines = f.read().splitlines(keepends=True)
        out = []
        for line in lines:
            if line.startswith("flags"):
                words = [w for w in line.split() if w not in BF16_FLAGS]
                if native_bf16:
                    words.append(BF16_FLAGS[0])
                line = " ".join(words) + "\n"
            out.append(line)
        return io.StringIO("".join(out))

    builtins.open = open_
