"""One line for a transformers ``Trainer`` script of your own, run by the sbatch scripts (``-- SCRIPT``):

    from ctrain.train.hf import Callback
    trainer = Trainer(..., callbacks=[Callback()])      # or trainer.add_callback(Callback())
    last = get_last_checkpoint(training_args.output_dir) if os.path.isdir(training_args.output_dir) else None
    trainer.train(resume_from_checkpoint=last)

It gives the script what a recipe run has: a preemption signal (Slurm's USR1 warning before the
time limit, its TERM at a requeue or preemption) on any rank makes every rank save a checkpoint of
the same step and exit 75, which the batch script requeues, and the next run resumes from it; the
hang watchdog's heartbeat; and a record of why each rank ended, so an error in the script ends the
job at once instead of costing a retry (:mod:`ctrain.train.script` has the same for a plain loop).
"""

from __future__ import annotations

import signal
from typing import Any

from transformers import TrainerCallback

from ctrain.train import script
from ctrain.train.callbacks import Preemption


class Callback(TrainerCallback):
    """Preemption to a checkpoint and exit 75, heartbeats, and exit records, for any ``Trainer``."""

    def __init__(self, signals: tuple[str, ...] = script.SIGNALS) -> None:
        self.signals = [getattr(signal, name) for name in signals]
        self.preemption: Preemption | None = None
        self.heartbeat = script.heartbeat_file()
        script.record_exits()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.preemption = Preemption(self.signals, args.device)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.heartbeat is not None:
            self.heartbeat.progress(state.global_step)
        if self.preemption is not None:
            self.preemption.on_step_end(args, state, control)

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.heartbeat is not None:
            self.heartbeat.progress(state.global_step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.heartbeat is not None:
            self.heartbeat.beat(state.global_step)
        if self.preemption is not None and self.preemption.stopped_at == state.global_step:
            # The checkpoint of the agreed step is written: end with the requeue code (the rest of
            # the script, a final save say, must not run).
            script.exit_preempted()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.heartbeat is not None:
            self.heartbeat.done()
        if self.preemption is not None:
            self.preemption.restore()
