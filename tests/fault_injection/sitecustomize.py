"""Fault injection for tests/test_fault_matrix.py, loaded by every Python
process of a test's job (the test puts this folder first on PYTHONPATH).

PTDP_TEST_FAULT = "PHASE:RANK" makes rank RANK kill itself (SIGKILL) when it
reaches PHASE: `startup` (building its model), `train` (its third
iteration), `eval` (its first evaluation) or `save` (writing its part of the
checkpoint after iteration 2). With PTDP_TEST_FAULT_STAMP = PATH it writes
the time of the kill there. Without the variables nothing is changed.
"""

import os

_FAULT = os.environ.get("PTDP_TEST_FAULT")


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
        import ptdp.train.checkpoint as checkpoint
        checkpoint._write_json = killing(
            checkpoint._write_json,
            when=lambda path, data: "iter_0000002" in str(path) and "rng" in str(path))
    elif phase == "train":
        import ptdp.train.loop as loop
        loop.Trainer.step = killing(loop.Trainer.step, when=lambda self, iteration, *a: iteration == 2)
    else:
        raise ValueError(f"PTDP_TEST_FAULT: unknown phase {phase!r}")


if _FAULT:
    _phase, _rank = _FAULT.split(":")
    _install(_phase, int(_rank))
