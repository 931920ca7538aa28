"""A probe for tests that launch unmodified scripts: did CP really run, and on how many tokens?

Imported at start-up by tests/startup/sitecustomize.py when CP_PROBE_DIR is set
(launching.probed_env): every worker then records, once `cpctl.runtime.runtime` is imported, each
`maybe_context_parallel` step (the full length, the padded length, the tokens per rank) and the
query length of every attention call the CP engine computes; at exit it writes
CP_PROBE_DIR/rank{RANK}.json. It only observes: the calls go through unchanged.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import json
import os
import sys

DIR = os.environ.get("CP_PROBE_DIR")
TARGET = "cpctl.runtime.runtime"


def _instrument(module) -> None:
    context_class = sys.modules["cpctl.runtime.context"].StepContext  # what every route's steps go through
    record = {"steps": [], "attention_q_lens": [], "cp_size": None}
    enter, attend = context_class.maybe_context_parallel, context_class.step_attention

    def maybe_context_parallel(self, **kwargs):
        context = enter(self, **kwargs)

        class Observed:
            def __enter__(inner):
                result = context.__enter__()
                padding = self.padding
                record["cp_size"] = self.mesh.cp_size
                record["steps"].append({"local": self.last_step.local_length,
                                        "length": padding.length if padding else None,
                                        "padded": padding.padded if padding else None})
                return result

            def __exit__(inner, *exc):
                return context.__exit__(*exc)

        return Observed()

    def step_attention(self, q, k, v, **options):
        record["attention_q_lens"].append(int(q.shape[-2]))
        return attend(self, q, k, v, **options)

    context_class.maybe_context_parallel = maybe_context_parallel
    context_class.step_attention = step_attention

    def write() -> None:
        with open(os.path.join(DIR, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump(record, f)

    atexit.register(write)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_instrument(module):
            exec_module(module)
            _instrument(module)

        loader.exec_module = exec_and_instrument
        return spec


if DIR:
    sys.meta_path.insert(0, _Finder())
