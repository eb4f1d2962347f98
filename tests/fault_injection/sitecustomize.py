"""Fault injection for tests/test_fault_matrix.py, loaded by every Python
process of a test's job (the test puts this folder first on PYTHONPATH).

PTDP_TEST_FAULT = "PHASE:RANK" makes rank RANK kill itself (SIGKILL) when it
reaches PHASE: `startup` (building its model), `train` (its third
iteration), `eval` (its first evaluation) or `save` (writing its part of the
checkpoint after iteration 2). With PTDP_TEST_FAULT_STAMP = PATH it writes
the time of the kill there.

PTDP_TEST_STALL = "PHASE:SECONDS" makes every rank sleep SECONDS when it
reaches PHASE, `startup` or `eval` (as above): a signal sent meanwhile meets
the rank in that phase. With PTDP_TEST_FAULT_STAMP = PATH, rank 0 writes the
time the stall began there. Without the variables nothing is changed.
"""

import os

_FAULT = os.environ.get("PTDP_TEST_FAULT")
_STALL = os.environ.get("PTDP_TEST_STALL")


def _install(phase: str, rank: int) -> None:
    import functools
    import signal

    import torch.distributed as dist

    def is_victim() -> bool:
        return dist.is_initialized() and dist.get_rank() == rank

    def die() -> None:
        stamp = os.environ.get("PTDP_TEST_FAULT_STAMP")
        if stamp:  # when the fault happened, for the time-to-exit check
            import time
            with open(stamp, "w") as file:
                file.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    def killing(function, when=lambda *args, **kwargs: True):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if is_victim() and when(*args, **kwargs):
                die()
            return function(*args, **kwargs)
        return wrapper

    # Patched before ptdp.train.loop imports these names.
    if phase == "startup":
        import ptdp.model.gpt as gpt
        gpt.build_chunks = killing(gpt.build_chunks)
    elif phase == "eval":
        import ptdp.train.evaluate as evaluate
        evaluate.evaluate = killing(evaluate.evaluate)
    elif phase == "save":
        import ptdp.checkpoint.snapshot as checkpoint_save
        checkpoint_save.write_json = killing(
            checkpoint_save.write_json,
            when=lambda path, data: "iter_0000002" in str(path) and "rng" in str(path))
    elif phase == "train":
        import ptdp.train.loop as loop
        loop.Trainer.step = killing(loop.Trainer.step, when=lambda self, iteration, *a: iteration == 2)
    else:
        raise ValueError(f"PTDP_TEST_FAULT: unknown phase {phase!r}")


def _install_stall(phase: str, seconds: float) -> None:
    import functools
    import time

    import torch.distributed as dist

    def stalling(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            stamp = os.environ.get("PTDP_TEST_FAULT_STAMP")
            if stamp and (phase == "checks" or dist.is_initialized() and dist.get_rank() == 0):
                with open(stamp, "w") as file:
                    file.write(repr(time.time()))
            time.sleep(seconds)
            return function(*args, **kwargs)
        return wrapper

    if phase == "startup":
        import ptdp.model.gpt as gpt
        gpt.build_chunks = stalling(gpt.build_chunks)
    elif phase == "eval":
        import ptdp.train.evaluate as evaluate
        evaluate.evaluate = stalling(evaluate.evaluate)
    elif phase == "checks":  # `ptdp train`'s checks before launch, in the launcher
        import ptdp.checkpoint.data_settings as checkpoint_data
        checkpoint_data.resolve_data = stalling(checkpoint_data.resolve_data)
    else:
        raise ValueError(f"PTDP_TEST_STALL: unknown phase {phase!r}")


if _FAULT:
    _phase, _rank = _FAULT.split(":")
    _install(_phase, int(_rank))
if _STALL:
    _phase, _seconds = _STALL.split(":")
    _install_stall(_phase, float(_seconds))
