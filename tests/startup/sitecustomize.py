"""What every process a test starts runs first (launching.launch_env puts this folder on PYTHONPATH;
Python imports `sitecustomize` at start-up).

At exit, the interpreter's last garbage collections are skipped (`gc.freeze`, registered first so
it runs after every other exit handler): a process that imported torch spends 0.7 s in them, one
that imported transformers too 1.3 s (measured on 2 cores), and every launch waits for its ranks
and its launcher to exit. It can only lose what a finalizer in a reference cycle would have done
at exit, which a test would see as a missing file, never as a pass.

Every such process dumps its Python stack when it crashes in native code (faulthandler, as the
launcher turns on for its workers), so a rare crash in a test names where it happened.

With CP_PROBE_DIR set (launching.probed_env), the CP probe records each worker's steps (cp_probe.py).
"""

import atexit
import faulthandler
import gc
import os

atexit.register(gc.freeze)
faulthandler.enable()

if os.environ.get("CP_PROBE_DIR"):
    import cp_probe  # noqa: F401
