"""Gradient probe for the job tests, kept out of autopipe itself.

A test puts this folder on PYTHONPATH with ``AUTOPIPE_TEST_GRADS=DIR``; every train.py rank then
saves the gradient of each parameter it holds, by its name in the original model, just before the
first optimizer update (``DIR/grads_rank{RANK}.pt``), for either engine. The test compares them with
the unpipelined reference's: AdamW would hide a constant gradient scale in the weights.

With ``AUTOPIPE_TEST_GRADS_AT=norm`` the torch engine's gradients are saved earlier: when the
trainer takes their global norm (after the data-parallel reduce and the tied sums, before clipping,
which would hide a scale too). With ``AUTOPIPE_TEST_GRADS_AT=clipped`` the DeepSpeed engine's are
saved just after autopipe's clip (ZeRO 0), before AdamW's update. Sharded gradients (ZeRO 2/3 DTensors) are saved whole: every
replica gathers them, in the same order.

With ``AUTOPIPE_TEST_DDP=1`` as well, each stage's module type is recorded, and a stage run by
DistributedDataParallel gets a comm hook that launches the same all-reduce as DDP's own (torch's
``allreduce_hook``: divide by the replica count, sum) and records, for each bucket, the step and
whether it was launched from inside an autograd backward: ``DIR/ddp_rank{RANK}.json``, rewritten
at each step's norm.

With ``AUTOPIPE_TEST_WEIGHTS=DIR`` (on its own) every torch-engine rank saves, after each optimizer
update, the whole value of every parameter it holds, by name: ``DIR/weights_rank{RANK}_step{S}.pt``.
A checkpoint keeps a tied tensor once; this shows every rank's own copy.
"""

import os

_DIR = os.environ.get("AUTOPIPE_TEST_GRADS", "")
if _DIR:
    import torch

    def _whole(g):  # noqa: ANN001, ANN202
        g = g.detach()
        return (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()

    _ddp = {"stages": [], "launches": [], "step": 1}

    def _dump(named):  # noqa: ANN001, ANN202
        path = os.path.join(_DIR, f"grads_rank{os.environ.get('RANK', '0')}.pt")
        if not os.path.exists(path):
            torch.save({n: _whole(p.grad) for n, p in named if p.grad is not None}, path)
        if os.environ.get("AUTOPIPE_TEST_DDP"):
            import json

            with open(os.path.join(_DIR, f"ddp_rank{os.environ.get('RANK', '0')}.json"), "w") as f:
                json.dump(_ddp, f)
            _ddp["step"] += 1

    import autopipe.runtime.torch_engine.trainer as _trainer

    if os.environ.get("AUTOPIPE_TEST_DDP"):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
            allreduce_hook,
        )
        from torch.nn.parallel import DistributedDataParallel

        _init_ddp = _trainer.Trainer.__init__

        def _init_then_hook(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            _init_ddp(self, *args, **kwargs)
            for stage in self.engine.stages:
                _ddp["stages"].append(type(stage.submod).__name__)
                if isinstance(stage.submod, DistributedDataParallel):

                    def hook(group, bucket, index=stage.stage_index):  # noqa: ANN001, ANN202
                        _ddp["launches"].append({"step": _ddp["step"], "stage": index, "bucket": bucket.index(),
                                                 "in_backward": torch._C._current_graph_task_id() >= 0})
                        return allreduce_hook(group, bucket)

                    stage.submod.register_comm_hook(stage.submod.process_group, hook)

        _trainer.Trainer.__init__ = _init_then_hook

    if os.environ.get("AUTOPIPE_TEST_GRADS_AT") == "norm":
        _norm = _trainer.global_grad_norm

        def _probe_then_norm(params, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            _dump(params.items())
            return _norm(params, *args, **kwargs)

        _trainer.global_grad_norm = _probe_then_norm
    else:
        _init = _trainer.Trainer.__init__

        def _init_then_probe(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            _init(self, *args, **kwargs)
            self.optimizer.register_step_pre_hook(lambda *_: _dump(self.params.items()))

        _trainer.Trainer.__init__ = _init_then_probe

    import autopipe.runtime.deepspeed_engine.trainer as _ds

    _build = _ds.build_pipeline_module
    _modules = []

    def _build_and_keep(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        module = _build(*args, **kwargs)
        _modules.append(module)
        return module

    _ds.build_pipeline_module = _build_and_keep

    def _named_ds():  # noqa: ANN202
        named = []
        for child in _modules[0].modules():
            if isinstance(child, _ds.DSLayer):
                named += list(child.layer.named_parameters())
        return named + [(h.tied_name, h.weight) for h in getattr(_modules[0], "tied_modules", {}).values()]

    if os.environ.get("AUTOPIPE_TEST_GRADS_AT") == "clipped":
        _make_clip = _ds._make_clip

        def _clip_then_probe(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            clip = _make_clip(*args, **kwargs)

            def clipped():  # noqa: ANN202
                norm = clip()
                _dump(_named_ds())
                return norm

            return clipped

        _ds._make_clip = _clip_then_probe
    _step = _ds._ClippingAdamW.step

    def _probe_then_step(self, closure=None):  # noqa: ANN001, ANN202
        if os.environ.get("AUTOPIPE_TEST_GRADS_AT") != "clipped":  # else the clip's probe saves them, after it
            _dump(_named_ds())
        return _step(self, closure)

    _ds._ClippingAdamW.step = _probe_then_step


_WEIGHTS = os.environ.get("AUTOPIPE_TEST_WEIGHTS", "")
if _WEIGHTS:
    import torch

    import autopipe.runtime.torch_engine.trainer as _weights_trainer

    _init_weights = _weights_trainer.Trainer.__init__

    def _init_then_watch(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        _init_weights(self, *args, **kwargs)

        def dump(*_):  # noqa: ANN002, ANN202
            values = {}
            for n, p in self.params.items():
                p = p.detach()
                values[n] = (p.full_tensor() if hasattr(p, "full_tensor") else p).clone()
            step = self.step_count + 1  # the update of this step (the count moves after it)
            torch.save(values, os.path.join(_WEIGHTS, f"weights_rank{os.environ.get('RANK', '0')}_step{step}.pt"))

        self.optimizer.register_step_post_hook(dump)

    _weights_trainer.Trainer.__init__ = _init_then_watch
