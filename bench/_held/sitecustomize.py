"""bench/bench_held_weights.py's census, loaded into a job's ranks only when the bench asks
(``PYTHONPATH`` holds this folder and ``AUTOPIPE_HELD`` names a file prefix): at the start of step 3,
the rank's resident set, the bytes of the tensors it trains with (parameters, gradients, optimizer
state: the trainer's own count), and the bytes of parameter tensors its model and chunks reach that are
none of those (whole weights a pass left behind); written per rank. The runtime itself carries none of it."""

from __future__ import annotations

import gc
import json
import os

_PREFIX = os.environ.get("AUTOPIPE_HELD")

if _PREFIX:
    from autopipe.runtime.logs import peak as _peak
    from autopipe.runtime.stage.build import local as _local
    from autopipe.runtime.torch_engine import trainer as _trainer

    _real = _trainer.Trainer.step
    _count = [0]

    def _storage(t):  # noqa: ANN001, ANN202
        s = _local(t.detach()).untyped_storage()
        return s.data_ptr(), s.nbytes()

    def _step(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        _count[0] += 1
        if _count[0] == 3:
            gc.collect()
            own = {_storage(p)[0] for p in self.params.values()}
            stray = {}
            for mod in (self.build.model, *self.build.chunks):
                for _, p in mod.named_parameters(remove_duplicate=False):
                    if p.device.type != "meta":
                        ptr, size = _storage(p)
                        if ptr not in own:
                            stray[ptr] = size
            record = {"resident": _peak.resident_bytes(), "held": _trainer._held_bytes(self.build, self.optimizer),
                      "stray": sum(stray.values())}
            with open(f"{_PREFIX}{os.environ.get('RANK', '0')}.json", "w") as f:
                json.dump(record, f)
        return _real(self, *args, **kwargs)

    _trainer.Trainer.step = _step
