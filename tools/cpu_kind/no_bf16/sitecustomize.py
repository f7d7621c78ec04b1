# Run as on a CPU without native bf16 matmul: see ../_fake_cpuinfo.py.
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _fake_cpuinfo  # noqa: E402

_fake_cpuinfo.install(native_bf16=False)
