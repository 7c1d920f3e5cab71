"""Run a test script as ``python -m tests.start SCRIPT [ARGS]``, torch and Lightning imported with the collector off.

Importing them makes hundreds of thousands of objects and no garbage, yet the garbage collector
walks them again and again while they load (about 0.6 s of CPU of a process's 3.7 s here). With
the collector off during those imports and their objects frozen out of later passes
(``gc.freeze``), the script then runs as ``python SCRIPT ARGS`` would (as ``__main__``, with its
own ``sys.argv``), its imports of torch and Lightning already done.
"""

import gc
import runpy
import sys

gc.disable()
import lightning.pytorch  # noqa: E402, F401
import torch  # noqa: E402, F401

gc.enable()
gc.freeze()

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
