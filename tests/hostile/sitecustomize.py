"""A hostile site's own Python: on a SuperNode started with this folder first on PYTHONPATH, the client's trainer
answers each fit with the attack that CLIPFORGE_ATTACK names, as a site that controls its own machine could:

- ``nan``: its weights, every value NaN;
- ``shape``: its weights flattened into one array;
- ``huge``: every weight +1000, a claim of 10^9 examples and of a sample-level epsilon of 0 (and no clipping:
  without SecAgg+ the server clips).

The trainer is patched when Flower's ClientApp process imports clipforge.ps.federated (it inherits this
environment), so the SuperNode, its gate and the federation's protocol are the real ones.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

ATTACK = os.environ.get("CLIPFORGE_ATTACK")


def _poison(module) -> None:
    import numpy as np

    honest = module._Client.fit

    def fit(self, parameters, config):
        weights, examples, metrics = honest(self, parameters, config)
        if ATTACK == "nan":
            return [np.full_like(w, np.nan) if w.dtype.kind == "f" else w for w in weights], examples, metrics
        if ATTACK == "shape":
            return [np.concatenate([w.ravel().astype(np.float32) for w in weights])], examples, metrics
        if ATTACK == "huge":
            return [w + 1000 if w.dtype.kind == "f" else w for w in weights], 10**9, {**metrics, "sample_epsilon": 0.0}
        return weights, examples, metrics

    module._Client.fit = fit


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "clipforge.ps.federated":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path) if path else importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _poison(module)

        spec.loader.exec_module = exec_module
        return spec


if ATTACK:
    sys.meta_path.insert(0, _Patch())
