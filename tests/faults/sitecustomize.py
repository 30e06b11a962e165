"""Fault injection for the runtime tests, kept out of autopipe itself.

A test puts this folder on PYTHONPATH; Python imports ``sitecustomize`` in every process at start,
so each torchrun worker reads ``AUTOPIPE_TEST_KILL_AT=STEP:RANK`` here. The worker of that global
rank wraps ``save_checkpoint`` so that, right after checkpoint STEP is complete, it kills itself
with SIGKILL: a real crash at the worst moment for the resume test, from outside the code under test.
"""

import os

_spec = os.environ.get("AUTOPIPE_TEST_KILL_AT", "")
if _spec and os.environ.get("RANK", "0") == _spec.split(":")[1]:
    import signal

    import autopipe.runtime.checkpoints.store as _checkpoint

    _step = int(_spec.split(":")[0])
    _save = _checkpoint.save_checkpoint

    def _save_then_die(trainer, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        path = _save(trainer, *args, **kwargs)
        if trainer.step_count == _step:
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    _checkpoint.save_checkpoint = _save_then_die

    # the DeepSpeed engine saves through DeepSpeed's own checkpoints
    import autopipe.runtime.deepspeed_engine.trainer as _ds

    _ds_save = _ds._ds_save

    def _ds_save_then_die(engine, root, step, **kwargs):  # noqa: ANN001, ANN003, ANN202
        _ds_save(engine, root, step, **kwargs)
        if step == _step:
            os.kill(os.getpid(), signal.SIGKILL)

    _ds._ds_save = _ds_save_then_die

# ``AUTOPIPE_TEST_EXPERT_GRAD_UNSCALED=1``: every torch-engine rank sums each expert slice's gradient
# over its expert data-parallel group but forgets the division by the replica count (the experts'
# gradients then read dp times the untouched model's), the bug ``--verify`` under ``--ep`` must name.
if os.environ.get("AUTOPIPE_TEST_EXPERT_GRAD_UNSCALED"):
    import autopipe.runtime.torch_engine.trainer as _trainer

    _reduce = _trainer.reduce_expert_grads_

    def _reduce_unscaled(params, names, group, dp, comm):  # noqa: ANN001, ANN202
        return _reduce(params, names, group, 1, comm)

    _trainer.reduce_expert_grads_ = _reduce_unscaled
