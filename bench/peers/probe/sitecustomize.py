"""Bench-side probe for autopipe's generated train.py (``bench/bench_peers.py`` puts this folder on
PYTHONPATH): wraps both engines' ``Trainer.step`` so each rank records its steps as the bare scripts
do (``bench/peers/record.py``). Nothing here changes what the job computes."""

import os
import sys

if os.environ.get("BENCH_RECORD_DIR") and "RANK" in os.environ:  # a rank, not torchrun's agent
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from record import Recorder

    _rec = None  # made once the trainers' hook is in (its labels import autopipe's trainer)

    def _wrap(module: str, cls: str) -> None:
        import importlib

        klass = getattr(importlib.import_module(module), cls)
        run = klass.step

        def step(self, *args, **kwargs):
            if "started" not in _rec.extra:
                _rec.start()  # the loop's first step starts now (building and tracing came before)
                _rec.extra["started"] = True
            stats = run(self, *args, **kwargs)
            _rec.step(stats.loss)
            return stats

        klass.step = step

    import importlib.abc
    import importlib.machinery

    class _Hook(importlib.abc.MetaPathFinder):
        """Wrap the trainers when their modules are first imported (train.py imports them lazily)."""

        targets = {"autopipe.runtime.torch_engine.trainer": "Trainer", "autopipe.runtime.deepspeed_engine.trainer": "DeepSpeedTrainer"}

        def find_spec(self, name, path, target=None):
            if name not in self.targets:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None:
                return None
            loader = spec.loader
            exec_module = loader.exec_module

            def patched(module, _exec=exec_module, _name=name):
                _exec(module)
                _wrap(_name, self.targets[_name])

            loader.exec_module = patched
            return spec

    sys.meta_path.insert(0, _Hook())
    _rec = Recorder()
