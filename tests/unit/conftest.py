"""Unit-tier settings: Triton kernels run in Triton's interpreter on CPU.

The interpreter must be chosen before triton is first imported (autopar's import pulls
it in through torch), so it is set here, before any test module is collected.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
